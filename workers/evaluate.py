"""Evaluate one published version (`decentrl eval`, benchmarks/async_vs_sync.py): sample with the
hf backend, rendering and decoding as in a run, and score with the task's correctness (format
credit shapes training, never eval): mean reward and pass@k. Prompts are held out by default.
"""

from __future__ import annotations

import math
import random
from dataclasses import asdict, dataclass
from typing import Literal

from decentrl.api.wire import SamplingParams
from decentrl.config import RunConfig
from decentrl.model.devices import ComputeDtype
from decentrl.tasks import Prompt, Task, build_task
from decentrl.tasks.answers import FormatCredited
from decentrl.tasks.episodes import EpisodeTask
from decentrl.tasks.prompts import make_prompt_encoder
from decentrl.tasks.sources import HeldOutSource
from workers.backends.hf import HFBackend

Split = Literal["heldout", "train"]
HELDOUT_SEED_OFFSET = 1_000_003  # a pool seed no run config is likely to use for training


class EvalError(ValueError):
    """The evaluation cannot run as asked; the message says what to change."""


@dataclass(frozen=True)
class EvalResult:
    version: int
    split: Split
    prompts: int
    samples_per_prompt: int
    greedy: bool
    reward_mean: float
    reward_stderr: float  # over prompts: the spread of per-prompt means / sqrt(prompts)
    solved_fraction: float  # samples with reward 1.0
    completion_tokens_mean: float
    pass_at_k: dict[str, float]  # "pass@1", "pass@2", ... up to samples_per_prompt (solved = reward 1.0)

    def as_dict(self) -> dict[str, object]:
        return asdict(self)


def eval_prompts(config: RunConfig, split: Split, count: int, seed: int = 0) -> tuple[Task, list[Prompt]]:
    """`count` prompts of `split`, drawn without replacement, and the task they belong to, which
    scores them (a prompt id indexes its own task's entries, never the training pool's)."""
    task = build_task(config.task)
    if isinstance(task, EpisodeTask):
        raise EvalError(f"task.type {config.task.type!r} is multi-turn; `decentrl eval` scores single-turn tasks only")
    if split == "train":
        pool_task, pool = task, range(task.num_prompts)
    elif isinstance(task, HeldOutSource):  # a dataset's eval split: held out by the file, not by a seed
        try:
            pool_task = task.heldout_task()
        except ValueError as exc:
            raise EvalError(f"{exc}, or evaluate with split 'train'") from None
        pool = range(pool_task.num_prompts)
    else:
        pool_task = build_task(config.task.model_copy(update={"seed": config.task.seed + HELDOUT_SEED_OFFSET}))
        seen = {task.prompt(i).text for i in range(task.num_prompts)}
        pool = []
        for i in range(pool_task.num_prompts):
            if (text := pool_task.prompt(i).text) not in seen:
                seen.add(text)  # each held-out text once
                pool.append(i)
    if len(pool) < count:
        hint = " (this task's seed only reorders one fixed prompt set: use split 'train')" if split == "heldout" else ""
        raise EvalError(f"split {split!r} has {len(pool)} prompts, fewer than the {count} asked for{hint}")
    chosen = random.Random(seed).sample(list(pool), count)
    return pool_task, [pool_task.prompt(i) for i in chosen]


def evaluate(
    config: RunConfig,
    checkpoint_dir: str,
    version: int,
    *,
    prompts: int = 512,
    samples_per_prompt: int = 4,
    split: Split = "heldout",
    greedy: bool = False,
    seed: int = 0,
    device: str = "cpu",
    compute: ComputeDtype = "auto",
    batch_rows: int = 512,
) -> EvalResult:
    """Mean reward of `version` (a verified local checkpoint directory) over `prompts` x `samples_per_prompt`."""
    task, chosen = eval_prompts(config, split, prompts, seed)
    backend = HFBackend(device=device, seed=seed, compute=compute)  # as the run's workers compute ([worker] compute_dtype)
    backend.load(checkpoint_dir, version)
    assert backend.tokenizer is not None
    sampling = SamplingParams(**config.sampling.model_dump())
    if greedy:  # top-1: a kept set of one token, whose logprob is 0
        sampling = sampling.model_copy(update={"top_k": 1})
    samples = 1 if greedy else samples_per_prompt
    encode = make_prompt_encoder(config.prompt, backend.tokenizer, task)  # as the orchestrator renders
    rows = [(prompt, encode(prompt)) for prompt in chosen for _ in range(samples)]
    score = task.correctness if isinstance(task, FormatCredited) else task.reward  # no format credit
    rewards: list[float] = []
    tokens = 0
    for start in range(0, len(rows), batch_rows):
        chunk = rows[start : start + batch_rows]
        for (prompt, _), completion in zip(chunk, backend.generate([ids for _, ids in chunk], sampling), strict=True):
            text = backend.tokenizer.decode(completion.token_ids, skip_special_tokens=True)
            rewards.append(score(prompt, text))
            tokens += len(completion.token_ids)
    per_prompt = [sum(rewards[i : i + samples]) / samples for i in range(0, len(rewards), samples)]
    mean = sum(per_prompt) / len(per_prompt)
    spread = math.sqrt(sum((r - mean) ** 2 for r in per_prompt) / max(len(per_prompt) - 1, 1))
    return EvalResult(
        version=version,
        split=split,
        prompts=len(chosen),
        samples_per_prompt=samples,
        greedy=greedy,
        reward_mean=mean,
        reward_stderr=spread / math.sqrt(len(per_prompt)),
        solved_fraction=sum(r == 1.0 for r in rewards) / len(rewards),
        completion_tokens_mean=tokens / len(rewards),
        pass_at_k=pass_at_k_table(rewards, samples),
    )


def pass_at_k(n: int, c: int, k: int) -> float:
    """Chance that at least one of k samples drawn without replacement from n, c of them solved
    (reward 1.0), is solved: the unbiased estimator 1 - C(n-c, k) / C(n, k) (Chen et al., 2021)."""
    return 1.0 if n - c < k else 1.0 - math.comb(n - c, k) / math.comb(n, k)


def pass_at_k_table(rewards: list[float], samples: int) -> dict[str, float]:
    """pass@k averaged over prompts for k = 1, 2, 4, ... up to the samples per prompt."""
    solved = [sum(r == 1.0 for r in rewards[i : i + samples]) for i in range(0, len(rewards), samples)]
    ks = sorted({2**i for i in range(samples.bit_length())} | {samples})
    return {f"pass@{k}": sum(pass_at_k(samples, c, k) for c in solved) / len(solved) for k in ks}
