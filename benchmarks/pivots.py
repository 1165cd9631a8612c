"""Pivots with partial steps scored mid-generation (issue 47): three arms at the same budget of
generated tokens, on the chained-sums task (decentrl/tasks/chain.py, one step per '='):

- `root`: root-only GRPO groups (`group_size` samples a prompt, no scoring mid-generation);
- `random`: chains stopped at a step the scorer judges wrong, `pivots` pivots chosen at random,
  `k` continuations each (the control: branching without the scorer's pick);
- `prm`: the same, pivots at the last step judged right (the scorer's pick, `last_right`).

Every arm runs the real parts on loopback: the orchestrator app (tree leases, POST /v1/steps,
the verdict long-poll, the node checks on the whole unit), a `decentrl scorer` loop judging each
step with the task's exact checker (workers/scorers/chain.py), and the worker's step-wise hf
generation (workers/tree.py). The model is a tiny model fine-tuned here on right answers for
`--sft-steps` steps, so that it starts with a signal (some steps right, some wrong).

Measured at a fixed policy, per arm and seed, until the arm has generated `--budget` tokens
(tokens kept in samples plus those decoded after a wrong step before its verdict came): units,
units solved (a right sample anywhere in the unit), units that give no gradient (every advantage
the trainer gets from the unit 0: each sample's and, with process rewards, each token's;
`gives_gradient`), failed prompts recovered (the unit's first sample wrong, another of its samples
right: `recovered_per_1k_tokens`), failed roots recovered by a branch; the tokens saved by
stopping (exact: a stopped row keeps decoding unposted until it would have ended); step-post
waits; decode time keeping the prefix's KV cache against rebuilding it at each step boundary;
generation throughput with mid-generation scoring against without it. The worker plays the units
overlapped (`--ahead`, workers/tree.py `play_trees`): it decodes the next unit's roots while a
unit with pivots waits for its roots' last verdicts, and counts what it still waits.

With `--train-budget`, the three arms also train, each seed from the same fine-tuned model, until
they have generated that many tokens: every `--groups-per-step` complete units, a trainer step
(`Learner`: the trainer's own batch plan, policy loss and AdamW) on the orchestrator's batch and
its tree advantages (global + `--local-weight` x local; with `--process-weight`, every arm but
root-only GRPO also trains its steps' verdicts as process rewards, and `root_process`, root-only
groups with them, runs beside as the control), the worker's weights swapped to the new version
between units, and the held-out accuracy (`heldout_accuracy`: prompts no arm nor the fine-tuning
saw, sampled at the arms' temperature) measured every `--eval-every` steps against the tokens generated so far.
`tokens_to_target_pivot_vs_root`: the tokens at which the PRM arm first reaches the root arm's
final held-out accuracy, over the root arm's total (per seed, then the mean and its standard
error; undefined where a seed's PRM arm never reaches it, as one noisy last evaluation of the
root arm can make it), and on the seeds' mean curves (`..._pooled`: the tokens at which the PRM
arm's mean curve first reaches the root arm's mean accuracy at the budget, over the budget, read
every 250 tokens, with a 90% bootstrap interval over seeds, `..._pooled_interval90`); the random
arm's beside it. Beside them, per arm, the final accuracy and the accuracy
averaged over the tokens generated (the area under the curve), and each arm's figures minus
another's paired by seed (`heldout_final_prm_minus_random`, ...), mean and standard error.

Every unit is seeded from the seed (workers/tree.py `seed`): the arms of a seed draw the same
root samples of a prompt at a version, so the arms' differences are paired, and an arm that does
not depend on verdicts (root) gives the same rows in every run. The pivot arms do too with
`--verdict-lag-tokens N` (a step's verdict acts exactly N tokens after its step ended); without
it a verdict acts whenever it arrives, which the machine's load moves, and each row says what lag
the run gave (`verdict_lags`, `verdict_lag_median`: the N to choose).

`--model DIR` fine-tunes and trains an HF causal LM directory (e.g. models/smollm2) instead of the
tiny model, with its own tokenizer, on a GPU where there is one (and every core of this CPU where
there is none; the tiny model's runs take one). `--checkpoint DIR` keeps the fine-tuned model there
and reuses it in later runs with the same fine-tuning options (`finetune.json` beside its weights).
SmolLM2-135M-Instruct (`decentrl model import`, README) at 6 digits, an arm of 6,000 tokens in
4.5-5 min on 2 cores (docs/rewards.md):

    python benchmarks/pivots.py --model models/smollm2 --checkpoint runs/smol_d6 --sft-steps 110 --sft-lr 1e-4 \
        --digits 6 --budget 0 --train-budget 6000 --lr 5e-6 --groups-per-step 6 --root-groups-per-step 8 \
        --process-weight 1 --verdict-lag-tokens 8 --token-ms 0 --heldout 128 --eval-samples 2 --seeds 1 --seed-start S

Seeds can run apart (each under 10 min at a quiet machine's load; S = 0, 1, ...) and be summarized together:

    python benchmarks/pivots.py --budget 0 --seeds 1 --seed-start S --train-budget 12000 --lr 2e-5 --heldout 512 --process-weight 1
    python benchmarks/pivots.py --budget 6000 --seeds 3 --train-budget 0
    python benchmarks/pivots.py --rows ROWS... --budget 6000 --seeds 3 --train-budget 12000 --lr 2e-5 --heldout 512

`--arms prm_failed random_failed`: the pivot arms with units of a variable size beside them (a unit
branches only when none of its roots is known right, `[orchestrator.tree] branch = "all_failed"`),
each compared paired by seed with root-only GRPO, its always-branching twin and the other
(`heldout_*_prm_failed_minus_*`, `tokens_to_target_prm_failed_vs_root*`); `units_unbranched`
counts the units sent as their roots alone. Their units cost fewer tokens, so they take more a
step (`--groups-per-step`, run apart).

`--until-tokens N` summarizes the training curves up to N generated tokens (each curve's
evaluations at or under N): the arms' figures at a smaller budget, read off the same rows.

The last line is one JSON object with the issue's keys.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import random
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

SHAPE = {"hidden_size": 64, "num_layers": 2, "num_heads": 2, "intermediate_size": 128}
ARMS = {
    "root": {"pivots": 0, "stop_below": None, "rule": "random"},
    "random": {"pivots": 1, "stop_below": 0.5, "rule": "random"},
    "prm": {"pivots": 1, "stop_below": 0.5, "rule": "last_right"},
}
# A training control beside them with `--process-weight`: root-only groups whose steps' verdicts
# are process rewards (no stopping, no pivot), so that a gain is told apart as the pivots' or the
# process rewards'.
CONTROLS = {"root_process": ARMS["root"]}
# The pivot arms with units of a variable size, beside them (`--arms`): a unit branches only when
# none of its roots is known right (`[orchestrator.tree] branch = "all_failed"`), so a group with a
# right sample spends no tokens on branches; each against root-only GRPO and its always-branching twin.
VARIANTS = {arm + "_failed": {**ARMS[arm], "branch": "all_failed"} for arm in ("prm", "random")}
ALL_ARMS = {**ARMS, **CONTROLS, **VARIANTS}  # each arm's tree options, in the order figures list them
DIGITS = 4  # the chained sums' digits a prompt (steps per right answer): `--digits`


def max_tokens(digits: int) -> int:
    """A chain's token limit: 6 a digit (24 at 4 digits; a right chain's step is its running sum,
    at most 3 digits, and its marker, and the chain ends with end-of-sequence)."""
    return 6 * digits


def int_arg(flag: str, takes: str, low: int, high: int | None = None) -> Callable[[str], int]:
    """An argparse type: an integer from `low` (to `high`), else refused as "`flag` takes `takes`, not ..."."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{flag} takes {takes}, not {text!r}") from None
        if value < low or (high is not None and value > high):
            raise argparse.ArgumentTypeError(f"{flag} takes {takes}, not {value}")
        return value

    return parse


digits_arg = int_arg("--digits", "an integer from 2 to 16 (the chain task's bounds)", 2, 16)
until_tokens_arg = int_arg("--until-tokens", "a positive integer (generated tokens)", 1)
verdict_lag_arg = int_arg("--verdict-lag-tokens", "an integer from 0 to 4096 (tokens after a step's end)", 0, 4096)


