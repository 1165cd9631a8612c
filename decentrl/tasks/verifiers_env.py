"""`[task] type = "verifiers"`: a verifiers environment (the `verifiers.v1` API) as a decentrl task.

What maps to what:
- prompts: the taskset's tasks (`Taskset.load()`, read through verifiers' own loader
  `load_taskset`, at most `size` of them): each task's `system_prompt` and `prompt` (a string
  or chat messages) become a `Prompt` with messages, rendered by decentrl/tasks/prompts.py;
- rewards: the task's `@vf.reward` functions (and plugged ones), run by verifiers' `Task.score`
  over a `Trace` built from the transcript; the reward is the trace's weighted sum. Scoring runs
  in the reward guard's child process (decentrl/tasks/guard.py), so a reward that raises, hangs
  or leaves [0, 1] scores 0 and is counted;
- multi-turn: an `Env` other than `SingleAgentEnv` (the taskset package's own, or `env`) is an
  `EpisodeTask` (decentrl/tasks/episodes.py). Its `run(task, agents)` coroutine is the
  environment: each `await chat.turn(message)` on the one agent seat is one model turn, the
  message before it is the environment's answer. decentrl drives the coroutine step by step
  (`Conversation`), on the worker that samples and again on the orchestrator that replays, so
  `run` must be deterministic and await nothing but its seat's turns.

decentrl plays the policy seat itself: verifiers' harnesses, runtimes (sandboxes), tool servers,
model clients and judges are not used, and a task that needs a container or tool servers is
refused at start-up. Built by decentrl/tasks/__init__.py `build_task` (needs the `verifiers` extra).
"""

from __future__ import annotations

import asyncio
import functools
import itertools
from collections.abc import Generator
from typing import TYPE_CHECKING, Any

from decentrl.config import VerifiersTaskConfig
from decentrl.tasks.base import Prompt
from decentrl.tasks.episodes import Answer, EpisodeTask
from decentrl.tasks.guard import RewardGuard
from decentrl.tasks.sources import Part, held_out

if TYPE_CHECKING:
    import verifiers.v1 as vf

# (role, content, sampled): one message of a transcript; sampled = the model wrote it.
Turn = tuple[str, str, bool]
ROLES = ("system", "user", "assistant")


class VerifiersError(ValueError):
    """An environment decentrl cannot run; the message names the task and what to change."""


# -- loading --------------------------------------------------------------------------------


def taskset_config(config: VerifiersTaskConfig) -> Any:  # noqa: ANN401 - the taskset's own TasksetConfig
    from verifiers.v1.utils.loaders import taskset_config_type

    return taskset_config_type(config.taskset).model_validate({**config.options, "id": config.taskset})


def load_tasks(config: VerifiersTaskConfig) -> list[vf.Task]:
    """The first `size` tasks of the taskset; one that needs what decentrl does not run fails here."""
    from verifiers.v1.utils.loaders import load_taskset

    settings = taskset_config(config)
    taskset = load_taskset(settings)
    if type(taskset).toolsets(settings):
        raise VerifiersError(f"task.taskset {config.taskset!r} has shared tool servers, which decentrl does not run")
    tasks = list(itertools.islice(iter(taskset), config.size))
    if not tasks:
        raise VerifiersError(f"task.taskset {config.taskset!r} yields no tasks")
    first = tasks[0]
    if first.NEEDS_CONTAINER or type(first).toolsets(first.config):
        raise VerifiersError(
            f"task.taskset {config.taskset!r}: its tasks need a container or tool servers, which decentrl does not run"
        )
    return tasks


def is_multi_turn(config: VerifiersTaskConfig) -> bool:
    """Whether the environment's Env (verifiers' choice: `env`, else the taskset package's own, else
    SingleAgentEnv) is one that converses."""
    from verifiers.v1.envs.single_agent import SingleAgentEnv
    from verifiers.v1.utils.loaders import environment_class

    return not issubclass(environment_class(config.taskset, config.env), SingleAgentEnv)


def prompt_turns(task: vf.Task) -> list[Turn]:
    """The task's system prompt and prompt as messages; roles other than system/user/assistant fail."""
    from verifiers.v1.types import content_text

    data = task.data
    turns: list[Turn] = [] if data.system_prompt is None else [("system", data.system_prompt, False)]
    if isinstance(data.prompt, str):
        turns.append(("user", data.prompt, False))
    for i, message in enumerate(data.prompt if isinstance(data.prompt, list) else []):
        if message.role not in ROLES:
            raise VerifiersError(f"task {data.idx}: prompt message {i} has role {message.role!r}; decentrl renders "
                                 f"{', '.join(ROLES)} only")
        turns.append((message.role, content_text(message.content), False))
    return turns


