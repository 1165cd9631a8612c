"""Small verifiers environments (the `verifiers.v1` API), as a user writes them, for the tests of
the `verifiers` task source (tests/core/test_tasks_verifiers.py, tests/pipeline/test_pipeline_verifiers.py).

verifiers' loader imports an environment by a top-level module name, so the tests write these
sources as modules into a directory they put on the path (`write_environments`). vf_guess speaks
only digits and '=', which the tiny tokenizer spells (the pipeline test trains on it).
"""

from __future__ import annotations

import textwrap
from pathlib import Path

# Environment packages as a user writes them; verifiers' loader imports them by id.
MODULES = {
    # Single-turn: reverse three digits. Two weighted rewards (exact answer, right first digit);
    # odd tasks give their prompt as chat messages, even ones as a string.
    "vf_reverse": '''
        import verifiers.v1 as vf

        class ReverseData(vf.TaskData):
            answer: str

        class ReverseConfig(vf.TasksetConfig):
            count: int = 6

        class ReverseTask(vf.Task[ReverseData, vf.State, vf.TaskConfig]):
            @vf.reward(weight=0.5)
            async def exact(self, task, trace) -> float:
                return float(trace.last_reply == task.answer)

            @vf.reward(weight=0.5)
            async def first_digit(self, task, trace) -> float:
                return float(trace.last_reply[:1] == task.answer[:1])

        class ReverseTaskset(vf.Taskset[ReverseTask, ReverseConfig]):
            def load(self):
                for i in range(self.config.count):
                    digits = f"{i}{i + 1}{i + 2}"
                    prompt = f"{digits}="
                    data = ReverseData(prompt=[vf.UserMessage(content=prompt)] if i % 2 else prompt,
                                       system_prompt="Reverse.", answer=digits[::-1])
                    yield ReverseTask(data, self.config.task)

        async def bonus(task, trace) -> float:  # plugged through the taskset's options
            return 1.0

        async def broken(task, trace) -> float:
            raise RuntimeError("reward bug")

        __all__ = ["ReverseTaskset"]
    ''',
    # Multi-turn: guess a digit. The Env opens ("9="), answers each guess "1=" (higher), "2="
    # (lower) or "0=" (not a digit), and ends the conversation when the guess is right.
    "vf_guess": '''
        import verifiers.v1 as vf

        class GuessData(vf.TaskData):
            secret: int

        class GuessTask(vf.Task[GuessData, vf.State, vf.TaskConfig]):
            @vf.reward
            async def found(self, task, trace) -> float:
                guesses = [message.content.strip() for message in trace.assistant_messages]
                return 1.0 - guesses.index(str(task.secret)) / 4 if str(task.secret) in guesses else 0.0

        class GuessTaskset(vf.Taskset[GuessTask, vf.TasksetConfig]):
            def load(self):
                for i in range(10):
                    yield GuessTask(GuessData(prompt=None, secret=(7 * i + 3) % 10), self.config.task)

        class GuessEnvConfig(vf.EnvConfig):
            player: vf.AgentConfig = vf.AgentConfig()

        class GuessEnv(vf.Env[GuessEnvConfig]):
            async def run(self, task, agents):
                async with agents.player.interaction(task) as chat:
                    segment = await chat.turn("9=")
                    while segment.last_reply != str(task.data.secret):
                        guess = segment.last_reply
                        hint = "0=" if not guess.isdigit() else "1=" if int(guess) < task.data.secret else "2="
                        segment = await chat.turn(hint)

        __all__ = ["GuessTaskset", "GuessEnv"]
    ''',
    # Envs decentrl refuses: one waits on a timer, one seats two agents.
    "vf_sleepy": '''
        import asyncio
        import verifiers.v1 as vf

        class SleepyEnvConfig(vf.EnvConfig):
            player: vf.AgentConfig = vf.AgentConfig()

        class SleepyEnv(vf.Env[SleepyEnvConfig]):
            async def run(self, task, agents):
                async with agents.player.interaction(task) as chat:
                    await chat.turn("9=")
                    await asyncio.sleep(0)

        __all__ = ["SleepyEnv"]
    ''',
    "vf_pair": '''
        import verifiers.v1 as vf

        class PairEnvConfig(vf.EnvConfig):
            player: vf.AgentConfig = vf.AgentConfig()
            opponent: vf.AgentConfig = vf.AgentConfig()

        class PairEnv(vf.Env[PairEnvConfig]):
            async def run(self, task, agents):
                await agents.player.run(task)

        __all__ = ["PairEnv"]
    ''',
}


def write_environments(root: Path) -> Path:
    """Each of MODULES as root/<name>.py; returns root."""
    for name, source in MODULES.items():
        (root / f"{name}.py").write_text(textwrap.dedent(source))
    return root