def model_dir_arg(text: str) -> str:
    """An argparse type: an HF model directory (`--model`), else refused saying what it lacks."""
    if not os.path.isfile(os.path.join(text, "config.json")):
        raise argparse.ArgumentTypeError(f"--model takes an HF causal LM directory (config.json, weights, tokenizer), "
                                         f"not {text!r}: it holds no config.json")
    return text


def sft_lr_arg(text: str) -> float:
    """An argparse type: a learning rate in (0, 1) (`--sft-lr`)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--sft-lr takes a positive learning rate, not {text!r}") from None
    if not 0 < value < 1:
        raise argparse.ArgumentTypeError(f"--sft-lr takes a positive learning rate under 1, not {value}")
    return value


def histogram(values: list[int]) -> dict[str, int]:
    """`{value: count}`, in the values' order (a JSON row's keys are strings)."""
    return {str(value): n for value, n in sorted(collections.Counter(values).items())}


def lag_median(seen: list[int], unseen: list[int]) -> int | None:
    """The median verdict lag in tokens (`--verdict-lag-tokens` to choose from a run without it), by
    Kaplan-Meier: a step whose verdict came after its batch ended, `unseen` at `c` tokens, is known
    only to have lagged more than `c`, so it counts as at risk up to `c` and never as an event.
    None when more than half may lag longer than any seen."""
    survival = 1.0
    for lag in sorted(set(seen)):
        at_risk = sum(x >= lag for x in seen) + sum(c >= lag for c in unseen)
        survival *= 1 - seen.count(lag) / at_risk
        if survival <= 0.5:
            return lag
    return None


def until(trained: list[dict[str, Any]], tokens: int) -> list[dict[str, Any]]:
    """The training rows with each curve cut to its points at or under `tokens` generated tokens
    (`--until-tokens`: the arms' figures at a smaller budget, read off the same runs; constant
    learning rate, so the points before it are the same); a curve left without an evaluation after
    its start is refused."""
    cut = []
    for row in trained:
        points = [point for point in row["curve"] if point["tokens"] <= tokens]
        if len(points) < 2:
            first = row["curve"][1]["tokens"] if len(row["curve"]) > 1 else None
            raise ValueError(f"--until-tokens {tokens} leaves the {row['arm']} arm of seed {row['seed']} no evaluation after its "
                             f"start (its first is at {first} tokens)")
        cut.append({**row, "curve": points})
    return cut


def finetune(directory: str, steps: int, seed: int, digits: int = DIGITS, base: str | None = None,
             lr: float | None = None) -> float:
    """A model trained on right chained sums of `digits` digits (teacher forcing), written as an
    HF directory; returns the final loss. The tiny model from scratch, or `base` (`--model`: an HF
    causal LM directory, its tokenizer with it) from its weights, on its device (`device_of`);
    AdamW at `lr` (None: 3e-3 for the tiny model, 3e-5 for `base`)."""
    import torch

    from decentrl.config import ChainTaskConfig, TinyModelConfig
    from decentrl.model.build import build_model
    from decentrl.store.weights import load_pretrained, write_hf_dir
    from decentrl.tasks.chain import ChainTask, running_sums

    torch.manual_seed(seed)
    tokenizer = tokenizer_of(base)
    model = build_model(TinyModelConfig(**SHAPE, seed=seed)) if base is None else load_pretrained(base)
    device = device_of(base)
    model.to(device)
    task = ChainTask(ChainTaskConfig(num_digits=digits, num_prompts=4096, seed=1000 + seed))  # not the arms' prompts
    optimizer = torch.optim.AdamW(model.parameters(), lr=sft_rate(base, lr))
    rng = random.Random(seed)
    loss = torch.tensor(0.0)
    model.train()
    for _ in range(steps):
        batch = []
        for prompt_id in rng.sample(range(task.num_prompts), 64):
            text = task.prompt(prompt_id).text
            answer = "".join(f"{total}=" for total in running_sums(text))
            prompt_ids = tokenizer(text).input_ids
            ids = prompt_ids + tokenizer(answer, add_special_tokens=False).input_ids + [tokenizer.eos_token_id]
            batch.append((ids, len(prompt_ids)))
        width = max(len(ids) for ids, _ in batch)
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        inputs = torch.tensor([ids + [pad] * (width - len(ids)) for ids, _ in batch], device=device)
        labels = torch.tensor([[-100] * n + ids[n:] + [-100] * (width - len(ids)) for ids, n in batch], device=device)
        loss = model(input_ids=inputs, labels=labels).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    model.eval()
    os.makedirs(directory, exist_ok=True)
    tokenizer.save_pretrained(directory)
    model.generation_config.save_pretrained(directory)
    write_hf_dir(directory, {name: t.cpu() for name, t in model.state_dict().items()}, model.config, extras_from=directory)
    return float(loss)


def sft_rate(base: str | None, lr: float | None) -> float:
    """The fine-tuning's AdamW rate: `lr` (`--sft-lr`), else 3e-3 for the tiny model, 3e-5 for `base`."""
    return lr if lr is not None else 3e-3 if base is None else 3e-5


RECIPE = "finetune.json"  # beside a kept checkpoint's weights: what it was fine-tuned with, and its final loss


def recipe_of(steps: int, digits: int, base: str | None, lr: float | None) -> dict[str, Any]:
    """What a fine-tuned checkpoint depends on (`--checkpoint` reuses one only where it is the same)."""
    return {"model": os.path.realpath(base) if base else "tiny", "digits": digits, "sft_steps": steps,
            "sft_lr": sft_rate(base, lr), "seed": 0}


def checkpoint_refusal(directory: str, recipe: dict[str, Any]) -> str | None:
    """Why `--checkpoint DIR` cannot be used with these options, or None: a directory that holds
    files but no recipe (not one this benchmark kept; a fine-tuning stopped part way leaves none),
    or one fine-tuned with other options (each that differs, named)."""
    path = os.path.join(directory, RECIPE)
    if not os.path.isfile(path):
        if os.path.isdir(directory) and os.listdir(directory):
            return (f"--checkpoint {directory} holds files but no {RECIPE}: it is not a checkpoint this benchmark "
                    f"fine-tuned; give a new or empty directory")
        return None
    try:
        with open(path) as file:
            kept = json.load(file)
    except (OSError, ValueError) as error:
        return f"--checkpoint {directory}: its {RECIPE} cannot be read ({error}); fine-tune into a new directory"
    if not isinstance(kept, dict):
        return f"--checkpoint {directory}: its {RECIPE} is not a JSON object; fine-tune into a new directory"
    differ = [f"{key} {kept.get(key)!r} (asked: {value!r})" for key, value in recipe.items() if kept.get(key) != value]
    if differ:
        return (f"--checkpoint {directory} was fine-tuned with other options: {', '.join(differ)}; "
                f"give those options, or a new directory")
    if not isinstance(kept.get("sft_loss"), (int, float)):
        return f"--checkpoint {directory}: its {RECIPE} holds no numeric sft_loss; fine-tune into a new directory"
    return None


def fine_tuned(directory: str, steps: int, digits: int = DIGITS, base: str | None = None, lr: float | None = None) -> float:
    """The final fine-tuning loss of the checkpoint kept at `directory` (`--checkpoint`): read from its
    recipe where one is there (`checkpoint_refusal` says first whether it may be reused), else the
    model fine-tuned into a directory beside and moved there whole, its recipe with it."""
    path = os.path.join(directory, RECIPE)
    if os.path.isfile(path):
        with open(path) as file:
            return float(json.load(file)["sft_loss"])
    recipe = recipe_of(steps, digits, base, lr)
    partial = f"{directory.rstrip(os.sep)}.partial-{os.getpid()}"
    loss = finetune(partial, steps, seed=0, digits=digits, base=base, lr=lr)
    with open(os.path.join(partial, RECIPE), "w") as file:
        json.dump({**recipe, "sft_loss": loss}, file)
    if os.path.isdir(directory):
        os.rmdir(directory)  # empty: checkpoint_refusal refuses one that is not
    os.rename(partial, directory)
    return loss


def tokenizer_of(base: str | None) -> Any:
    """The tiny model's tokenizer, or `base`'s (a fine-tuned checkpoint holds the same one)."""
    if base is None:
        from decentrl.model.build import build_tiny_tokenizer

        return build_tiny_tokenizer()
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(base)


def device_of(base: str | None) -> str:
    """Where the arms compute: the tiny model on the CPU (its figures are this CPU's), `--model`
    on a GPU where there is one."""
    import torch

    return "cuda" if base is not None and torch.cuda.is_available() else "cpu"


