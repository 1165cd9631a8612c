"""The reward guard's failure counts leave the orchestrator: `decentrl_reward_failures_total{kind}`
on /metrics and `reward_failures` in /v1/status, read from the task at scrape time; tasks without
a guard report none."""

from __future__ import annotations

from typing import Any

from decentrl.tasks import Prompt, build_task
from orchestrator.metrics import Metrics
from orchestrator.state import RunState


class GuardedSorting:
    """The sorting task, reporting failures as a guarded task source does."""

    def __init__(self, task: Any) -> None:
        self._task = task
        self.num_prompts = task.num_prompts
        self.reward_failures = {"timeout": 2, "out_of_range": 1}

    def prompt(self, prompt_id: int) -> Prompt:
        return self._task.prompt(prompt_id)

    def reward(self, prompt: Prompt, completion_text: str) -> float:
        return self._task.reward(prompt, completion_text)


def test_reward_failures_are_exported(make_config: Any, tokenizer: Any, clock: Any) -> None:
    config = make_config()
    state = RunState(config=config, task=GuardedSorting(build_task(config.task)), tokenizer=tokenizer, clock=clock)
    assert state.status().reward_failures == {"timeout": 2, "out_of_range": 1}
    text = Metrics(state).render().decode()
    assert 'decentrl_reward_failures_total{kind="timeout"} 2.0' in text
    assert 'decentrl_reward_failures_total{kind="out_of_range"} 1.0' in text
    plain = RunState(config=config, task=build_task(config.task), tokenizer=tokenizer, clock=clock)
    assert plain.status().reward_failures == {}
    assert "decentrl_reward_failures_total{" not in Metrics(plain).render().decode()
