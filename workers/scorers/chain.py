"""The exact step checker of the chained-sums task, as a `python` scorer function
(`[scorer] type = "python"`, function = "workers.scorers.chain:judge"): a partial step item
(POST /v1/steps) gets 1 if its step is right, else 0 (decentrl/tasks/chain.py `check_step`); a
whole sample gets the task's reward, and (process rewards, steps split at "=") one score per step."""

from __future__ import annotations

from decentrl.api.wire import ScoreItem
from decentrl.tasks.chain import chain_reward, check_step
from workers.scorers.base import Verdict


def judge(items: list[ScoreItem]) -> list[Verdict]:
    verdicts = []
    for item in items:
        if item.step is not None:
            verdicts.append(Verdict(score=float(bool(check_step(item.prompt, item.completion)))))
            continue
        steps = None
        if item.steps is not None:
            steps = [float(bool(check_step(item.prompt, "".join(item.steps[: i + 1])))) for i in range(len(item.steps))]
        verdicts.append(Verdict(score=chain_reward(item.prompt, item.completion), step_scores=steps))
    return verdicts