def pace(backend: Any, token_s: float) -> None:
    """Makes each forward pass of `backend`'s loaded model take `token_s` seconds longer. The tiny
    model decodes a 24-token chain in milliseconds, faster than any verdict can come back over
    HTTP; a real model takes 10-50 ms a token, which is what gives a mid-generation verdict the
    time to act. Without pacing, the figures measure the race, not the method."""
    forward = backend.model.forward

    def paced(*args: Any, **kwargs: Any) -> Any:
        time.sleep(token_s)
        return forward(*args, **kwargs)

    backend.model.forward = paced


class Training(NamedTuple):
    """An arm that trains: a trainer step every `groups_per_step` units on the orchestrator's batch
    (its tree advantages: global + `local_weight` x local), the version advancing, and the held-out
    accuracy measured after every `eval_every` steps."""

    groups_per_step: int
    lr: float
    heldout: list[str]  # prompts none of the arms, nor the fine-tuning, sees
    eval_samples: int = 4  # samples of each held-out prompt (at the arms' temperature)
    eval_every: int = 1
    local_weight: float = 1.0
    # The steps' verdicts as process rewards, in every arm but root-only GRPO (0: they only stop
    # chains and pick pivots); `process`: [orchestrator.advantages] process, "return" or "step".
    process_weight: float = 0.0
    process: str = "return"


def gives_gradient(group: Any, advantages: Any) -> bool:
    """Whether a complete unit teaches anything: an advantage the trainer gets from it off 0, a
    sample's (its outcome's: global, or local in a branch node) or, with process rewards, one of
    its tokens' (a unit whose outcomes are all equal still has a gradient when its steps' verdicts
    differ). The advantages are the batch's own (orchestrator/batches.py `build_batch`, the
    orchestrator's group and `[orchestrator.advantages]`)."""
    from orchestrator.batches import build_batch

    batch = build_batch([group], trainer_version=0, batch_id="probe", advantages=advantages, rollouts_accepted=0, stale_dropped=0)
    return any(abs(sample.advantage) > 1e-12 or any(abs(a) > 1e-12 for a in sample.token_advantages or ())
               for sample in batch.samples)


def log_progress(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


class Learner:
    """The trainer's step, in this process: the project's TrainerConfig, `rank_share` (sample
    selection, whole-batch totals, micro-batches), `accumulate_gradients` (the policy loss against
    the workers' sampling logprobs), clipping and AdamW, on one rank without FSDP (a sharded model
    needs a process group; the loss, its normalization and the batch's plan are the same code)."""

    def __init__(self, checkpoint: str, config: Any, device: str = "cpu") -> None:
        import torch

        from decentrl.store.weights import load_pretrained
        from decentrl.trainer.train import build_optimizer

        self.config = config
        self.device = torch.device(device)
        self.model = load_pretrained(checkpoint).to(self.device).train()
        self.optimizer = build_optimizer([p for p in self.model.parameters() if p.requires_grad], config.trainer)

    def step(self, batch: Any) -> dict[str, float]:
        import torch

        from decentrl.rl.losses import summarize
        from decentrl.trainer.batching import rank_share
        from decentrl.trainer.step import accumulate_gradients

        cfg = self.config.trainer
        samples, totals, micro = rank_share(batch, rank=0, world=1, config=cfg, max_tokens=self.config.sampling.max_tokens,
                                            pad_id=self.model.config.pad_token_id or 0, device=self.device)
        loss, sums = accumulate_gradients(self.model, None, micro, totals=totals, config=cfg, temperature=self.config.sampling.temperature)
        stats = summarize({key: float(value) for key, value in sums.items()})
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), cfg.max_grad_norm)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        # The sampler's logprobs against the trainer's, before the step: the same weights, so a
        # ratio off 1 would mean a branch's prefix and continuation were misaligned.
        return {"loss": float(loss), "grad_norm": float(grad_norm), "trained": len(samples),
                # Samples whose steps were all judged (per-token advantages), and those among them
                # whose verdicts moved a token's advantage off the outcome's (process_weight > 0).
                "process_scored": sum(s.token_advantages is not None for s in batch.samples),
                "process_moved": sum(s.token_advantages is not None and any(abs(a - s.advantage) > 1e-9 for a in s.token_advantages)
                                     for s in batch.samples),
                "reward_mean": statistics.fmean(s.reward for s in batch.samples), "sampler_kl": stats["sampler_kl"],
                "is_ratio_max": stats["is_ratio_max"]}


def weight_change(checkpoint: str, model: Any) -> float:
    """The L2 norm of `model`'s weights minus the checkpoint's."""
    from decentrl.store.weights import load_pretrained

    before = load_pretrained(checkpoint).state_dict()
    return float(sum((tensor.float().cpu() - before[name].float()).pow(2).sum() for name, tensor in model.state_dict().items()) ** 0.5)