def as_prompt(prompt_id: int, turns: list[Turn]) -> Prompt:
    return Prompt(prompt_id, "\n".join(text for _, text, _ in turns), tuple((role, text) for role, text, _ in turns))


# -- scoring (in the reward guard's child) --------------------------------------------------


def make_trace(task: vf.Task, turns: list[Turn]) -> vf.Trace:
    """A verifiers Trace of the transcript: one message node per turn, each the child of the last."""
    import verifiers.v1 as vf
    from verifiers.v1.graph import MessageNode
    from verifiers.v1.trace import AgentInfo, TraceTask

    kinds = {"system": vf.SystemMessage, "user": vf.UserMessage, "assistant": vf.AssistantMessage}
    nodes = [
        MessageNode(message=kinds[role](content=text), parent=i - 1 if i else None, sampled=sampled)
        for i, (role, text, sampled) in enumerate(turns)
    ]
    return vf.Trace(
        task=TraceTask(type=type(task).__name__, data=task.data, key=task.key, hash=task.hash),
        agent=AgentInfo(config=vf.AgentConfig()), nodes=nodes, is_completed=True, ok=True,
    )


def scorer(config: VerifiersTaskConfig):  # noqa: ANN201 - the guard's child calls it
    """score(position, transcript) for the guard's child: the task's rewards over the transcript."""
    tasks = load_tasks(config)

    def score(position: int, turns: list[Turn]) -> float:
        task = tasks[position]
        trace = make_trace(task, turns)
        asyncio.run(task.score(trace))  # the child runs no event loop of its own
        return trace.reward

    return score


class _Source:
    """What both task kinds share: the tasks of one part (train or held-out) and the guarded score."""

    def __init__(self, config: VerifiersTaskConfig, part: Part, tasks: list[vf.Task] | None = None) -> None:
        self.config = config
        self.part = part
        all_tasks = load_tasks(config) if tasks is None else tasks
        held = held_out(len(all_tasks), config.eval_fraction, config.seed)
        # prompt id -> position in the taskset (what the guard's child indexes by)
        self._positions = [i for i in range(len(all_tasks)) if (i in held) == (part == "eval")]
        if not self._positions:
            raise VerifiersError(f"task.eval_fraction {config.eval_fraction} leaves no {part} tasks of {config.taskset!r}")
        self._tasks = all_tasks
        self.num_prompts = len(self._positions)
        self._guard = RewardGuard(functools.partial(scorer, config), timeout_s=config.reward_timeout_s,
                                  name=f"verifiers {config.taskset}")

    def task_of(self, prompt_id: int) -> vf.Task:
        return self._tasks[self._positions[prompt_id]]

    def score(self, prompt_id: int, turns: list[Turn]) -> float:
        return self._guard(prompt_id, self._positions[prompt_id], turns)

    @property
    def reward_failures(self) -> dict[str, int]:
        return dict(self._guard.failures)

    def heldout_task(self) -> _Source:
        if self.config.eval_fraction == 0:
            raise ValueError("this verifiers task holds nothing out: set task.eval_fraction")
        return type(self)(self.config, "eval", self._tasks)


class VerifiersTask(_Source):
    """Single-turn: the model answers the task's prompt once; the task's rewards score the answer."""

    def __init__(self, config: VerifiersTaskConfig, part: Part = "train", tasks: list[vf.Task] | None = None) -> None:
        super().__init__(config, part, tasks)
        self._prompts = [as_prompt(i, self._turns(i)) for i in range(self.num_prompts)]

    def _turns(self, prompt_id: int) -> list[Turn]:
        turns = prompt_turns(self.task_of(prompt_id))
        if not any(role == "user" for role, _, _ in turns):
            raise VerifiersError(f"task {self.task_of(prompt_id).data.idx} of {self.config.taskset!r} has no prompt "
                                 "(the user opens): only a multi-turn Env can open it")
        return turns

    def prompt(self, prompt_id: int) -> Prompt:
        return self._prompts[prompt_id]

    def reward(self, prompt: Prompt, completion_text: str) -> float:
        turns = [(role, text, False) for role, text in prompt.messages or ()]
        return self.score(prompt.prompt_id, [*turns, ("assistant", completion_text, True)])


# -- multi-turn -----------------------------------------------------------------------------


class _ModelTurn:
    """Awaited by the seat's `turn()`: suspends the Env's `run` until the model's turn is in."""

    def __await__(self) -> Generator[_ModelTurn, str, str]:
        return (yield self)


