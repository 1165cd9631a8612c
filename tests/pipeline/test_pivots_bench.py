"""benchmarks/pivots.py's short twin: one arm of each kind on a barely fine-tuned tiny model, a
small token budget, through the real orchestrator, scorer loop and step-wise worker; every unit
accepted whole (run_arm raises on a refused sample) and the counts consistent; a training arm
whose versions advance on the orchestrator's batches; the tokens-to-target rule."""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path
from typing import Any

import pytest

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "pivots.py"


@pytest.fixture(scope="module")
def bench() -> Any:
    spec = importlib.util.spec_from_file_location("pivots_bench", BENCH)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def checkpoint(bench: Any, tmp_path_factory: pytest.TempPathFactory) -> str:
    directory = str(tmp_path_factory.mktemp("pivots") / "v0")
    assert bench.finetune(directory, steps=20, seed=0) > 0
    assert os.path.isfile(os.path.join(directory, "config.json"))
    return directory


@pytest.mark.parametrize("arm", ["root", "prm", "prm_failed"])
def test_an_arm_runs_to_its_budget(bench: Any, checkpoint: str, arm: str) -> None:
    result = bench.run_arm(arm, 0, checkpoint, budget=120, group_size=2, k=2, token_s=0.015)  # a real model's pace
    assert result["tokens"] >= 120 and result["units"] >= 1
    assert result["tokens"] == result["tokens_kept"] + result["tokens_discarded"]
    assert 0 <= result["recovered"] <= result["failed_prompts"] <= result["units"]
    assert 0 <= result["recovered_by_branch"] <= result["all_roots_failed"] <= result["failed_prompts"]
    assert result["steps_posted"] > 0
    if arm == "root":
        assert result["tokens_saved"] == 0 and result["verdicts_used"] == 0 and result["tokens_discarded"] == 0
    else:
        assert result["verdicts_used"] > 0  # a barely trained model's steps are judged wrong, and chains stop
    # Each unit of the pivot arms (one pivot each) branched, or was sent short (no boundary) or
    # unbranched (`all_failed`: a root known right), and the orchestrator completed it as sent.
    if arm != "root":
        assert result["units"] == result["pivots"] + result["units_short"] + result["units_unbranched"]
    assert result["units_unbranched"] == 0 or arm == "prm_failed"


