"""Propose and solve: a task of two roles the tiny digit tokenizer can express (issue 48).

A unit of this task is a proposer node and the solver node derived from its sample
(docs/architecture.md, "The unit of work, widened"). The proposer's prompt is "=" and a reference
problem from a seeded pool ("=314": "write a problem like 314"); it writes digits ("90271").
`propose` validates them - they are model output, so anything may come: only ASCII digits,
between `min_digits` and `max_digits` of them - and the solvers' prompt is the problem and "="
("90271="), the form the sorting task uses. With `proposal = "size"` the proposal's length names
the problem's size and its digits are drawn here, seeded by the unit's prompt and the proposal's
text: the proposer chooses how hard, never the digits themselves, so it cannot make a problem easy
by writing it already in order, nor repeat one text into one problem its solvers memorise. With
`proposal = "tally"` the size is `min_digits` plus the 9s the text holds (digits of any length):
an untrained proposer writing digits at random proposes short problems, so a run starts easy with
room above. The answer is computed here, exactly: the digits
ascending (`operation = "sort"`) or their sum (`"sum"`). Difficulty is measured in digits and
operations (the adjacent swaps that sort the digits, or the additions that sum them).

Rewards: a solver's is the share of its answer's characters right in place (`solver_reward =
"positions"`, the sorting task's partial credit; `"permutation"`: the same, but 0 unless the answer
is a permutation of the problem's digits; `"kept"`: the same times the share of the problem's digits
the answer keeps), or 1 for the exact answer (`"exact"`). A proposer's, at ingest, is whether its
proposal is valid (1 or 0); once its solvers are in, the reward stage replaces it with
`proposer_reward`: `invalid_reward` for an invalid proposal, else its learnability from the
solvers' results (`passed`: their rewards, or exact answers with `pass_rate = "exact"`;
decentrl/rl/advantages.py `learnability`).
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass

from decentrl.config import ProposeTaskConfig
from decentrl.rl.advantages import learnability
from decentrl.tasks.base import Prompt
from decentrl.tasks.sorting import sort_credit

ROLES = ("proposer", "solver")
TALLY_MAX_CHARS = 1024  # `proposal = "tally"`: the longest text read (its length is checked before the pattern)
_DIGITS = re.compile(r"[0-9]+", re.ASCII)


@dataclass(frozen=True)
class Proposal:
    """A valid problem: its digits, as the proposer wrote them."""

    digits: str
    written: str | None = None  # `proposal = "size"` or "tally": the text the proposer wrote (None: the digits are it)

    @property
    def canonical(self) -> str:
        """The proposal's form for R-Zero's repetition penalty and the distinct-proposal count:
        what the proposer wrote (proposals of one form are one cluster), not the digits drawn from it."""
        return self.digits if self.written is None else self.written


@dataclass(frozen=True)
class Difficulty:
    digits: int
    operations: int


class ProposeTask:
    """Implements the `Task` protocol (one prompt pool: the proposer's) plus the roles contract:
    `role_of`, `propose`, `solver_prompt`, `answer`, `difficulty` and `proposer_reward`."""

    kind = "digits"
    roles = ROLES

    def __init__(self, config: ProposeTaskConfig) -> None:
        self.config = config
        self.num_prompts = config.num_prompts
        rng = random.Random(config.seed)
        self._references = ["".join(rng.choice("0123456789") for _ in range(config.reference_digits))
                            for _ in range(config.num_prompts)]

    def prompt(self, prompt_id: int) -> Prompt:
        """The proposer's prompt: "=" and a reference problem."""
        return Prompt(prompt_id=prompt_id, text="=" + self._references[prompt_id])

    @staticmethod
    def role_of(prompt: Prompt) -> str:
        """A proposer's prompt starts with "=", a solver's ends with it."""
        return "proposer" if prompt.text.startswith("=") else "solver"

    def propose(self, completion_text: str, prompt_id: int) -> Proposal | None:
        """The proposal a proposer's completion, sampled on prompt `prompt_id` (its unit's), makes, or
        None when it is not a valid problem: after surrounding whitespace, only ASCII digits,
        `min_digits` to `max_digits` of them (the length is checked before the pattern, so a long
        completion costs nothing). With `proposal = "size"` the digits are drawn, seeded by the
        task's seed, the unit's prompt and the text: a proposer repeating one text gets another
        problem on each prompt (one in `num_prompts` per length, a prompt coming back once a pass
        over the pool), never one problem whose answer its solvers can memorise; the same run's
        journal re-derives every unit's problem from its proposer sample (benchmarks/coevolve.py).
        With `proposal = "tally"` the text is digits of any length (up to TALLY_MAX_CHARS) and the
        size is `min_digits` plus its 9s, capped at `max_digits`: more 9s than the task allows ask
        for its largest problem, never an invalid one (no -1 cliff above the top size, which with
        `"size"` a proposal one digit too long meets); the digits are drawn as with "size"."""
        text = completion_text.strip()
        if self.config.proposal == "tally":  # min_digits plus the 9s written, at most max_digits; any length of digits
            if len(text) > TALLY_MAX_CHARS or not _DIGITS.fullmatch(text):
                return None
            size = min(self.config.max_digits, self.config.min_digits + text.count("9"))
        elif not self.config.min_digits <= len(text) <= self.config.max_digits or not _DIGITS.fullmatch(text):
            return None
        else:
            size = len(text)
        if self.config.proposal in ("size", "tally"):
            rng = random.Random(f"{self.config.seed}/{prompt_id}/{text}")
            return Proposal("".join(rng.choice("0123456789") for _ in range(size)), written=text)
        return Proposal(text)

    def solver_prompt(self, proposal: Proposal, prompt_id: int) -> Prompt:
        """The derived node's prompt, rendered by the orchestrator (never taken from a worker)."""
        return Prompt(prompt_id=prompt_id, text=proposal.digits + "=")

    def answer(self, proposal: Proposal) -> str:
        if self.config.operation == "sort":
            return "".join(sorted(proposal.digits))
        return str(sum(int(d) for d in proposal.digits))

    def difficulty(self, proposal: Proposal) -> Difficulty:
        digits = proposal.digits
        if self.config.operation == "sum":
            return Difficulty(len(digits), len(digits) - 1)
        inversions = sum(1 for i in range(len(digits)) for j in range(i + 1, len(digits)) if digits[i] > digits[j])
        return Difficulty(len(digits), inversions)

    def reward(self, prompt: Prompt, completion_text: str) -> float:
        """A solver's correctness (`solver_reward`); a proposer's validity (1 or 0) until its solvers are in."""
        if self.role_of(prompt) == "proposer":
            return float(self.propose(completion_text, prompt.prompt_id) is not None)
        answer, target = self._answer_and_target(prompt, completion_text)
        if self.config.solver_reward == "exact":
            return float(answer == target)
        return sort_credit(answer, target, self.config.solver_reward)  # the sorting task's partial credit

    def passed(self, prompt: Prompt, completion_text: str) -> float:
        """What the proposer's learnability reads of one solver's answer (`pass_rate`): 1 or 0 for
        the exact answer ("exact": p is the pass rate, as Absolute Zero and R-Zero define it), or
        the solver's reward ("reward", the default: partial credit included, so p is rarely 0 or 1
        and 1 - p pays most for the hardest problems)."""
        if self.config.pass_rate == "reward":
            return self.reward(prompt, completion_text)
        answer, target = self._answer_and_target(prompt, completion_text)
        return float(answer == target)

    def _answer_and_target(self, prompt: Prompt, completion_text: str) -> tuple[str, str]:
        problem = prompt.text.removesuffix("=")
        if not self.config.min_digits <= len(problem) <= self.config.max_digits or not _DIGITS.fullmatch(problem):
            # only the orchestrator renders solver prompts: it never makes one of these
            raise ValueError(f"not a solver prompt of this task: {prompt.text[:80]!r}")
        return "".join(completion_text.split()), self.answer(Proposal(problem))

    def proposer_reward(self, proposal: Proposal | None, solver_rewards: list[float]) -> float:
        """Validity first (`invalid_reward`), then learnability from the solvers' results (`passed` of each)."""
        if proposal is None:
            return self.config.invalid_reward
        return learnability(solver_rewards, self.config.learnability)
