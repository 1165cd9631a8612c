"""`decentrl eval` and workers/evaluate.py: prompt splits, scoring, the command line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from decentrl.cli.main import app
from decentrl.config import GuessTaskConfig, ReasoningGymDatasetSpec, ReasoningGymTaskConfig, TinyModelConfig, load_config
from decentrl.model.build import build_model, build_tiny_tokenizer
from decentrl.store.checkpoints import CheckpointStore
from decentrl.store.weights import write_hf_dir
from decentrl.tasks import build_task
from tests.conftest import MakeConfig
from workers.evaluate import EvalError, eval_prompts, evaluate, pass_at_k, pass_at_k_table

TINY = TinyModelConfig(hidden_size=32, num_layers=2, num_heads=2, intermediate_size=64, seed=5)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A random tiny model as the trainer publishes it."""
    directory = str(tmp_path_factory.mktemp("v3"))
    model = build_model(TINY)
    build_tiny_tokenizer().save_pretrained(directory)
    model.generation_config.save_pretrained(directory)
    write_hf_dir(directory, model.state_dict(), model.config, extras_from=directory)
    return directory


def test_heldout_prompts_are_outside_the_training_pool(make_config: MakeConfig) -> None:
    config = make_config(task={"num_prompts": 64})
    _, prompts = eval_prompts(config, "heldout", 30)
    task = build_task(config.task)
    training = {task.prompt(i).text for i in range(task.num_prompts)}
    assert len({p.text for p in prompts}) == 30  # distinct texts, none of them trained on
    assert not training & {p.text for p in prompts}
    _, train = eval_prompts(config, "train", 64)
    assert {p.text for p in train} == training


def test_heldout_prompts_are_scored_against_their_own_entries(make_config: MakeConfig) -> None:
    """A reseeded generator's prompt id indexes the reseeded entries: scoring it with the training
    task would compare against another prompt's answer."""
    pytest.importorskip("reasoning_gym", reason='needs the tasks extra: pip install -e ".[tasks]"')
    bits = ReasoningGymDatasetSpec(name="count_bits", options={"max_n": 1023})
    config = make_config().model_copy(update={"task": ReasoningGymTaskConfig(datasets=[bits], size=200)})
    task, prompts = eval_prompts(config, "heldout", 20)
    for prompt in prompts:
        number = int(prompt.text.rstrip("?").split()[-1])
        assert task.reward(prompt, str(bin(number).count("1"))) == 1.0


def test_reasoning_config_has_the_heldout_equations_its_docs_evaluate() -> None:
    """configs/reasoning.toml as docs/tasks.md evaluates it (`--prompts 256`): 256 held-out
    equations, none trained on, each answer one digit (what `max_tokens = 1` fits)."""
    pytest.importorskip("reasoning_gym", reason='needs the tasks extra: pip install -e ".[tasks]"')
    config = load_config(str(Path(__file__).parents[2] / "configs" / "reasoning.toml"))
    task, prompts = eval_prompts(config, "heldout", 256)
    training = build_task(config.task)
    assert not {training.prompt(i).text for i in range(training.num_prompts)} & {p.text for p in prompts}
    answers = [task.answer(p.prompt_id) for p in prompts]
    assert set(answers) == set("123456789") and config.sampling.max_tokens == 1
    assert all(task.reward(p, a) == 1.0 for p, a in zip(prompts[:8], answers, strict=False))
    assert task.reward(prompts[0], str(int(answers[0]) % 9 + 1)) == 0.0


def test_a_split_too_small_says_what_to_change(make_config: MakeConfig) -> None:
    # Two digits: 100 texts in all, every one of them in a pool of 4096 (1 - 0.99^4096 ~ 1).
    config = make_config(task={"num_digits": 2, "num_prompts": 4096})
    with pytest.raises(EvalError, match="split 'heldout' has 0 prompts.*use split 'train'"):
        eval_prompts(config, "heldout", 8)
    with pytest.raises(EvalError, match="split 'train' has 4096 prompts, fewer than the 4097"):
        eval_prompts(config, "train", 4097)


def test_multi_turn_tasks_are_refused(make_config: MakeConfig) -> None:
    config = make_config().model_copy(update={"task": GuessTaskConfig(num_prompts=16)})
    with pytest.raises(EvalError, match="multi-turn"):
        eval_prompts(config, "train", 4)


def test_greedy_reward_matches_transformers_generate(make_config: MakeConfig, checkpoint: str) -> None:
    """The evaluator's tokenize -> decode -> score path agrees with an independent one."""
    config = make_config()
    result = evaluate(config, checkpoint, 3, prompts=24, split="heldout", greedy=True)
    task, prompts = eval_prompts(config, "heldout", 24)
    tokenizer = build_tiny_tokenizer()
    model = build_model(TINY).eval()
    rewards = []
    for prompt in prompts:
        ids = torch.tensor([tokenizer(prompt.text).input_ids])
        out = model.generate(ids, do_sample=False, max_new_tokens=config.sampling.max_tokens, pad_token_id=0)
        rewards.append(task.reward(prompt, tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)))
    assert result.prompts == 24 and result.samples_per_prompt == 1 and result.greedy
    assert result.reward_mean == pytest.approx(sum(rewards) / len(rewards))
    assert 1 <= result.completion_tokens_mean <= config.sampling.max_tokens


def test_cli_pulls_the_newest_version_and_prints_json(make_config: MakeConfig, checkpoint: str, tmp_path: Path) -> None:
    store = CheckpointStore(str(tmp_path / "store"))
    store.publish(3, checkpoint)
    config_path = tmp_path / "run.json"
    config_path.write_text(make_config().model_dump_json())
    args = ["eval", str(config_path), "--store", str(tmp_path / "store"), "--cache-dir", str(tmp_path / "cache")]
    result = CliRunner().invoke(app, [*args, "--prompts", "16", "--samples", "3"])
    assert result.exit_code == 0, result.output
    figures = json.loads(result.output.strip().splitlines()[-1])
    assert figures["version"] == 3 and figures["prompts"] == 16 and figures["samples_per_prompt"] == 3
    assert 0.0 <= figures["reward_mean"] <= 1.0 and figures["reward_stderr"] >= 0.0
    missing = CliRunner().invoke(app, [*args, "--version", "9"])
    assert missing.exit_code == 1 and "error:" in missing.output
    no_store = CliRunner().invoke(app, ["eval", str(config_path)])
    assert no_store.exit_code == 2 and "pass --store URL or --run-dir" in no_store.output


def test_pass_at_k() -> None:
    assert pass_at_k(4, 0, 1) == 0.0 and pass_at_k(4, 4, 1) == 1.0
    assert pass_at_k(4, 1, 1) == pytest.approx(0.25) and pass_at_k(4, 1, 2) == pytest.approx(0.5)
    assert pass_at_k(4, 1, 4) == 1.0 and pass_at_k(4, 3, 2) == 1.0
    table = pass_at_k_table([1.0, 0.0, 0.0, 0.0, 0.5, 0.5, 0.0, 0.0], samples=4)
    assert table == {"pass@1": pytest.approx(0.125), "pass@2": pytest.approx(0.25), "pass@4": pytest.approx(0.5)}