def test_units_with_a_right_root_go_unbranched_and_the_orchestrator_completes_them_as_sent(
    bench: Any, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """`prm_failed` on a model trained enough that some roots are right (400 steps: about a third):
    the units with a root known right are sent as their roots alone, the others with their branch
    node, and the orchestrator completes each as it comes (run_arm finds it ready, refused nothing)."""
    directory = str(tmp_path_factory.mktemp("tuned") / "v0")
    bench.finetune(directory, steps=400, seed=0)
    result = bench.run_arm("prm_failed", 0, directory, budget=240, group_size=2, k=2, token_s=0.0, verdict_lag_tokens=1)
    assert result["units_unbranched"] > 0 and result["pivots"] > 0
    assert result["units"] == result["pivots"] + result["units_short"] + result["units_unbranched"]


def test_with_a_fixed_verdict_lag_an_arms_row_is_the_same_at_any_pace(bench: Any, checkpoint: str) -> None:
    """`--verdict-lag-tokens`: a verdict acts that many tokens after its step ended, so a PRM arm
    paced as a fast machine and as a slow one (verdicts back after fewer or more decoding steps)
    stops the same chains at the same tokens: the same units, tokens and counts. Without it, the
    row says what lag the machine gave (`verdict_lags`)."""
    same = ("units", "tokens", "tokens_kept", "tokens_discarded", "tokens_saved", "verdicts_used", "recovered",
            "no_gradient_units", "decode_steps", "verdict_timeouts")
    rows = [bench.run_arm("prm", 0, checkpoint, budget=120, group_size=2, k=2, token_s=pace, verdict_lag_tokens=1)
            for pace in (0.0, 0.02)]
    assert [rows[0][key] for key in same] == [rows[1][key] for key in same]
    assert rows[0]["verdicts_used"] > 0 and rows[0]["tokens_discarded"] == rows[0]["verdicts_used"]  # 1 token each
    assert rows[0]["verdict_lags"] == {} and rows[0]["verdict_lag_tokens"] == 1
    free = bench.run_arm("prm", 0, checkpoint, budget=120, group_size=2, k=2, token_s=0.02)
    assert free["verdict_lag_tokens"] is None and sum(free["verdict_lags"].values()) > 0
    assert min(int(lag) for lag in free["verdict_lags"]) >= 1  # read at the earliest a token after its step ended
    assert free["verdict_lag_median"] in {int(lag) for lag in free["verdict_lags"]}


def test_the_median_lag_counts_a_verdict_after_its_batch_as_a_longer_lag(bench: Any) -> None:
    assert bench.lag_median([1, 2, 3], []) == 2
    # Two steps unseen after 3 tokens lagged more than 3: of 5, three lag over 2.
    assert bench.lag_median([1, 2, 3], [3, 3]) == 3
    assert bench.lag_median([1], [5, 5, 5]) is None  # most lag longer than any seen
    assert bench.lag_median([3, 1, 2], [0]) == 2  # unseen at 0: at risk for no lag, so the median of what was seen


@pytest.mark.parametrize("value", ["-1", "4097", "two", "2.5"])
def test_a_bad_verdict_lag_is_refused(bench: Any, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
                                      value: str) -> None:
    monkeypatch.setattr("sys.argv", ["pivots.py", "--verdict-lag-tokens", value, "--budget", "0"])
    with pytest.raises(SystemExit) as exit_:
        bench.main()
    assert exit_.value.code == 2 and "--verdict-lag-tokens takes an integer from 0 to 4096" in capsys.readouterr().err


@pytest.mark.parametrize(("flag", "value", "message"), [
    ("--model", "no/such/dir", "--model takes an HF causal LM directory (config.json, weights, tokenizer), not 'no/such/dir': "
     "it holds no config.json"),
    ("--sft-lr", "0", "--sft-lr takes a positive learning rate under 1, not 0.0"),
    ("--sft-lr", "fast", "--sft-lr takes a positive learning rate, not 'fast'"),
])
def test_a_bad_model_or_fine_tuning_rate_is_refused(bench: Any, monkeypatch: pytest.MonkeyPatch,
                                                    capsys: pytest.CaptureFixture[str], flag: str, value: str, message: str) -> None:
    monkeypatch.setattr("sys.argv", ["pivots.py", flag, value, "--budget", "0"])
    with pytest.raises(SystemExit) as exit_:
        bench.main()
    assert exit_.value.code == 2 and message in capsys.readouterr().err


def test_a_kept_checkpoint_is_fine_tuned_once_and_reused_only_with_its_recipe(
        bench: Any, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """`--checkpoint DIR`: fine-tuned there when it holds none (moved there whole, its recipe
    beside), its loss read back after; refused where it holds other files or another recipe."""
    kept = str(tmp_path / "kept")
    calls: list[str] = []
    real = bench.finetune

    def counted(directory: str, *args: Any, **kwargs: Any) -> float:
        calls.append(directory)
        return real(directory, *args, **kwargs)

    monkeypatch.setattr(bench, "finetune", counted)
    recipe = bench.recipe_of(2, 4, None, None)
    assert bench.checkpoint_refusal(kept, recipe) is None
    loss = bench.fine_tuned(kept, 2, digits=4)
    assert loss > 0 and len(calls) == 1 and calls[0] != kept  # fine-tuned beside, then moved
    assert os.path.isfile(os.path.join(kept, "config.json")) and not list(tmp_path.glob("kept.partial-*"))
    assert bench.checkpoint_refusal(kept, recipe) is None
    assert bench.fine_tuned(kept, 2, digits=4) == loss and len(calls) == 1  # reused, not fine-tuned again
    assert json.loads((tmp_path / "kept" / "finetune.json").read_text())["sft_lr"] == 3e-3  # the rate used, default or not
    other = bench.checkpoint_refusal(kept, bench.recipe_of(3, 5, None, None))
    assert other == (f"--checkpoint {kept} was fine-tuned with other options: digits 4 (asked: 5), sft_steps 2 (asked: 3); "
                     "give those options, or a new directory")
    empty = tmp_path / "empty"
    empty.mkdir()
    assert bench.checkpoint_refusal(str(empty), recipe) is None
    bench.fine_tuned(str(empty), 2, digits=4)
    assert (empty / "finetune.json").is_file()


@pytest.mark.parametrize(("files", "message"), [
    ({"weights.bin": "x"}, "holds files but no finetune.json: it is not a checkpoint this benchmark fine-tuned; "
     "give a new or empty directory"),
    ({"finetune.json": "{not json"}, "its finetune.json cannot be read"),
    ({"finetune.json": "[1, 2]"}, "its finetune.json is not a JSON object"),
    ({"finetune.json": json.dumps({"model": "tiny", "digits": 4, "sft_steps": 600, "sft_lr": 1e-3, "seed": 0})},
     "was fine-tuned with other options: sft_lr 0.001 (asked: 0.003)"),
    ({"finetune.json": json.dumps({"model": "tiny", "digits": 4, "sft_steps": 600, "sft_lr": 3e-3, "seed": 0})},
     "its finetune.json holds no numeric sft_loss"),
])
def test_a_checkpoint_that_cannot_be_reused_is_refused_before_anything_runs(
        bench: Any, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path,
        files: dict[str, str], message: str) -> None:
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    monkeypatch.setattr(bench, "finetune", lambda *args, **kwargs: pytest.fail("fine-tuned despite the refusal"))
    monkeypatch.setattr("sys.argv", ["pivots.py", "--checkpoint", str(tmp_path), "--budget", "0", "--train-budget", "100"])
    with pytest.raises(SystemExit) as exit_:
        bench.main()
    error = capsys.readouterr().err
    assert exit_.value.code == 2 and message in error and "Traceback" not in error


def test_an_hf_model_directory_is_fine_tuned_and_trained_with_its_own_tokenizer(
        bench: Any, checkpoint: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # `--model DIR`: any HF causal LM directory (here the tiny fine-tuned one, read back as one:
    # its weights by from_pretrained, its tokenizer by AutoTokenizer) fine-tuned further, then an
    # arm trained from it, the orchestrator configured with a pretrained model at that path.
    tuned = str(tmp_path / "v0")
    assert bench.finetune(tuned, steps=3, seed=0, base=checkpoint, lr=1e-3) > 0
    assert bench.tokenizer_of(tuned)("7324=").input_ids == bench.tokenizer_of(None)("7324=").input_ids
    # A chat model's directory (SmolLM2-Instruct) carries a template: the arms' prompts stay the raw
    # text the model was fine-tuned and is evaluated on (with the template, no rollout was ever right).
    Path(tuned, "chat_template.jinja").write_text("{% for m in messages %}<chat>{{ m['content'] }}{% endfor %}")
    assert bench.tokenizer_of(tuned).chat_template is not None
    import orchestrator.state

    encoders: list[Any] = []
    real_encoder = orchestrator.state.make_prompt_encoder
    monkeypatch.setattr(orchestrator.state, "make_prompt_encoder",
                        lambda *args, **kwargs: encoders.append(real_encoder(*args, **kwargs)) or encoders[-1])
    heldout = bench.heldout_prompts(8, seeds=1)
    training = bench.Training(groups_per_step=2, lr=1e-3, heldout=heldout, eval_samples=2, eval_every=1)
    result = bench.run_arm("prm", 0, tuned, budget=160, group_size=2, k=2, training=training, base=checkpoint)
    from decentrl.config import ChainTaskConfig
    from decentrl.tasks.chain import ChainTask

    prompt = ChainTask(ChainTaskConfig(num_digits=4, num_prompts=4096, seed=0)).prompt(0)
    assert [encode(prompt) for encode in encoders] == [bench.tokenizer_of(tuned)(prompt.text).input_ids]
    assert result["versions"] >= 1 and len(result["curve"]) == result["versions"] + 1
    assert result["sampler_kl_max"] < 1e-6  # the worker's logprobs are the learner's, from the same checkpoint
    assert bench.device_of(None) == "cpu"


def test_a_training_arm_advances_its_versions(bench: Any, checkpoint: str) -> None:
    heldout = bench.heldout_prompts(8, seeds=1)
    training = bench.Training(groups_per_step=2, lr=1e-3, heldout=heldout, eval_samples=2, eval_every=1)
    result = bench.run_arm("root", 0, checkpoint, budget=160, group_size=2, k=2, training=training)
    steps = result["units"] // 2
    assert steps >= 1 and result["versions"] == steps
    assert [point["version"] for point in result["curve"]] == list(range(steps + 1))
    assert [point["tokens"] for point in result["curve"]] == sorted(point["tokens"] for point in result["curve"])
    assert all(0.0 <= point["accuracy"] <= 1.0 for point in result["curve"])
    assert result["sampler_kl_max"] < 1e-6  # the trainer's logprobs are the worker's, before each step


def test_step_verdicts_train_as_process_rewards_in_every_arm_but_root(bench: Any, checkpoint: str) -> None:
    """`--process-weight`: an arm's samples reach the trainer with per-token advantages from their
    steps' verdicts, every one of them (the unit is sent once its last steps are judged); the
    root-only GRPO arm trains on outcomes alone."""
    heldout = bench.heldout_prompts(4, seeds=1)
    training = bench.Training(groups_per_step=2, lr=1e-3, heldout=heldout, eval_samples=1, eval_every=8, process_weight=1.0)
    results = {arm: bench.run_arm(arm, 0, checkpoint, budget=100, group_size=2, k=2, training=training)
               for arm in ("root_process", "root")}
    assert all(result["versions"] >= 1 for result in results.values())
    assert results["root_process"]["process_scored_samples"] == results["root_process"]["trained_samples"]
    assert results["root_process"]["process_moved_samples"] > 0
    assert results["root"]["process_moved_samples"] == 0 and results["root"]["trained_samples"] > 0
    # Units without a gradient count the process rewards where they train (never more than the
    # outcomes alone leave), and are the outcomes' count where none do.
    assert results["root_process"]["no_gradient_units"] <= results["root_process"]["no_outcome_gradient_units"]
    assert results["root"]["no_gradient_units"] == results["root"]["no_outcome_gradient_units"]


def test_the_learners_step_follows_the_advantages(bench: Any, checkpoint: str) -> None:
    """A real trainer step on a batch of two samples of one prompt: the one with the positive
    advantage gets likelier, the other less likely (a step on the tree's advantages, as the arms take)."""
    import torch

    from decentrl.api.wire import TrainBatch, TrainSample
    from decentrl.config import parse_config
    from decentrl.model.build import build_tiny_tokenizer

    config = parse_config({
        "run_name": "learner", "group_size": 2, "model": {"type": "tiny", **bench.SHAPE},
        "task": {"type": "chain", "num_digits": 4, "num_prompts": 8, "seed": 0}, "sampling": {"temperature": 1.0, "max_tokens": 24},
        "trainer": {"groups_per_step": 1, "lr": 1e-3},
    })
    tokenizer = build_tiny_tokenizer()
    learner = bench.Learner(checkpoint, config)
    prompt = tokenizer("1234=").input_ids
    right, wrong = (tokenizer(text, add_special_tokens=False).input_ids for text in ("1=3=6=10=", "1=4=7=11="))

    def logprobs(completion: list[int]) -> list[float]:
        with torch.no_grad():
            logits = learner.model(input_ids=torch.tensor([prompt + completion])).logits[0, len(prompt) - 1 : -1].float()
        return logits.log_softmax(-1).gather(-1, torch.tensor(completion)[:, None])[:, 0].tolist()

    def logprob(completion: list[int]) -> float:
        return sum(logprobs(completion))

    before = [logprob(right), logprob(wrong)]
    samples = [  # sampled by the same weights: their logprobs
        TrainSample(prompt_token_ids=prompt, completion_token_ids=ids, logprobs=logprobs(ids), advantage=advantage,
                    reward=reward, policy_version=0, group_id="g")
        for ids, advantage, reward in ((right, 0.5, 1.0), (wrong, -0.5, 0.0))
    ]
    step = learner.step(TrainBatch(trainer_version=0, samples=samples, staleness_histogram={"0": 2}, rollouts_accepted=2, stale_dropped=0))
    assert step["trained"] == 2 and step["grad_norm"] > 0
    assert logprob(right) > before[0] and logprob(wrong) < before[1]


def test_a_unit_without_gradient_is_one_whose_every_advantage_is_zero_process_rewards_included(
    bench: Any, make_rollout: Any
) -> None:
    """`no_gradient_units` counts units whose every advantage the trainer gets is 0: equal outcomes
    with steps' verdicts that differ still give a gradient (process rewards), all equal ones do not; a
    tree whose roots are equal and whose branches are equal among themselves gives none either."""
    from decentrl.api.wire import Lease
    from decentrl.config import AdvantageConfig
    from orchestrator.buffer import Group

    lease = Lease(lease_id="l", prompt_id=0, prompt_token_ids=[1, 2], group_size=2, deadline=0.0)
    rollouts = [make_rollout(lease, [5, 6, 7, 8], step_ends=[2, 4]) for _ in range(2)]

    def unit(rewards: list[float], scores: list[list[float]] | None) -> Group:
        group = Group.of("l", 0, rollouts, rewards)
        if scores is not None:
            group.step_ends, group.step_scores = [[1, 3], [1, 3]], scores  # type: ignore[assignment]
        return group

    process = AdvantageConfig(process_weight=1.0, outcome_weight=1.0)
    outcome_only = AdvantageConfig(process_weight=0.0, outcome_weight=1.0)
    assert bench.gives_gradient(unit([1.0, 1.0], [[1.0, 1.0], [1.0, 0.0]]), process)
    assert not bench.gives_gradient(unit([1.0, 1.0], [[1.0, 1.0], [1.0, 0.0]]), outcome_only)
    assert not bench.gives_gradient(unit([0.0, 0.0], [[1.0, 1.0], [1.0, 1.0]]), process)
    # Verdicts are centred over all the unit's steps: a right step before a wrong one moves tokens.
    assert bench.gives_gradient(unit([0.0, 0.0], [[1.0, 0.0], [1.0, 0.0]]), process)
    assert not bench.gives_gradient(unit([0.0, 0.0], None), process)
    assert bench.gives_gradient(unit([0.0, 1.0], None), outcome_only)
    parent = rollouts[0]
    branch = make_rollout(lease, [7, 8], prompt_token_ids=[1, 2, 5, 6],
                          node={"node_id": "b0", "parent": {"rollout_id": parent.rollout_id, "at": 2}})
    tree = Group.of("l", 0, [*rollouts, branch, branch.model_copy(update={"rollout_id": "other"})], [0.0, 0.0, 1.0, 1.0])
    assert not bench.gives_gradient(tree, outcome_only)  # roots level, branches level: every advantage 0


def test_heldout_prompts_are_none_of_the_arms(bench: Any) -> None:
    from decentrl.config import ChainTaskConfig
    from decentrl.tasks.chain import ChainTask

    heldout = bench.heldout_prompts(64, seeds=2)
    task = ChainTask(ChainTaskConfig(num_digits=4, num_prompts=4096, seed=1))
    assert len(set(heldout)) == 64 and not set(heldout) & {task.prompt(i).text for i in range(task.num_prompts)}


def test_tokens_to_target_is_the_first_point_at_the_roots_final_accuracy(bench: Any) -> None:
    root = [{"tokens": 0, "accuracy": 0.2}, {"tokens": 500, "accuracy": 0.3}, {"tokens": 1000, "accuracy": 0.4}]
    fast = [{"tokens": 0, "accuracy": 0.2}, {"tokens": 600, "accuracy": 0.41}, {"tokens": 1000, "accuracy": 0.35}]
    never = [{"tokens": 0, "accuracy": 0.2}, {"tokens": 1000, "accuracy": 0.39}]
    assert bench.tokens_to_target(root, fast) == 0.6
    assert bench.tokens_to_target(root, never) is None
    assert bench.mean_and_se([0.6, 0.8]) == pytest.approx((0.7, 0.1))
    assert bench.mean_and_se([0.6, None]) == (None, None)
    assert [p["accuracy"] for p in bench.smoothed(fast)] == pytest.approx([0.2, 0.305, (0.2 + 0.41 + 0.35) / 3])
    assert bench.tokens_to_target(bench.smoothed(root), bench.smoothed(fast)) == 0.6  # 0.305 against the root's 0.3
    spike = [{"tokens": tokens, "accuracy": 0.45 if tokens == 300 else 0.2} for tokens in (0, 150, 300, 450, 600)]
    assert bench.tokens_to_target(root, spike) == 0.3 and bench.tokens_to_target(bench.smoothed(root), bench.smoothed(spike)) is None


def test_the_root_only_arms_take_the_root_arms_units_a_step(bench: Any) -> None:
    # root_process (root-only units with process rewards) is root-only GRPO's control: its units a
    # step are the root arm's (until 2026-11-29 it took the pivot arms', 6 against 8: fewer tokens a step).
    assert [bench.units_a_step(arm, 6, 8) for arm in ("root", "root_process", "random", "prm")] == [8, 8, 6, 6]
    assert [bench.units_a_step(arm, 6, 0) for arm in ("root", "root_process", "prm")] == [6, 6, 6]


def test_pooled_tokens_to_target_reads_the_seeds_mean_curves(bench: Any) -> None:
    # Seed 0's root ends high on one evaluation (0.5), so its PRM arm never reaches it per seed;
    # on the mean curves the target is (0.5 + 0.3) / 2 = 0.4, which PRM's mean (0.35 + 0.45) / 2
    # reaches at 500 of 1,000 tokens (linear between evaluations, read every 250).
    root = [[{"tokens": 0, "accuracy": 0.2}, {"tokens": 500, "accuracy": 0.3}, {"tokens": 1000, "accuracy": 0.5}],
            [{"tokens": 0, "accuracy": 0.2}, {"tokens": 1000, "accuracy": 0.3}]]
    prm = [[{"tokens": 0, "accuracy": 0.2}, {"tokens": 500, "accuracy": 0.35}, {"tokens": 1000, "accuracy": 0.45}],
           [{"tokens": 0, "accuracy": 0.2}, {"tokens": 400, "accuracy": 0.45}, {"tokens": 900, "accuracy": 0.45}]]
    assert bench.tokens_to_target(root[0], prm[0]) is None and bench.tokens_to_target(root[1], prm[1]) == 0.4
    assert bench.accuracy_at(prm[1], 200) == pytest.approx(0.325) and bench.accuracy_at(prm[1], 950) == 0.45
    assert bench.accuracy_at(root[0], 750) == pytest.approx(0.4)
    assert bench.pooled_tokens_to_target(root, prm, 1000) == 0.5
    assert bench.pooled_tokens_to_target(root, prm, 1000, step=100) == 0.5  # 0.385 at 400
    assert bench.pooled_tokens_to_target(root, [root[1], root[1]], 1000) is None
    low, high = bench.pooled_interval(root, prm, 1000)
    assert low is not None and high is None  # a resample of seed 0 alone never reaches its target
    assert bench.pooled_interval([root[1]] * 3, [prm[1]] * 3, 1000) == (0.25, 0.25)  # one seed: 0.356 at 250 against 0.3
    figures = bench.training_figures([{"arm": arm, "seed": seed, "curve": [{**p, "version": 0} for p in curves[seed]]}
                                      for arm, curves in (("root", root), ("prm", prm), ("random", root), ("root_process", prm))
                                      for seed in (0, 1)])
    assert figures["tokens_to_target_pivot_vs_root"] is None and figures["tokens_to_target_pivot_vs_root_pooled"] == 0.5
    assert figures["tokens_to_target_random_vs_root_pooled"] == 1.0
    assert figures["tokens_to_target_root_process_vs_root_pooled"] == 0.5  # a control's too, on the same target
    assert figures["tokens_to_target_pivot_vs_root_pooled_interval90"][1] is None


def test_the_arms_are_compared_paired_by_seed_from_rows_of_runs_apart(bench: Any, tmp_path: Path) -> None:
    # The mean over tokens is the trapezoid area over the last point's tokens; each paired
    # difference is per seed, then its mean and standard error; seeds run apart read together.
    curve = [{"tokens": 0, "accuracy": 0.2, "version": 0}, {"tokens": 500, "accuracy": 0.4, "version": 2},
             {"tokens": 1000, "accuracy": 0.4, "version": 4}]
    assert bench.mean_accuracy(curve) == pytest.approx((0.3 * 500 + 0.4 * 500) / 1000)

    def row(arm: str, seed: int, lift: float) -> dict[str, Any]:
        return {"arm": arm, "seed": seed, "keep_cache": True, "post_steps": True,
                "curve": [{**p, "accuracy": p["accuracy"] + lift * (p["tokens"] > 0)} for p in curve]}

    files = []
    for seed, lift in ((0, 0.02), (1, 0.04)):
        files.append(tmp_path / f"seed{seed}.jsonl")
        lines = [row("root", seed, 0.0), row("random", seed, lift / 2), row("prm", seed, lift), {"summary": "of a run"}]
        files[-1].write_text("\n".join(json.dumps(line) for line in lines) + "\n")
    trained, runs, _, _, _ = bench.read_rows(*map(str, files))
    assert len(trained) == 6 and runs == []
    figures = bench.training_figures(trained)
    assert figures["heldout_final_prm_minus_root"]["per_seed"] == pytest.approx([0.02, 0.04])
    assert figures["heldout_final_prm_minus_root"]["mean"] == pytest.approx(0.03)
    assert figures["heldout_final_prm_minus_root"]["se"] == pytest.approx(0.01)
    assert figures["heldout_mean_over_tokens_prm_minus_random"]["per_seed"] == pytest.approx([0.01 * 0.75, 0.02 * 0.75])
    assert figures["heldout_prm"]["mean_over_tokens_per_seed"] == pytest.approx([0.35 + 0.02 * 0.75, 0.35 + 0.04 * 0.75])


def test_the_arms_that_branch_all_failed_are_compared_with_root_and_their_twins(bench: Any) -> None:
    # Beside the three arms (their figures unchanged), each variant of a variable unit size against
    # root-only GRPO, its always-branching twin, and the other variant, paired by seed.
    curve = [{"tokens": 0, "accuracy": 0.2, "version": 0}, {"tokens": 1000, "accuracy": 0.4, "version": 4}]
    lifts = {"root": 0.0, "random": 0.01, "prm": 0.02, "random_failed": 0.03, "prm_failed": 0.05}

    def row(arm: str, seed: int) -> dict[str, Any]:
        lift = lifts[arm] * (seed + 1)
        return {"arm": arm, "seed": seed, "curve": [{**p, "accuracy": p["accuracy"] + lift * (p["tokens"] > 0)} for p in curve],
                "recovered_per_1k_tokens": 4.0 + 10 * lift, "no_gradient_fraction": 0.3, "no_outcome_gradient_units": 30,
                "units": 100, "tokens_saved": 10, "all_roots_failed": 40, "recovered_by_branch": 5,
                "units_unbranched": 60 * ("failed" in arm)}

    trained = [row(arm, seed) for seed in (0, 1) for arm in lifts]
    figures = bench.training_figures(trained)
    assert figures["heldout_final_prm_failed_minus_root"]["per_seed"] == pytest.approx([0.05, 0.10])
    assert figures["heldout_final_prm_failed_minus_prm"]["per_seed"] == pytest.approx([0.03, 0.06])
    assert figures["heldout_final_random_failed_minus_random"]["per_seed"] == pytest.approx([0.02, 0.04])
    assert figures["heldout_final_prm_failed_minus_random_failed"]["per_seed"] == pytest.approx([0.02, 0.04])
    assert figures["heldout_final_prm_minus_root"]["per_seed"] == pytest.approx([0.02, 0.04])  # as without the variants
    assert figures["tokens_to_target_prm_failed_vs_root_per_seed"] == pytest.approx([1.0, 1.0])  # reached at the last point
    assert len(figures["tokens_to_target_prm_failed_vs_root_pooled_interval90"]) == 2
    assert figures["heldout_prm_failed"]["final_per_seed"] == pytest.approx([0.45, 0.5])
    assert figures["training_counts_prm_failed"]["units_unbranched"] == [60, 60]
    assert figures["training_counts_prm"]["units_unbranched"] == [0, 0]
    assert figures["training_recovered_per_1k_tokens_prm_failed_vs_root"]["per_seed"] == pytest.approx([4.5 / 4.0, 5.0 / 4.0])
    # A variant without every seed's row is left out, not half-compared.
    partial = [r for r in trained if not (r["arm"] == "random_failed" and r["seed"] == 1)]
    figures = bench.training_figures(partial)
    assert "heldout_random_failed" not in figures and "heldout_final_prm_failed_minus_random_failed" not in figures
    assert "heldout_final_prm_failed_minus_root" in figures
    # Seeds of some arms alone (more seeds of root-only GRPO and one variant): their figures, the
    # goal's key None without the PRM arm's rows; nothing without root-only GRPO's.
    some = [r for r in trained if r["arm"] in ("root", "prm_failed")]
    figures = bench.training_figures(some)
    assert figures["tokens_to_target_pivot_vs_root"] is None and "heldout_prm" not in figures
    assert figures["heldout_final_prm_failed_minus_root"]["per_seed"] == pytest.approx([0.05, 0.10])
    assert figures["training_recovered_per_1k_tokens_prm_failed_vs_root"]["per_seed"] == pytest.approx([4.5 / 4.0, 5.0 / 4.0])
    assert bench.training_figures([r for r in trained if r["arm"] != "root"]) == {"tokens_to_target_pivot_vs_root": None}


def test_recovery_is_compared_paired_by_seed(bench: Any) -> None:
    # Each seed's PRM (or random) arm over that seed's root arm (the same roots), then the mean and
    # its standard error; the worker's measures from the first seed's rows.
    def row(arm: str, seed: int, recovered: float, **more: Any) -> dict[str, Any]:
        return {"arm": arm, "seed": seed, "recovered_per_1k_tokens": recovered, "solved_per_1k_tokens": 1.0,
                "no_gradient_fraction": 0.3, "tokens_saved": 1, "verdict_wait_s": 0.5, "step_post_wait_s": 0.5,
                "branch_success": None, "root_success": 0.3, "tokens": 1000, "decode_s": 9.0, "tokens_per_decode_s": 100.0,
                "wall_s": 10.0, "cache_rebuild_s": 0.0, **more}

    runs = [row("root", 0, 8.0), row("prm", 0, 8.0), row("random", 0, 4.0),
            row("root", 1, 10.0), row("prm", 1, 12.0), row("random", 1, 10.0)]
    figures = bench.sampling_figures(runs, row("prm", 0, 8.0), row("root", 0, 8.0, verdict_wait_s=0.0))
    assert figures["recovered_per_1k_tokens_pivot_vs_root_paired"]["per_seed"] == pytest.approx([1.0, 1.2])
    assert figures["recovered_per_1k_tokens_pivot_vs_root_paired"]["mean"] == pytest.approx(1.1)
    assert figures["recovered_per_1k_tokens_pivot_vs_root_paired"]["se"] == pytest.approx(0.1)
    assert figures["recovered_per_1k_tokens_random_vs_root_paired"]["per_seed"] == pytest.approx([0.5, 1.0])
    assert figures["recovered_per_1k_tokens_pivot_vs_root"] == pytest.approx(10.0 / 9.0)  # the ratio of the means
    assert figures["prm_decoding_share"] == pytest.approx(0.9)  # 9 s decoding, 0.5 s for verdicts, 0.5 s for posts
    assert figures["throughput_prm_with_waits_vs_without"] == pytest.approx((1000 / 9.5) / 100.0)


@pytest.mark.parametrize("digits", ["1", "17", "four", "4.5"])
def test_digits_out_of_the_chain_tasks_bounds_are_refused(bench: Any, monkeypatch: pytest.MonkeyPatch,
                                                          capsys: pytest.CaptureFixture[str], digits: str) -> None:
    monkeypatch.setattr("sys.argv", ["pivots.py", "--digits", digits, "--budget", "0"])
    with pytest.raises(SystemExit) as exit_:
        bench.main()
    assert exit_.value.code == 2 and "--digits takes an integer from 2 to 16" in capsys.readouterr().err


def test_the_chains_digits_set_the_prompts_and_the_token_limit(bench: Any, checkpoint: str) -> None:
    """`--digits`: the held-out prompts and an arm's prompts have that many digits (a step each), and
    a chain's token limit grows with them (24 at the default 4)."""
    assert bench.max_tokens(bench.DIGITS) == 24 and bench.max_tokens(8) == 48
    assert {len(text) for text in bench.heldout_prompts(16, seeds=1, digits=8)} == {9}  # 8 digits and '='
    result = bench.run_arm("root", 0, checkpoint, budget=60, group_size=2, k=2, digits=8)
    assert result["digits"] == 8 and result["units"] >= 1
    # 4-digit chains end within 24 tokens a sample; the fine-tuned model writes past 24 on 8 digits
    assert result["tokens"] / (2 * result["units"]) > 12


def _training_rows(tmp_path: Path) -> Path:
    """Rows of one seed's three training arms: root rising to 0.4 at 1,000 tokens, PRM at 0.3 by
    300 tokens, random at 0.3 by 500."""
    def row(arm: str, points: list[tuple[int, float]]) -> dict[str, Any]:
        return {"arm": arm, "seed": 0, "keep_cache": True, "post_steps": True,
                "curve": [{"tokens": tokens, "accuracy": accuracy, "version": 2 * i} for i, (tokens, accuracy) in enumerate(points)]}

    rows = [row("root", [(0, 0.2), (500, 0.3), (1000, 0.4)]), row("prm", [(0, 0.2), (300, 0.3), (700, 0.35), (1000, 0.38)]),
            row("random", [(0, 0.2), (500, 0.3), (1000, 0.39)])]
    path = tmp_path / "rows.jsonl"
    path.write_text("\n".join(json.dumps(line) for line in rows) + "\n")
    return path


def _summary(bench: Any, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], *argv: str) -> dict[str, Any]:
    monkeypatch.setattr("sys.argv", ["pivots.py", "--budget", "0", *argv])
    bench.main()
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


def test_until_tokens_reads_the_arms_at_a_smaller_budget_off_the_same_rows(
        bench: Any, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    """`--until-tokens N`: each curve's evaluations at or under N tokens; the root arm's final is its
    last point there, and the PRM arm's tokens to it are over that point's tokens."""
    rows = str(_training_rows(tmp_path))
    whole = _summary(bench, monkeypatch, capsys, "--rows", rows)
    assert whole["tokens_to_target_pivot_vs_root"] is None and whole["until_tokens"] is None  # 0.38 never reaches 0.4
    cut = _summary(bench, monkeypatch, capsys, "--rows", rows, "--until-tokens", "600")
    assert cut["until_tokens"] == 600
    assert cut["tokens_to_target_pivot_vs_root"] == pytest.approx(300 / 500)  # root's final 0.3 at 500; PRM's 0.3 at 300
    assert cut["tokens_to_target_random_vs_root"] == pytest.approx(1.0)
    assert cut["heldout_prm"]["final_per_seed"] == [0.3] and cut["heldout_root"]["final_per_seed"] == [0.3]
    assert bench.until(bench.read_rows(rows)[0], 1000) == bench.read_rows(rows)[0]  # a cut past every point changes nothing


@pytest.mark.parametrize(("value", "message"), [
    ("0", "--until-tokens takes a positive integer (generated tokens), not 0"),
    ("-600", "--until-tokens takes a positive integer (generated tokens), not -600"),
    ("6k", "--until-tokens takes a positive integer (generated tokens), not '6k'"),
    ("400", "--until-tokens 400 leaves the root arm of seed 0 no evaluation after its start (its first is at 500 tokens)"),
])
def test_until_tokens_that_leave_no_curve_are_refused(bench: Any, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
                                                      tmp_path: Path, value: str, message: str) -> None:
    monkeypatch.setattr("sys.argv", ["pivots.py", "--budget", "0", "--rows", str(_training_rows(tmp_path)), "--until-tokens", value])
    with pytest.raises(SystemExit) as exit_:
        bench.main()
    assert exit_.value.code == 2 and message in capsys.readouterr().err


def test_until_tokens_without_training_curves_is_refused(bench: Any, monkeypatch: pytest.MonkeyPatch,
                                                         capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    sampling = tmp_path / "sampling.jsonl"
    sampling.write_text(json.dumps({"arm": "root", "seed": 0, "keep_cache": True, "post_steps": True}) + "\n")
    for argv in (["--until-tokens", "600"], ["--rows", str(sampling), "--until-tokens", "600"]):
        monkeypatch.setattr("sys.argv", ["pivots.py", "--budget", "0", *argv])
        with pytest.raises(SystemExit) as exit_:
            bench.main()
        assert exit_.value.code == 2 and "--until-tokens cuts the training curves" in capsys.readouterr().err


def test_the_training_arms_counts_are_compared_paired_by_seed(bench: Any) -> None:
    """Recovery per 1k tokens, units without a gradient (process rewards counted, and outcomes
    alone) and tokens saved, as the arms train: each seed's pivot arm against its root arm."""
    curve = [{"tokens": 0, "accuracy": 0.1, "version": 0}, {"tokens": 1000, "accuracy": 0.2, "version": 2}]

    def row(arm: str, seed: int, recovered: float, no_gradient: float, no_outcome: int, saved: int) -> dict[str, Any]:
        return {"arm": arm, "seed": seed, "curve": curve, "recovered_per_1k_tokens": recovered, "no_gradient_fraction": no_gradient,
                "no_outcome_gradient_units": no_outcome, "units": 100, "tokens_saved": saved, "all_roots_failed": 70,
                "recovered_by_branch": 30 if arm != "root" else 0}

    trained = [row("root", 0, 3.0, 0.7, 70, 0), row("prm", 0, 6.0, 0.0, 40, 500), row("random", 0, 3.0, 0.0, 55, 400),
               row("root", 1, 2.0, 0.6, 60, 0), row("prm", 1, 5.0, 0.1, 45, 300), row("random", 1, 3.0, 0.0, 60, 350)]
    figures = bench.training_figures(trained)
    assert figures["training_recovered_per_1k_tokens_prm_vs_root"]["per_seed"] == pytest.approx([2.0, 2.5])
    assert figures["training_recovered_per_1k_tokens_prm_vs_root"]["mean"] == pytest.approx(2.25)
    assert figures["training_recovered_per_1k_tokens_prm_vs_root"]["se"] == pytest.approx(0.25)
    assert figures["training_no_gradient_fraction_prm_minus_root"]["per_seed"] == pytest.approx([-0.7, -0.5])
    assert figures["training_no_outcome_gradient_fraction_random_minus_root"]["per_seed"] == pytest.approx([-0.15, 0.0])
    assert figures["training_counts_prm"]["tokens_saved"] == [500, 300]
    assert figures["training_counts_random"]["recovered_by_branch"] == [30, 30]
    # rows of an older run without these counts: the curves' figures alone
    assert not any(key.startswith("training_") for key in bench.training_figures([{"arm": r["arm"], "seed": r["seed"], "curve": curve}
                                                                                   for r in trained]))
