"""The exact step checker of the chained-sums task, as a `python` scorer function
(`[scorer] type = "python"`, function = "workers.scorers.chain:judge"): a partial step item
(POST /v1/steps) gets 1 if its step is right, else 0 (decentrl/tasks/chain.py `check_step`); a
whole sample gets the task's reward, and (process rewards, steps split at "=") one score per step.
A chain's last step that ended without "=" (at end-of-sequence or the token limit) is judged as
the chain's end (`check_last_step`), not as the step before it."""

from __future__ import annotations

from decentrl.api.wire import ScoreItem
from decentrl.tasks.chain import MARKER, chain_reward, judge_step
from workers.scorers.base import Verdict


def judge(items: list[ScoreItem]) -> list[Verdict]:
    verdicts = []
    for item in items:
        if item.step is not None:
            # The step judged is the last of `steps`; a step item without them ends with its marker.
            last = item.steps[-1] if item.steps else MARKER
            verdicts.append(Verdict(score=float(judge_step(item.prompt, item.completion, last))))
            continue
        steps = None
        if item.steps is not None:
            steps = [float(judge_step(item.prompt, "".join(item.steps[: i + 1]), item.steps[i])) for i in range(len(item.steps))]
        verdicts.append(Verdict(score=chain_reward(item.prompt, item.completion), step_scores=steps))
    return verdicts