def heldout_accuracy(model: Any, tokenizer: Any, prompts: list[str], *, samples: int, max_tokens: int, temperature: float,
                     seed: int) -> float:
    """The share of right chains among `samples` sampled completions of each held-out prompt (the
    policy's own temperature, no truncation, a fixed seed: every evaluation draws the same noise)."""
    import torch
    from transformers import DynamicCache

    from decentrl.tasks.chain import chain_reward

    ids = [tokenizer(text).input_ids for text in prompts]
    if len({len(row) for row in ids}) != 1:
        raise ValueError("held-out prompts of one length only (no padding here)")
    device = next(model.parameters()).device
    rows = torch.tensor([row for row in ids for _ in range(samples)], device=device)
    generator = torch.Generator(device=device).manual_seed(seed)
    eos = tokenizer.eos_token_id
    was_training = model.training
    model.eval()
    out = []
    with torch.no_grad():
        cache = DynamicCache()
        logits = model(input_ids=rows, past_key_values=cache, use_cache=True).logits[:, -1]
        for _ in range(max_tokens):
            token = torch.multinomial(torch.softmax(logits.float() / temperature, dim=-1), 1, generator=generator)
            out.append(token)
            logits = model(input_ids=token, past_key_values=cache, use_cache=True).logits[:, -1]
    model.train(was_training)
    right = 0
    for row, completion in enumerate(torch.cat(out, dim=-1).tolist()):
        if eos in completion:
            completion = completion[: completion.index(eos) + 1]
        right += chain_reward(prompts[row // samples], tokenizer.decode(completion, skip_special_tokens=True)) == 1.0
    return right / len(rows)


def run_arm(
    arm: str, seed: int, checkpoint: str, budget: int, group_size: int, k: int, *, keep_cache: bool = True,
    post_steps: bool = True, token_s: float = 0.0, verdict_wait_s: float = 5.0, training: Training | None = None,
    ahead: int = 1, digits: int = DIGITS, verdict_lag_tokens: int | None = None, base: str | None = None,
) -> dict[str, Any]:
    """One arm at one seed on a fresh orchestrator, scorer and backend: units until `budget` tokens.
    `base`: `checkpoint` was fine-tuned from that HF model (`--model`; None: the tiny model).
    `token_s`: each decoding step takes at least this long (`pace`), as a real model's does.
    `verdict_lag_tokens`: the tree's (a step's verdict acts exactly that many tokens after its step
    ended; None: whenever it arrives, which the machine's load moves). With
    `training`, the policy trains on the orchestrator's batches as the arm goes (`Training`), and
    the result holds its held-out accuracy against the tokens generated (`curve`)."""
    from decentrl.api.client import OrchestratorClient
    from decentrl.api.wire import LeaseRequest, RolloutBatch
    from decentrl.config import PythonScorerConfig, parse_config
    from decentrl.rl.pivots import RecoveryEstimate
    from decentrl.tasks import build_task
    from decentrl.tasks.chain import chain_reward
    from orchestrator.app import create_app
    from orchestrator.auth import TokenRegistry
    from orchestrator.state import RunState
    from tests.openai_server import Loopback
    from workers.backends.hf import HFBackend
    from workers.scorer import Scorer
    from workers.scorers import build_scorer_backend
    from workers.tree import TreeCounts, VerdictFeed, play_trees

    options = ALL_ARMS[arm]
    config = parse_config({
        "run_name": f"pivots-{arm}-{seed}", "group_size": group_size, "max_staleness": 1, "num_workers": 1, "trainer_ranks": 1,
        "model": {"type": "tiny", **SHAPE} if base is None else {"type": "pretrained", "path": checkpoint},
        "task": {"type": "chain", "num_digits": digits, "num_prompts": 4096, "seed": seed},
        "sampling": {"temperature": 1.0, "max_tokens": max_tokens(digits)},
        # The prompts as the fine-tuning and the held-out evaluation write them: raw text, also for a
        # chat model (`--model` SmolLM2-Instruct), whose template would ask what it was never tuned on.
        "prompt": {"format": "raw"},
        "orchestrator": {"host": "127.0.0.1", "port": 0, "journal": False, "lease_wait_s": 0.0, "lease_timeout_s": 120.0,
                         "rewards": {"lease_timeout_s": 30.0},
                         "tree": {"k": k, "marker": "=", "verdict_lag_tokens": verdict_lag_tokens, **options},
                         # The tree's outcome advantages (global + lambda x local), plus, in every arm
                         # but root-only GRPO, the steps' verdicts as process rewards with
                         # `process_weight` (0: they only stop chains and pick pivots).
                         "advantages": {"process_weight": training.process_weight if training and arm != "root" else 0.0,
                                        "process": training.process if training else "return",
                                        "outcome_weight": 1.0, "local_weight": training.local_weight if training else 1.0}},
        "trainer": {"groups_per_step": training.groups_per_step if training else 1024, "steps": 100_000,
                    "lr": training.lr if training else 1e-3},
    })
    tokenizer = tokenizer_of(None if base is None else checkpoint)
    state = RunState(config=config, task=build_task(config.task), tokenizer=tokenizer)
    state.announce(0)
    tokens = [{"name": "vol", "role": "worker", "token": "w"}, {"name": "judge", "role": "scorer", "token": "s"},
              {"name": "learner", "role": "trainer", "token": "t"}]
    server = Loopback(create_app(state=state, tokens=TokenRegistry(tokens), store_url="memory://pivots"))
    scorer_config = PythonScorerConfig(function="workers.scorers.chain:judge", max_items=64, min_wait_s=0.005)
    scorer = Scorer(scorer_config, scorer_id="s0", client=OrchestratorClient(server.url, "s"), backend=build_scorer_backend(scorer_config))
    scoring = threading.Thread(target=scorer.run, daemon=True)
    scoring.start()
    client = OrchestratorClient(server.url, "w")
    feed = VerdictFeed(client, "w0", wait_s=1.0).start()
    backend = HFBackend(seed=seed, device=device_of(base))
    backend.load(checkpoint, 0)
    if token_s:
        pace(backend, token_s)
    rng, estimate, counts = random.Random(seed), RecoveryEstimate(), TreeCounts()
    units = solved = no_gradient = failed_prompts = recovered = all_roots_failed = recovered_by_branch = 0
    no_outcome_gradient = 0
    roots = roots_right = branches = branches_right = pivots_on_failed = 0
    learner = Learner(checkpoint, config, device_of(base)) if training else None
    trainer = OrchestratorClient(server.url, "t")
    curve: list[dict[str, Any]] = []
    steps: list[dict[str, float]] = []
    train_s = 0.0

    def evaluate(version: int) -> None:
        assert training is not None and learner is not None
        accuracy = heldout_accuracy(learner.model, tokenizer, training.heldout, samples=training.eval_samples,
                                    max_tokens=config.sampling.max_tokens, temperature=config.sampling.temperature, seed=12345)
        curve.append({"version": version, "tokens": counts.generated + counts.discarded, "units": units, "accuracy": accuracy})
        log_progress(f"{arm} seed {seed} v{version}: {curve[-1]['tokens']} tokens, held-out accuracy {accuracy:.3f}")

    if training:
        evaluate(0)
    def leased() -> Iterator[tuple[Any, Any]]:  # a unit leased as the worker starts it, until the budget
        while counts.generated + counts.discarded < budget:
            answer = client.lease(LeaseRequest(worker_id="w0", max_groups=1))
            (lease,) = answer.leases
            yield lease, answer.sampling

    started, load_start = time.perf_counter(), os.getloadavg()[0]
    try:
        # The worker decodes the next unit's roots while a unit waits for its roots' last verdicts
        # (`ahead` 1); a training arm plays one unit at a time: its version changes between units.
        for lease, samples in play_trees(backend, client if post_steps else _Silent(), leased(),  # type: ignore[arg-type]
                                         run_name=config.run_name, worker_id="w0", feed=feed, rng=rng, estimate=estimate,
                                         counts=counts, keep_cache=keep_cache, verdict_wait_s=verdict_wait_s, seed=seed,
                                         ahead=0 if training else ahead):
            if training is not None and training.process_weight and arm != "root":
                # A verdict that comes after its unit completes is no process reward (docs/rewards.md):
                # the unit is sent once its branches' last steps are judged too, so that every
                # sample trains on its steps (a wait on the wall clock, no token).
                feed.wait_for({(s.rollout_id, j) for s in samples for j in range(len(s.step_ends or ()))}, verdict_wait_s)
            ingest = client.post_rollouts(RolloutBatch(rollouts=samples))
            if ingest.rejected:
                raise RuntimeError(f"the orchestrator refused samples of a {arm} unit: {ingest.rejected}")
            prompt = state.task.prompt(lease.prompt_id).text
            rewards = [chain_reward(prompt, tokenizer.decode(s.completion_token_ids, skip_special_tokens=True)) if s.node is None
                       else chain_reward(prompt, tokenizer.decode(list(s.prompt_token_ids[len(lease.prompt_token_ids):])
                                                                  + list(s.completion_token_ids), skip_special_tokens=True))
                       for s in samples]
            pivots = [None if s.node is None else (s.node.parent.rollout_id, s.node.parent.at) for s in samples]  # type: ignore[union-attr]
            units += 1
            by_id = {s.rollout_id: r for s, r in zip(samples, rewards, strict=True)}
            roots += sum(p is None for p in pivots)
            roots_right += sum(r for r, p in zip(rewards, pivots, strict=True) if p is None)
            branches += sum(p is not None for p in pivots)
            branches_right += sum(r for r, p in zip(rewards, pivots, strict=True) if p is not None)
            pivots_on_failed += sum(not by_id[parent] for parent, _ in {p for p in pivots if p is not None})
            solved += any(rewards)
            group, advantages = next(g for g in reversed(state.ready) if g.lease_id == lease.lease_id), config.orchestrator.advantages
            no_gradient += not gives_gradient(group, advantages)
            # Beside it, what its outcomes alone give (process rewards apart): the count before 2026-11-29 10:00.
            no_outcome_gradient += not gives_gradient(group, advantages.model_copy(update={"process_weight": 0.0}))
            # A failed prompt: its first sample (a root's, in every arm) is wrong; recovered: another
            # sample of its unit (a root's or a branch's) is right.
            failed_prompts += not rewards[0]
            recovered += not rewards[0] and any(rewards[1:])
            roots_failed = not any(r for r, p in zip(rewards, pivots, strict=True) if p is None)
            all_roots_failed += roots_failed
            recovered_by_branch += roots_failed and any(rewards)
            if learner is not None and training is not None and units % training.groups_per_step == 0:
                trained = time.perf_counter()
                version = backend.version or 0
                while (batch := trainer.batch(trainer_version=version, request_id=f"step-{version + 1}")) is None:
                    pass
                steps.append(learner.step(batch))
                backend.model.load_state_dict(learner.model.state_dict())  # the next version, swapped between units
                backend.version = version + 1
                state.announce(version + 1)
                if (version + 1) % training.eval_every == 0:
                    evaluate(version + 1)
                train_s += time.perf_counter() - trained
    finally:
        elapsed = time.perf_counter() - started
        scorer.request_stop()
        feed.close()
        scoring.join(timeout=30)
        server.close()
    spent = counts.generated + counts.discarded
    return {
        "arm": arm, "seed": seed, "digits": digits, "units": units, "tokens": spent, "tokens_kept": counts.generated,
        "tokens_discarded": counts.discarded, "tokens_saved": counts.saved, "solved": solved,
        # Units sent with fewer pivots than their lease's: their roots had fewer step boundaries
        # (chains of one step: none), or, branching `all_failed`, a root known right (unbranched).
        "units_short": counts.short, "units_unbranched": counts.unbranched,
        "solved_per_1k_tokens": 1000 * solved / spent, "recovered": recovered, "failed_prompts": failed_prompts,
        "recovered_per_1k_tokens": 1000 * recovered / spent, "all_roots_failed": all_roots_failed,
        "recovered_by_branch": recovered_by_branch, "no_gradient_units": no_gradient,
        "no_outcome_gradient_units": no_outcome_gradient,
        "no_gradient_fraction": no_gradient / units, "steps_posted": counts.steps_posted, "verdicts_used": counts.verdicts_used,
        "root_success": roots_right / roots if roots else None, "branch_success": branches_right / branches if branches else None,
        "pivots": branches // k, "pivots_on_failed_roots": pivots_on_failed,
        "verdict_wait_s": round(counts.verdict_wait_s, 3), "verdict_timeouts": counts.verdict_timeouts,
        "verdict_lag_tokens": verdict_lag_tokens,
        # Without a fixed lag, the lag the machine gave: how many tokens each verdict read while its
        # batch decoded came after its step ended (lag: count), and for the steps whose verdict came
        # after their batch ended, the tokens by then (their lag was longer).
        "verdict_lags": histogram(counts.verdict_lags), "verdict_lags_unseen": histogram(counts.verdict_lags_unseen),
        "verdict_lag_median": lag_median(counts.verdict_lags, counts.verdict_lags_unseen),
        "step_post_wait_s": round(counts.step_post_wait_s, 4), "decode_s": round(counts.decode_s, 3),
        "cache_rebuild_s": round(counts.cache_rebuild_s, 3), "tokens_per_decode_s": spent / counts.decode_s if counts.decode_s else None,
        "decode_steps": counts.decode_steps, "decode_s_per_step": counts.decode_s / counts.decode_steps if counts.decode_steps else None,
        "wall_s": round(elapsed, 2), "load_start": load_start, "load_end": os.getloadavg()[0],
        "keep_cache": keep_cache, "post_steps": post_steps, "ahead": 0 if training else ahead,
        **({"versions": backend.version, "train_s": round(train_s, 2), "groups_per_step": training.groups_per_step,
            "weight_change": weight_change(checkpoint, backend.model),
            "sampler_kl_max": max(step["sampler_kl"] for step in steps) if steps else None,
            "is_ratio_max": max(step["is_ratio_max"] for step in steps) if steps else None,
            "trained_samples": sum(int(step["trained"]) for step in steps),
            "process_scored_samples": sum(int(step["process_scored"]) for step in steps),
            "process_moved_samples": sum(int(step["process_moved"]) for step in steps),
            "process_weight": training.process_weight if arm != "root" else 0.0, "process": training.process,
            "curve": curve} if training else {}),
    }


class _Silent:
    """Step posts that go nowhere (the throughput baseline without mid-generation scoring)."""

    def post_steps(self, post: Any) -> None:
        return None


def tokens_to_target(root_curve: list[dict[str, Any]], curve: list[dict[str, Any]]) -> float | None:
    """The tokens at which `curve` first reaches the root arm's final held-out accuracy, over the
    tokens the root arm spent to get there (its last point); None if it never does."""
    target, spent = root_curve[-1]["accuracy"], root_curve[-1]["tokens"]
    reached = next((point["tokens"] for point in curve if point["accuracy"] >= target), None)
    return None if reached is None else reached / spent


def smoothed(curve: list[dict[str, Any]], window: int = 3) -> list[dict[str, Any]]:
    """`curve` with each point's accuracy the mean of it and the `window - 1` points before it."""
    return [{**point, "accuracy": statistics.fmean(p["accuracy"] for p in curve[max(0, i - window + 1) : i + 1])}
            for i, point in enumerate(curve)]


def accuracy_at(curve: list[dict[str, Any]], tokens: float) -> float:
    """`curve`'s held-out accuracy at `tokens` generated tokens, linear between its evaluations (its
    first accuracy before its first point, its last after its last)."""
    if tokens <= curve[0]["tokens"]:
        return curve[0]["accuracy"]
    for p, q in zip(curve, curve[1:]):
        if tokens == q["tokens"]:
            return q["accuracy"]
        if tokens < q["tokens"]:
            return p["accuracy"] + (q["accuracy"] - p["accuracy"]) * (tokens - p["tokens"]) / (q["tokens"] - p["tokens"])
    return curve[-1]["accuracy"]


def pooled_tokens_to_target(root_curves: list[list[dict[str, Any]]], curves: list[list[dict[str, Any]]], budget: float,
                            step: int = 250) -> float | None:
    """`tokens_to_target` on the seeds' mean curves: the tokens at which the mean of `curves` (each
    read every `step` tokens up to `budget`, `accuracy_at`) first reaches the root curves' mean
    accuracy at `budget`, over `budget`; None if it never does. One seed's noisy last evaluation
    neither sets the target nor leaves the figure undefined, as it does per seed."""
    grid = token_grid(budget, step)
    return _mean_reaches(_readings(root_curves, grid), _readings(curves, grid), grid)


def token_grid(budget: float, step: int) -> list[float]:
    """The generated-token counts the pooled figures read the curves at: every `step` tokens, and the budget."""
    return [*range(0, int(budget), step), budget]


def _readings(curves: list[list[dict[str, Any]]], grid: list[float]) -> list[list[float]]:
    """Each curve's accuracy at every point of `grid` (`accuracy_at`)."""
    return [[accuracy_at(curve, tokens) for tokens in grid] for curve in curves]


def _mean_reaches(root_readings: list[list[float]], readings: list[list[float]], grid: list[float]) -> float | None:
    """The first point of `grid`, over its last, where the mean of `readings` reaches the mean of
    the root readings' last; None if none does."""
    target = statistics.fmean(row[-1] for row in root_readings)
    return next((tokens / grid[-1] for i, tokens in enumerate(grid) if statistics.fmean(row[i] for row in readings) >= target), None)


def pooled_interval(root_curves: list[list[dict[str, Any]]], curves: list[list[dict[str, Any]]], budget: float,
                    resamples: int = 2000, step: int = 250) -> tuple[float | None, float | None]:
    """A 90% bootstrap interval of `pooled_tokens_to_target` over seeds (the seeds resampled with
    replacement, the arms of a seed together; `Random(0)`): its 5th and 95th percentiles, None for a
    bound where the resampled curves never reach their target. Each curve is read on the grid once."""
    grid = token_grid(budget, step)
    roots, arms = _readings(root_curves, grid), _readings(curves, grid)
    rng, n = random.Random(0), len(root_curves)
    draws = []
    for _ in range(resamples):
        picks = [rng.randrange(n) for _ in range(n)]
        value = _mean_reaches([roots[i] for i in picks], [arms[i] for i in picks], grid)
        draws.append(float("inf") if value is None else value)
    draws.sort()
    low, high = draws[int(0.05 * resamples)], draws[int(0.95 * resamples)]
    return (None if low == float("inf") else low), (None if high == float("inf") else high)


def mean_and_se(values: list[float | None]) -> tuple[float | None, float | None]:
    """The mean and its standard error (sample std / sqrt(n)); None where a value is missing (a
    target never reached) or, for the error, with one value."""
    if not values or any(v is None for v in values):
        return None, None
    known = [float(v) for v in values if v is not None]
    return statistics.fmean(known), statistics.stdev(known) / len(known) ** 0.5 if len(known) > 1 else None


def training_figures(trained: list[dict[str, Any]], budget: float | None = None) -> dict[str, Any]:
    """The training arms' figures: tokens to the root arm's final accuracy (each seed's arms
    against that seed's root arm; and on the seeds' mean curves up to `budget` tokens, by default
    the root curves' furthest point, with a bootstrap interval), the final accuracies, with
    standard errors over seeds; and the arms' own counts as they train (`training_counts`). Of the
    arms with a row at every seed (rows of some arms, `--arms`: theirs), each against root-only
    GRPO; none without root-only GRPO's."""
    seeds = sorted({r["seed"] for r in trained})
    curve = {(r["arm"], r["seed"]): r["curve"] for r in trained}
    present = [arm for arm in ALL_ARMS if all((arm, seed) in curve for seed in seeds)]
    figures: dict[str, Any] = {"tokens_to_target_pivot_vs_root": None}
    if "root" not in present:
        return figures
    roots = [curve["root", seed] for seed in seeds]
    budget = budget or max(c[-1]["tokens"] for c in roots)
    for arm, key in (("prm", "tokens_to_target_pivot_vs_root"), ("random", "tokens_to_target_random_vs_root")):
        if arm not in present:
            continue
        per_seed = [tokens_to_target(curve["root", seed], curve[arm, seed]) for seed in seeds]
        figures[key], figures[key + "_se"] = mean_and_se(per_seed)
        figures[key + "_per_seed"] = per_seed
        arms = [curve[arm, seed] for seed in seeds]
        figures[key + "_pooled"] = pooled_tokens_to_target(roots, arms, budget)
        figures[key + "_pooled_interval90"] = list(pooled_interval(roots, arms, budget))
        # The same on each curve's trailing mean of 3 evaluations: one evaluation's noise (about
        # 1.5 points at 1,024 samples) neither sets the target nor reaches it.
        smooth = [tokens_to_target(smoothed(curve["root", seed]), smoothed(curve[arm, seed])) for seed in seeds]
        figures[key + "_smoothed"], figures[key + "_smoothed_se"] = mean_and_se(smooth)
        figures[key + "_smoothed_per_seed"] = smooth
    controls, variants = [arm for arm in CONTROLS if arm in present], [arm for arm in VARIANTS if arm in present]
    for arm in [*controls, *variants]:  # to the same target, beside
        per_seed = [tokens_to_target(curve["root", seed], curve[arm, seed]) for seed in seeds]
        figures[f"tokens_to_target_{arm}_vs_root"], figures[f"tokens_to_target_{arm}_vs_root_se"] = mean_and_se(per_seed)
        figures[f"tokens_to_target_{arm}_vs_root_per_seed"] = per_seed
        arms = [curve[arm, s] for s in seeds]
        figures[f"tokens_to_target_{arm}_vs_root_pooled"] = pooled_tokens_to_target(roots, arms, budget)
        figures[f"tokens_to_target_{arm}_vs_root_pooled_interval90"] = list(pooled_interval(roots, arms, budget))
    for arm in present:
        finals = [curve[arm, seed][-1]["accuracy"] for seed in seeds]
        start = statistics.fmean(curve[arm, seed][0]["accuracy"] for seed in seeds)
        final, se = mean_and_se(finals)  # type: ignore[arg-type]
        areas = [mean_accuracy(curve[arm, seed]) for seed in seeds]
        area, area_se = mean_and_se(areas)  # type: ignore[arg-type]
        figures[f"heldout_{arm}"] = {"start": start, "final": final, "final_se": se, "final_per_seed": finals,
                                      "mean_over_tokens": area, "mean_over_tokens_se": area_se, "mean_over_tokens_per_seed": areas,
                                      "versions": [curve[arm, seed][-1]["version"] for seed in seeds]}
    # Paired by seed (the arms of a seed start from the same model and draw the same roots at
    # version 0): each arm's figure minus another's, mean and standard error over seeds.
    pairs = [("prm", "root"), ("prm", "random"), ("random", "root"), *(("prm", arm) for arm in controls)]
    pairs += [(arm, other) for arm in variants for other in ("root", arm.removesuffix("_failed"), *controls)]
    pairs.append(("prm_failed", "random_failed"))
    for a, b in (pair for pair in pairs if set(pair) <= set(present)):
        for name, of in (("final", lambda c: c[-1]["accuracy"]), ("mean_over_tokens", mean_accuracy)):
            diffs = [of(curve[a, seed]) - of(curve[b, seed]) for seed in seeds]
            mean, se = mean_and_se(diffs)  # type: ignore[arg-type]
            figures[f"heldout_{name}_{a}_minus_{b}"] = {"mean": mean, "se": se, "per_seed": diffs}
    return {**figures, **training_counts(trained, seeds, present)}


def training_counts(trained: list[dict[str, Any]], seeds: list[int], present: list[str]) -> dict[str, Any]:
    """The training arms' own counts of the goal's kind, on the policy as it trains (the sampling
    figures are at a fixed policy): failed prompts recovered per 1,000 tokens, units without a
    gradient (with the verdicts as process rewards, and on their outcomes alone), tokens saved by
    stopping, per arm and seed; each pivot arm's against the root arm's paired by seed (recovery as
    a ratio, the fractions as differences), mean and standard error, of the `present` arms (a row at
    every seed). Empty for rows without them."""
    rows = {(r["arm"], r["seed"]): r for r in trained}
    keys = ("recovered_per_1k_tokens", "no_gradient_fraction", "no_outcome_gradient_units", "units", "tokens_saved",
            "all_roots_failed", "recovered_by_branch")
    arms = [arm for arm in present if arm in ARMS]
    if not all(key in rows[arm, seed] for arm in arms for seed in seeds for key in keys):
        return {}

    def outcome_fraction(row: dict[str, Any]) -> float:
        return row["no_outcome_gradient_units"] / row["units"]

    figures: dict[str, Any] = {}
    variants = [arm for arm in VARIANTS if arm in present and all("units_unbranched" in rows[arm, seed] for seed in seeds)]
    for arm in [*arms, *variants]:
        per_seed = [rows[arm, seed] for seed in seeds]
        figures[f"training_counts_{arm}"] = {
            "recovered_per_1k_tokens": [r["recovered_per_1k_tokens"] for r in per_seed],
            "no_gradient_fraction": [r["no_gradient_fraction"] for r in per_seed],
            "no_outcome_gradient_fraction": [outcome_fraction(r) for r in per_seed],
            "tokens_saved": [r["tokens_saved"] for r in per_seed], "units": [r["units"] for r in per_seed],
            "all_roots_failed": [r["all_roots_failed"] for r in per_seed],
            "recovered_by_branch": [r["recovered_by_branch"] for r in per_seed],
            "units_unbranched": [r.get("units_unbranched", 0) for r in per_seed]}
    for arm in [*(arm for arm in ("prm", "random") if arm in arms), *variants]:
        for name, of, compare in (("recovered_per_1k_tokens", lambda r: r["recovered_per_1k_tokens"], "vs"),
                                  ("no_gradient_fraction", lambda r: r["no_gradient_fraction"], "minus"),
                                  ("no_outcome_gradient_fraction", outcome_fraction, "minus")):
            values = [(of(rows[arm, seed]), of(rows["root", seed])) for seed in seeds]
            per_seed = [a / b if b else None for a, b in values] if compare == "vs" else [a - b for a, b in values]
            mean, se = mean_and_se(per_seed)
            figures[f"training_{name}_{arm}_{compare}_root"] = {"mean": mean, "se": se, "per_seed": per_seed}
    return figures


def mean_accuracy(curve: list[dict[str, Any]]) -> float:
    """The held-out accuracy averaged over the tokens generated (the area under the curve, by the
    trapezoid rule between evaluations, over its last point's tokens): an arm that rises sooner
    scores higher, and every evaluation counts, not the last one's noise alone."""
    area = sum((p["accuracy"] + q["accuracy"]) / 2 * (q["tokens"] - p["tokens"]) for p, q in zip(curve, curve[1:]))
    return area / curve[-1]["tokens"] if curve[-1]["tokens"] else curve[-1]["accuracy"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--budget", type=int, default=6000, help="Generated tokens per arm and seed.")
    parser.add_argument("--seeds", type=int, default=2)
    parser.add_argument("--seed-start", type=int, default=0,
                        help="The first seed (a run of seeds S..S+n-1: seeds run apart are summarized together with --rows).")
    parser.add_argument("--token-ms", type=float, default=10.0,
                        help="Each decoding step takes this much longer (a real model's pace; 0: the tiny model's own).")
    parser.add_argument("--verdict-wait-s", type=float, default=5.0,
                        help="Most seconds a unit waits for its roots' last verdicts before choosing pivots (0: chosen on those in).")
    parser.add_argument("--verdict-lag-tokens", type=verdict_lag_arg,
                        help="[orchestrator.tree] verdict_lag_tokens in the pivot arms: a step's verdict acts exactly this many "
                        "tokens after its step ended (waited for, or held), so the arms' rows depend on the seed alone, not on "
                        "the machine's load (default: a verdict acts whenever it arrives; each row's verdict_lags says when that was).")
    parser.add_argument("--ahead", type=int, default=1,
                        help="Units whose roots the worker decodes while a unit waits for its roots' last verdicts "
                        "(workers/tree.py play_trees; 0: one unit at a time). Training arms play one at a time.")
    parser.add_argument("--digits", type=digits_arg, default=DIGITS,
                        help="Digits a chained-sums prompt (steps a right answer; 2 to 16), in the fine-tuning, the arms' "
                        "prompts and the held-out ones; a chain's token limit is 6 a digit.")
    parser.add_argument("--group-size", type=int, default=4)
    parser.add_argument("--k", type=int, default=4, help="Continuations of each pivot.")
    parser.add_argument("--sft-steps", type=int, default=600, help="Fine-tuning steps that give the model a signal.")
    parser.add_argument("--model", type=model_dir_arg,
                        help="An HF causal LM directory (e.g. models/smollm2 from `decentrl model import`) fine-tuned and "
                        "trained instead of the tiny model, with its tokenizer; on a GPU where there is one.")
    parser.add_argument("--sft-lr", type=sft_lr_arg, help="The fine-tuning's AdamW rate (default 3e-3, or 3e-5 with --model).")
    parser.add_argument("--checkpoint", help="Keep the fine-tuned model in this directory: fine-tuned there when it holds none, "
                        f"reused when it holds one fine-tuned with the same --model, --digits, --sft-steps and --sft-lr (its "
                        f"{RECIPE} says; otherwise refused). Default: fine-tuned into a temporary directory each run.")
    parser.add_argument("--train-budget", type=int, default=0,
                        help="Generated tokens per training arm and seed (0: no training arms, tokens_to_target null).")
    parser.add_argument("--lr", type=float, default=1e-4, help="The training arms' AdamW learning rate.")
    parser.add_argument("--groups-per-step", type=int, default=8, help="Units (prompts) in a training arm's step.")
    parser.add_argument("--root-groups-per-step", type=int, default=0,
                        help="The root-only arms' units a step (root, root_process; 0: --groups-per-step); a root-only "
                        "unit costs about 2/3 of a pivot unit's tokens, so 12 against 8 gives every arm a step about every 530 tokens.")
    parser.add_argument("--arms", nargs="+", choices=ALL_ARMS,
                        help="The training arms to run (a run of one arm is summarized with the others' rows by --rows; "
                        "default: root, random, prm, and root_process with --process-weight).")
    parser.add_argument("--local-weight", type=float, default=1.0, help="lambda: a branch's local advantage's weight.")
    parser.add_argument("--process-weight", type=float, default=0.0,
                        help="The steps' verdicts as process rewards ([orchestrator.advantages] process_weight, beside the "
                        "outcome advantages at weight 1) in every training arm but root-only GRPO, which trains on outcomes alone.")
    parser.add_argument("--process", choices=["return", "step"], default="return",
                        help="How a step's verdict credits tokens ([orchestrator.advantages] process): 'return', its step "
                        "and every earlier one; 'step', its own step's tokens only.")
    parser.add_argument("--eval-every", type=int, default=2, help="Steps between held-out evaluations.")
    parser.add_argument("--heldout", type=int, default=256, help="Held-out prompts (each sampled --eval-samples times).")
    parser.add_argument("--eval-samples", type=int, default=4)
    parser.add_argument("--rows", nargs="+", help="Summarize the lines a run printed (a file of them) instead of running: its last line "
                        "again, with the figures added since (give the run's other options too: they are reported as given).")
    parser.add_argument("--until-tokens", type=until_tokens_arg,
                        help="Summarize the training curves up to this many generated tokens (each curve's evaluations at or "
                        "under it): the arms' figures at a smaller budget, read off the same rows (with --rows, or after a run).")
    args = parser.parse_args()
    import torch

    if args.until_tokens and not args.rows and not args.train_budget:
        parser.error("--until-tokens cuts the training curves: give --train-budget, or --rows of training runs")
    if args.checkpoint and not args.rows:
        refusal = checkpoint_refusal(args.checkpoint, recipe_of(args.sft_steps, args.digits, args.model, args.sft_lr))
        if refusal:
            parser.error(refusal)
    if args.model is None:
        torch.set_num_threads(1)  # the tiny model's figures are one core's (two runs side by side); --model takes them all
    trained, runs, rebuilt, silent, sft_loss = read_rows(*args.rows) if args.rows else run_all(args)
    if args.until_tokens:
        if not trained:
            parser.error("--until-tokens cuts the training curves, and these runs hold none (--train-budget 0, or rows without a curve)")
        try:
            trained = until(trained, args.until_tokens)
        except ValueError as error:
            parser.error(str(error))
    figures = sampling_figures(runs, rebuilt, silent) if runs else {key: None for key in SAMPLING_KEYS}
    print(json.dumps({
        **(training_figures(trained, args.until_tokens or args.train_budget) if trained else {"tokens_to_target_pivot_vs_root": None}),
        **figures,
        "verdict_wait_s": args.verdict_wait_s, "verdict_lag_tokens": args.verdict_lag_tokens, "token_ms": args.token_ms,
        "budget_tokens": args.budget, "train_budget_tokens": args.train_budget, "seeds": args.seeds,
        "digits": args.digits, "max_tokens": max_tokens(args.digits),
        "group_size": args.group_size, "k": args.k, "lr": args.lr, "groups_per_step": args.groups_per_step,
        "root_groups_per_step": args.root_groups_per_step or args.groups_per_step,
        "local_weight": args.local_weight, "process_weight": args.process_weight, "process": args.process,
        "heldout": args.heldout, "eval_samples": args.eval_samples, "until_tokens": args.until_tokens,
        "model": args.model or "tiny", "sft_steps": args.sft_steps, "sft_lr": sft_rate(args.model, args.sft_lr),
        "sft_loss": None if sft_loss is None else round(sft_loss, 4),
    }))


Rows = tuple[list[dict[str, Any]], list[dict[str, Any]], dict[str, Any], dict[str, Any], float | None]


def units_a_step(arm: str, groups_per_step: int, root_groups_per_step: int) -> int:
    """A training arm's units a step: `root_groups_per_step` (unless 0) for the arms of root-only
    units (root, root_process), so that every arm trains on about the same tokens a step."""
    rooted = ALL_ARMS[arm]["pivots"] == 0
    return root_groups_per_step if rooted and root_groups_per_step else groups_per_step


def run_all(args: argparse.Namespace) -> Rows:
    """Every arm's runs, each printed as a line as it ends: the training arms', the fixed-policy
    arms', then the KV-rebuild and no-scoring measures; and the fine-tuning's final loss."""
    runs: list[dict[str, Any]] = []
    trained: list[dict[str, Any]] = []
    rebuilt: dict[str, Any] = {}
    silent: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        checkpoint = args.checkpoint or os.path.join(tmp, "v0")
        sft_loss = fine_tuned(checkpoint, args.sft_steps, digits=args.digits, base=args.model, lr=args.sft_lr)
        if args.train_budget:
            heldout = heldout_prompts(args.heldout, max(HELDOUT_SEEDS, args.seed_start + args.seeds), args.digits)
            for seed in range(args.seed_start, args.seed_start + args.seeds):
                for arm in args.arms or [*ARMS, *(CONTROLS if args.process_weight else ())]:
                    per_step = units_a_step(arm, args.groups_per_step, args.root_groups_per_step)
                    training = Training(per_step, args.lr, heldout, args.eval_samples, args.eval_every, args.local_weight,
                                        args.process_weight, args.process)
                    trained.append(run_arm(arm, seed, checkpoint, args.train_budget, args.group_size, args.k,
                                           token_s=args.token_ms / 1000, verdict_wait_s=args.verdict_wait_s, training=training,
                                           digits=args.digits, verdict_lag_tokens=args.verdict_lag_tokens, base=args.model))
                    print(json.dumps(trained[-1]), flush=True)
        pace_s = args.token_ms / 1000
        for seed in range(args.seed_start, args.seed_start + args.seeds) if args.budget else ():
            for arm in ARMS:
                runs.append(run_arm(arm, seed, checkpoint, args.budget, args.group_size, args.k, token_s=pace_s,
                                    verdict_wait_s=args.verdict_wait_s, ahead=args.ahead, digits=args.digits,
                                    verdict_lag_tokens=args.verdict_lag_tokens, base=args.model))
                print(json.dumps(runs[-1]), flush=True)
            if seed == args.seed_start:
                # The measures of the worker's side, on the first seed: the root arm without
                # posting its steps for scoring, run right after the PRM arm it is compared with
                # (a run minutes apart measures the machine's load: it drifts by 15% in minutes
                # here), then the KV cache rebuilt at each step's end (prm arm).
                silent = run_arm("root", seed, checkpoint, args.budget, args.group_size, args.k, post_steps=False, token_s=pace_s,
                                 ahead=args.ahead, digits=args.digits, base=args.model)
                print(json.dumps(silent), flush=True)
                rebuilt = run_arm("prm", seed, checkpoint, args.budget, args.group_size, args.k, keep_cache=False, token_s=pace_s,
                                  verdict_wait_s=args.verdict_wait_s, ahead=args.ahead, digits=args.digits,
                                  verdict_lag_tokens=args.verdict_lag_tokens, base=args.model)
                print(json.dumps(rebuilt), flush=True)
    return trained, runs, rebuilt, silent, sft_loss


def read_rows(*paths: str) -> Rows:
    """The runs previous runs printed (their lines but the summary lines; `--rows`: the files of
    runs of other seeds or arms together: a later file's training row of an arm and seed replaces
    an earlier one's), sorted as `run_all` returns them (the KV-rebuild and no-scoring measures:
    the first file's); the fine-tuning's loss is not in them (None)."""
    rows = []
    for path in paths:
        with open(path) as file:
            rows += [row for line in file if line.strip() and "arm" in (row := json.loads(line))]  # not the summary lines
    trained = list({(row["arm"], row["seed"]): row for row in rows if "curve" in row}.values())
    rebuilt = next((row for row in rows if not row["keep_cache"]), {})
    silent = next((row for row in rows if not row["post_steps"]), {})
    runs = [row for row in rows if "curve" not in row and row["keep_cache"] and row["post_steps"]]
    return trained, runs, rebuilt, silent, None


SAMPLING_KEYS = ("recovered_per_1k_tokens_pivot_vs_root", "all_fail_groups_pivot", "all_fail_groups_root",
                 "tokens_saved_by_early_stop", "worker_wait_for_verdicts_s", "throughput_with_scoring_vs_without")


def sampling_figures(runs: list[dict[str, Any]], rebuilt: dict[str, Any], silent: dict[str, Any]) -> dict[str, Any]:
    """The fixed-policy arms' figures (`--budget`): recovery, groups without gradient, tokens saved,
    waits, throughput, the KV cache's measure."""

    def mean(arm: str, key: str) -> float | None:
        known = [r[key] for r in runs if r["arm"] == arm and r[key] is not None]  # None: no branch sample in a run
        return statistics.fmean(known) if known else None

    def ratio(a: float | None, b: float | None) -> float | None:
        return a / b if a is not None and b else None  # None: an arm had none to compare

    def paired(arm: str) -> dict[str, Any]:
        """`arm`'s recovered per 1k tokens over the root arm's of the same seed (the same roots):
        each seed's ratio, their mean and its standard error (> 1 shown when mean - 2 se > 1)."""
        per_seed = {r["seed"]: r["recovered_per_1k_tokens"] for r in runs if r["arm"] == arm}
        root = {r["seed"]: r["recovered_per_1k_tokens"] for r in runs if r["arm"] == "root"}
        ratios = [per_seed[seed] / root[seed] for seed in sorted(per_seed.keys() & root.keys()) if root[seed]]
        mean, se = mean_and_se(ratios)  # type: ignore[arg-type]
        return {"mean": mean, "se": se, "per_seed": ratios, "seeds": sorted(per_seed.keys() & root.keys())}

    first = min(r["seed"] for r in runs)  # the seed of the KV-rebuild and no-scoring measures (run_all)
    kept = next(r for r in runs if r["arm"] == "prm" and r["seed"] == first)
    posted_root = next(r for r in runs if r["arm"] == "root" and r["seed"] == first)
    return {
        # Failed prompts (the unit's first sample wrong, in every arm a root's) that get a right
        # sample elsewhere in their unit, per 1k generated tokens: PRM pivots over root-only.
        "recovered_per_1k_tokens_pivot_vs_root": ratio(mean("prm", "recovered_per_1k_tokens"), mean("root", "recovered_per_1k_tokens")),
        "recovered_per_1k_tokens_random_vs_root": ratio(mean("random", "recovered_per_1k_tokens"), mean("root", "recovered_per_1k_tokens")),
        "recovered_per_1k_tokens": {arm: mean(arm, "recovered_per_1k_tokens") for arm in ARMS},
        "recovered_per_1k_tokens_pivot_vs_root_paired": paired("prm"),
        "recovered_per_1k_tokens_random_vs_root_paired": paired("random"),
        "solved_per_1k_tokens_pivot_vs_root": ratio(mean("prm", "solved_per_1k_tokens"), mean("root", "solved_per_1k_tokens")),
        "all_fail_groups_pivot": mean("prm", "no_gradient_fraction"),
        "all_fail_groups_random": mean("random", "no_gradient_fraction"),
        "all_fail_groups_root": mean("root", "no_gradient_fraction"),
        "tokens_saved_by_early_stop": sum(r["tokens_saved"] for r in runs if r["arm"] == "prm"),
        "tokens_saved_by_early_stop_random": sum(r["tokens_saved"] for r in runs if r["arm"] == "random"),
        # Decoding reads verdicts between tokens and never waits for one; a unit with pivots waits
        # for its roots' last verdicts before choosing where to branch (workers/tree.py).
        "worker_wait_for_verdicts_s": sum(r["verdict_wait_s"] for r in runs),
        "branch_success": {arm: mean(arm, "branch_success") for arm in ("random", "prm")},
        "root_success": {arm: mean(arm, "root_success") for arm in ARMS},
        "worker_wait_for_step_posts_s": sum(r["step_post_wait_s"] for r in runs),
        "throughput_with_scoring_vs_without": ratio(posted_root["tokens_per_decode_s"], silent["tokens_per_decode_s"]),
        # The same for the PRM arm with its waits before choosing pivots counted as its time: what
        # a worker generates a second with branching, against root-only without scoring (seed S).
        "throughput_prm_with_waits_vs_without": ratio(kept["tokens"] / (kept["decode_s"] + kept["verdict_wait_s"]),
                                                      silent["tokens_per_decode_s"]),
        # The same on the wall clock (leasing, posting the samples, everything between the units'
        # decodes): the PRM arm's tokens a second against the silent root arm's.
        "throughput_prm_wall_vs_without": ratio(kept["tokens"] / kept["wall_s"], silent["tokens"] / silent["wall_s"]),
        # Within the PRM arm's run (no other run's load in it): the share of its time that decodes,
        # against its waits for verdicts and for its last steps' posts.
        "prm_decoding_share": kept["decode_s"] / (kept["decode_s"] + kept["verdict_wait_s"] + kept["step_post_wait_s"]),
        # Apart from the machine's speed (which drifts between runs): tokens per batched decoding
        # step, the PRM arm's over the silent root arm's (how well its batches are filled).
        "tokens_per_decode_step_prm_vs_without": ratio(kept["tokens"] / kept["decode_steps"], silent["tokens"] / silent["decode_steps"])
        if "decode_steps" in kept and "decode_steps" in silent else None,
        "prm_verdict_wait_s": kept["verdict_wait_s"], "prm_decode_s": kept["decode_s"], "ahead": kept.get("ahead", 0),
        "kv_keep_decode_s": kept["decode_s"], "kv_rebuild_decode_s": rebuilt["decode_s"],
        "kv_rebuild_s": rebuilt["cache_rebuild_s"],
    }


HELDOUT_SEEDS = 3  # the held-out prompts avoid the arms' tasks of seeds 0-2 at least: one set for seeds run apart


def heldout_prompts(count: int, seeds: int, digits: int = DIGITS) -> list[str]:
    """`count` chained-sums prompts of `digits` digits that neither the fine-tuning's prompts nor
    the task of an arm of seeds 0 to `seeds` - 1 holds."""
    from decentrl.config import ChainTaskConfig
    from decentrl.tasks.chain import ChainTask

    seen = set()
    for seed in [*range(seeds), 1000]:  # the arms' tasks, the fine-tuning's (finetune)
        task = ChainTask(ChainTaskConfig(num_digits=digits, num_prompts=4096, seed=seed))
        seen |= {task.prompt(i).text for i in range(task.num_prompts)}
    pool = ChainTask(ChainTaskConfig(num_digits=digits, num_prompts=4096, seed=777))
    fresh = [text for i in range(pool.num_prompts) if (text := pool.prompt(i).text) not in seen]
    if len(fresh) < count:
        raise ValueError(f"only {len(fresh)} held-out prompts; ask for fewer (--heldout)")
    return fresh[:count]


if __name__ == "__main__":
    main()
