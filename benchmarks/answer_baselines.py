"""What a policy scores without reading the task: trivial answers on the held-out prompts that
`decentrl eval CONFIG --prompts N --seed S` draws, scored by the task's own reward.

A trained policy has learned the task only where it beats these, not merely its version 0:
  best_constant     the one answer, given to every prompt, that scores best: tried are the 20
                    most common reference answers and the per-character majority string (each
                    position's most common character of the references, lowercased and not)
  prompt_last_word  the prompt's last word, echoed (spell_backward: the word unreversed, which
                    is right in the middle letter and whole for palindromes)
Each: reward_mean, reward_stderr (over prompts) and solved_fraction (reward 1.0; a fixed answer's
pass@k for every k). For tasks with reference answers (AnswerSource, decentrl/tasks/sources.py).
docs/tasks.md reports the figures for configs/reasoning.toml.
Last line: one JSON object.
Usage: python benchmarks/answer_baselines.py configs/reasoning.toml [--prompts 256] [--seed 0]
"""

from __future__ import annotations

import argparse
import collections
import json
import math
from collections.abc import Callable

from decentrl.config import load_config
from decentrl.tasks import Prompt, Task
from decentrl.tasks.sources import AnswerSource
from workers.evaluate import eval_prompts


def score(task: Task, prompts: list[Prompt], answer: Callable[[Prompt], str]) -> dict[str, float]:
    rewards = [task.reward(p, answer(p)) for p in prompts]
    mean = sum(rewards) / len(rewards)
    spread = math.sqrt(sum((r - mean) ** 2 for r in rewards) / max(len(rewards) - 1, 1))
    return {
        "reward_mean": round(mean, 4),
        "reward_stderr": round(spread / math.sqrt(len(rewards)), 4),
        "solved_fraction": round(sum(r == 1.0 for r in rewards) / len(rewards), 4),
    }


def majority_string(answers: list[str]) -> str:
    """Each position's most common character over the answers long enough to have one."""
    width = max(len(a) for a in answers)
    return "".join(collections.Counter(a[i] for a in answers if len(a) > i).most_common(1)[0][0] for i in range(width))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("config")
    parser.add_argument("--prompts", type=int, default=256)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    config = load_config(args.config)
    task, prompts = eval_prompts(config, "heldout", args.prompts, args.seed)
    if not isinstance(task, AnswerSource):
        raise SystemExit(f"task.type {config.task.type!r} has no reference answers to build constant answers from")
    answers = [task.answer(p.prompt_id) for p in prompts]
    candidates = [a for a, _ in collections.Counter(answers).most_common(20)]
    candidates += [majority_string(answers), majority_string([a.lower() for a in answers])]
    constants = {c: score(task, prompts, lambda _p, c=c: c) for c in dict.fromkeys(candidates)}
    best = max(constants, key=lambda c: constants[c]["reward_mean"])
    print(json.dumps({
        "config": args.config,
        "prompts": len(prompts),
        "seed": args.seed,
        "best_constant": {"answer": best, **constants[best]},
        "prompt_last_word": score(task, prompts, lambda p: p.text.split()[-1] if p.text.split() else ""),
    }))


if __name__ == "__main__":
    main()