class _Chat:
    """The seat's open interaction, as the Env sees it (`async with agents.<seat>.interaction(task)`)."""

    def __init__(self, conversation: Conversation) -> None:
        self._conversation = conversation

    async def __aenter__(self) -> _Chat:
        return self

    async def __aexit__(self, *exc: object) -> None:
        return None

    @property
    def trace(self) -> vf.Trace:
        return make_trace(self._conversation.task, self._conversation.turns)

    async def turn(self, message: str | None = None) -> Any:  # noqa: ANN401 - a verifiers Segment
        from verifiers.v1.agent import Segment
        from verifiers.v1.types import AssistantMessage

        if message is not None:
            self._conversation.turns.append(("user", message, False))
        reply = await _ModelTurn()
        self._conversation.turns.append(("assistant", reply, True))
        return Segment(messages=[AssistantMessage(content=reply)])


class _Seat:
    """The policy's seat: decentrl's sampler instead of verifiers' harness and model client."""

    def __init__(self, conversation: Conversation) -> None:
        self._conversation = conversation

    def interaction(self, task: vf.Task) -> _Chat:
        return _Chat(self._conversation)

    async def run(self, task: vf.Task) -> None:
        async with self.interaction(task) as chat:
            await chat.turn()


class Conversation:
    """One episode: the Env's `run` coroutine, advanced one model turn at a time. `turns` is the
    transcript (prompt, model turns, the environment's messages) the task's rewards score."""

    def __init__(self, env: vf.Env, task: vf.Task) -> None:
        import verifiers.v1 as vf

        self.task = task
        self.turns = prompt_turns(task)
        self.done = False
        agents = vf.Agents(env.config, make=lambda name, value: _Seat(self))
        self._run = env.run(task, agents)
        self._resume(None)
        if self.done:
            raise VerifiersError(f"the Env of task {task.data.idx} ended before the model's first turn")

    def _resume(self, reply: str | None) -> None:
        """Run the Env until it awaits the next model turn, or ends."""
        try:
            awaited = self._run.send(reply)
        except StopIteration:
            self.done = True
            return
        if not isinstance(awaited, _ModelTurn):
            self._run.close()
            raise VerifiersError(
                f"the Env awaited {awaited!r}: decentrl replays an environment step by step, so its run() may await "
                "only its seat's turns (no I/O, timers or other agents)"
            )

    def step(self, model_turn: str) -> tuple[list[str], bool]:
        """The environment's messages after `model_turn`, and whether the episode is over."""
        before = len(self.turns) + 1  # the model's turn is appended first
        self._resume(model_turn)
        return [text for role, text, _ in self.turns[before:] if role == "user"], self.done

    def close(self) -> None:
        self._run.close()


class VerifiersEnvironment:
    """decentrl's `Environment` over a Conversation (deterministic: the orchestrator replays it)."""

    def __init__(self, source: VerifiersEpisodeTask, prompt_id: int) -> None:
        self._source = source
        self._prompt_id = prompt_id
        self.conversation = Conversation(source.env, source.task_of(prompt_id))

    def step(self, model_turn: str) -> Answer:
        messages, done = self.conversation.step(model_turn)
        text = "".join(self._source.config.user_turn.replace("{message}", message) for message in messages)
        return Answer(text, done=done)

    def reward(self) -> float:
        self.conversation.close()
        return self._source.score(self._prompt_id, self.conversation.turns)


class VerifiersEpisodeTask(_Source, EpisodeTask):
    """Multi-turn: the Env's conversation with its one seat, played and replayed as an episode."""

    def __init__(self, config: VerifiersTaskConfig, part: Part = "train", tasks: list[vf.Task] | None = None) -> None:
        from verifiers.v1.configs.agent import agent_config_fields
        from verifiers.v1.utils.loaders import load_environment, resolve_env_config

        super().__init__(config, part, tasks)
        self.max_turns = config.max_turns
        self.max_turn_tokens = config.max_turn_tokens
        self.env = load_environment(resolve_env_config(
            {"id": config.env, "taskset": {**config.options, "id": config.taskset}}
        ))
        seats = list(agent_config_fields(self.env.config))
        if len(seats) != 1:
            raise VerifiersError(f"{type(self.env).__name__} declares the seats {seats}; decentrl trains one policy "
                                 "and plays exactly one seat")
        self._prompts: dict[int, Prompt] = {}

    def prompt(self, prompt_id: int) -> Prompt:
        """The transcript up to the model's first turn (the Env may open with a message)."""
        if prompt_id not in self._prompts:
            conversation = Conversation(self.env, self.task_of(prompt_id))
            conversation.close()
            self._prompts[prompt_id] = as_prompt(prompt_id, conversation.turns)
        return self._prompts[prompt_id]

    def environment(self, prompt: Prompt) -> VerifiersEnvironment:
        return VerifiersEnvironment(self, prompt.prompt_id)
