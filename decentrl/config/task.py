"""`[task]`: the prompts and the verifiable reward (decentrl/tasks/ builds a task from it).

The orchestrator leases the task's prompts and scores every rollout with it; workers build a
multi-turn task's environment from the copy the orchestrator announces (`RunInfo.episode_task`);
`decentrl eval` rebuilds it to hold prompts out. Built-in tasks (sorting, arithmetic, countdown,
guess), a user class (import), and sources from the ecosystem (reasoning_gym, dataset, verifiers;
optional extras, docs/tasks.md).
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from decentrl.config.base import Section, keyed_union


class SortingTaskConfig(Section):
    """Sort a list of digits ascending; reward is the fraction of positions right (see tasks/)."""

    type: Literal["sorting"] = "sorting"
    num_digits: int = Field(4, ge=2, le=16, description="Digits per prompt (the fewest, with max_digits).")
    max_digits: int | None = Field(
        None, ge=2, le=16, description="With it, each prompt's digits are drawn uniformly from num_digits to max_digits "
        "(seeded): a pool spanning difficulties. None: every prompt has num_digits."
    )
    num_prompts: int = Field(4096, ge=1, description="Size of the prompt pool (seeded).")
    seed: int = Field(0, ge=0, description="Seed of the prompt pool.")
    reward: Literal["positions", "permutation", "kept"] = Field(
        "positions", description="positions: the share of the answer's characters right in place; permutation: the "
        "same for an answer that is a permutation of the problem's digits, 0 for any other (no credit for an answer "
        "that drops or repeats digits, such as the commonest digit repeated); kept: positions times the share of the "
        "problem's digits the answer keeps (the commonest digit repeated earns about a tenth, a near miss still counts)."
    )

    @model_validator(mode="after")
    def _digit_range(self) -> SortingTaskConfig:
        if self.max_digits is not None and self.max_digits < self.num_digits:
            raise ValueError(
                f"task.max_digits ({self.max_digits}) is below task.num_digits ({self.num_digits}): raise max_digits"
            )
        return self


class ChainTaskConfig(Section):
    """Running sums of a list of digits, one step each ("7324=" -> "7=10=12=16="); every step
    checkable exactly (decentrl/tasks/chain.py): the task of the pivots benchmark (issue 47)."""

    type: Literal["chain"] = "chain"
    num_digits: int = Field(4, ge=2, le=16, description="Digits per prompt (steps per right answer).")
    num_prompts: int = Field(4096, ge=1, description="Size of the prompt pool (seeded).")
    seed: int = Field(0, ge=0, description="Seed of the prompt pool.")


class ArithmeticTaskConfig(Section):
    """Evaluate an integer expression ("12+7*3="); reward 1 for the exact value (see tasks/arithmetic.py)."""

    type: Literal["arithmetic"] = "arithmetic"
    path: str = Field(
        "arithmetic.jsonl", description="JSONL of {\"question\": ...}; a bare name is looked up in decentrl/tasks/data/."
    )
    seed: int = Field(0, ge=0, description="Seed of the prompt order.")


class CountdownTaskConfig(Section):
    """Reach a target with given numbers and + - * /; reward 1 for an exact solution (see tasks/countdown.py)."""

    type: Literal["countdown"] = "countdown"
    path: str = Field(
        "countdown.jsonl", description="JSONL of {\"numbers\": [...], \"target\": n}; bare names: decentrl/tasks/data/."
    )
    seed: int = Field(0, ge=0, description="Seed of the prompt order.")


class ImportTaskConfig(Section):
    """A user task: a class implementing decentrl.tasks.Task, constructed as Class(**options)."""

    type: Literal["import"] = "import"
    target: str = Field(pattern=r"^[\w.]+:\w+$", description="Import path 'package.module:Class'.")
    options: dict[str, object] = Field(default_factory=dict, description="Keyword arguments of the constructor.")
    seed: int = Field(0, ge=0, description="Seed of the prompt order.")


class GuessTaskConfig(Section):
    """Multi-turn: guess a secret number; after each guess the environment says higher or lower
    (see tasks/guess.py). Reward 1 - (guesses - 1) / max_turns once found, else 0."""

    type: Literal["guess"] = "guess"
    max_number: int = Field(99, ge=1, le=10**6, description="Secrets are drawn from 0..max_number.")
    max_turns: int = Field(8, ge=1, le=64, description="Guesses per episode at most.")
    num_prompts: int = Field(4096, ge=1, description="Size of the prompt pool (one secret each, seeded).")
    seed: int = Field(0, ge=0, description="Seed of the secrets and of the prompt order.")


class ProposeTaskConfig(Section):
    """Two roles, one episode (decentrl/tasks/propose.py, docs/tasks.md "Episodes of roles"): a
    proposer writes a digit problem, the task validates it and computes its answer exactly, and
    solvers answer it. The solver's reward is correctness; the proposer's is its learnability from
    the solvers' results, after a validity check."""

    type: Literal["propose"] = "propose"
    operation: Literal["sort", "sum"] = Field(
        "sort", description="What a solver does with the proposed digits: sort (write them ascending; operations = "
        "the adjacent swaps that sort them) or sum (write their sum; operations = digits - 1 additions)."
    )
    solver_reward: Literal["exact", "positions", "permutation", "kept"] = Field(
        "positions", description="A solver's reward: exact (1 for the exact answer, else 0), positions (the share of "
        "the answer's characters right in place, the sorting task's partial credit: a signal a model learning from "
        "scratch can climb) or permutation (operation sort only: positions for an answer that is a permutation of the "
        "problem's digits, 0 for any other, so the commonest digit repeated earns nothing) or kept (operation sort "
        "only: positions times the share of the problem's digits the answer keeps); the proposer's "
        "learnability reads pass_rate."
    )
    pass_rate: Literal["reward", "exact"] = Field(
        "reward", description="The p the proposer's learnability reads: reward (its solvers' mean reward, partial credit "
        "included: then p is rarely 0 or 1, and 1 - p pays most for the hardest problems they score anything on) or exact "
        "(the share of its solvers with the exact answer: the pass rate Absolute Zero and R-Zero define)."
    )
    proposal: Literal["problem", "size", "tally"] = Field(
        "problem", description="What a proposal is: problem (its digits are the problem, as written) or size (its length "
        "names the problem's size, min_digits to max_digits, and the task draws the digits, seeded by the unit's prompt "
        "and the proposal's text: the proposer chooses how hard, never which digits, so it cannot make problems easy by "
        "writing them already in order, nor repeat one text into one problem) or tally (as size, but the size is "
        "min_digits plus the 9s the text holds, capped at max_digits: a proposer writing digits at random, as an "
        "untrained one does, proposes short problems, and writes more 9s for longer ones)."
    )
    min_digits: int = Field(2, ge=1, le=64, description="Fewest digits of a valid proposal.")
    max_digits: int = Field(12, ge=1, le=64, description="Most digits of a valid proposal.")
    reference_digits: int = Field(
        3, ge=1, le=64, description="Digits of the reference problem each proposer prompt shows (its seeded pool)."
    )
    num_prompts: int = Field(4096, ge=1, le=10**6, description="Size of the proposer prompt pool (seeded).")
    seed: int = Field(0, ge=0, description="Seed of the proposer prompt pool.")
    learnability: Literal["absolute_zero", "r_zero"] = Field(
        "absolute_zero", description="The proposer's reward from its solvers' mean reward p: absolute_zero = "
        "1 - p inside (0, 1), else 0; r_zero = 1 - 2|p - 1/2| (decentrl/rl/advantages.py `learnability`)."
    )
    repetition_penalty: float = Field(
        0.0, ge=0.0, le=1.0, description="R-Zero's repetition penalty weight: a valid proposal's reward loses weight x "
        "(the share of the last repetition_window proposals, itself included, of its canonical form), floored at 0. 0: none."
    )
    # R-Zero's batch: here the most recent units completed, held in memory (a restart starts it empty).
    repetition_window: int = Field(64, ge=1, le=100_000, description="Proposals the repetition penalty compares with.")
    invalid_reward: float = Field(
        -1.0, ge=-1.0, le=0.0, description="The proposer's reward for an invalid proposal (Absolute Zero's format "
        "penalty, -1); at most 0, the least a valid proposal earns."
    )

    @model_validator(mode="after")
    def _digit_range(self) -> ProposeTaskConfig:
        if self.min_digits > self.max_digits:
            raise ValueError(
                f"task.min_digits ({self.min_digits}) exceeds task.max_digits ({self.max_digits}): lower min_digits"
            )
        if self.solver_reward in ("permutation", "kept") and self.operation != "sort":
            raise ValueError(
                f"task.solver_reward = {self.solver_reward!r} needs task.operation = 'sort' (not {self.operation!r}): "
                "a sum's answer is no permutation of the digits; use positions or exact"
            )
        return self


class AnswerConfig(Section):
    """Where the answer sits in a completion, before the reward compares it, and an optional credit
    for writing it in that format (decentrl/tasks/answers.py; docs/tasks.md, "Answer formats")."""

    format: Literal["raw", "tag", "boxed", "last_line", "last_number"] = Field(
        "raw",
        description="raw: the whole completion (stripped); tag: the text inside the last <TAG>...</TAG>; "
        "boxed: the last \\boxed{...} or \\fbox{...}, braces balanced; last_line: the last non-empty line; "
        "last_number: the last number (lm-eval-harness GSM8K 'flexible-extract'). No answer found scores 0.",
    )
    tag: str = Field("answer", pattern=r"^[A-Za-z_][\w-]{0,31}$", description="The tag name for format = 'tag'.")
    format_reward: float = Field(
        0.0, ge=0, le=1,
        description="Added to the training reward when a non-empty answer is found in `format` (0: none). "
        "Correctness stays its own figure: `decentrl eval` never includes it.",
    )

    @model_validator(mode="after")
    def _format_reward_needs_a_marker(self) -> AnswerConfig:
        if self.format_reward > 0 and self.format in ("raw", "last_line"):
            raise ValueError(
                f"task.answer.format_reward needs a format a completion can miss (tag, boxed, last_number): "
                f"format {self.format!r} finds an answer in any non-blank completion"
            )
        return self


class ReasoningGymDatasetSpec(Section):
    """One reasoning-gym dataset of a weighted mix."""

    name: str = Field(min_length=1, description="A reasoning-gym dataset name (e.g. 'spell_backward').")
    weight: float = Field(1.0, gt=0, description="Relative share of prompts drawn from it.")
    options: dict[str, object] = Field(
        default_factory=dict, description="Its generator's config fields (e.g. {max_word_len = 4})."
    )


class ReasoningGymTaskConfig(Section):
    """Prompts from reasoning-gym procedural generators, scored by each dataset's own `score_answer`
    (decentrl/tasks/reasoning_gym.py; needs the `tasks` extra)."""

    type: Literal["reasoning_gym"] = "reasoning_gym"
    datasets: list[ReasoningGymDatasetSpec] = Field(
        min_length=1, max_length=64, description="One dataset, or a weighted mix of several."
    )
    size: int = Field(10000, ge=1, le=10_000_000, description="Prompts generated (seeded).")
    seed: int = Field(0, ge=0, description="Seed of the generators and of the prompt order; eval reseeds it.")
    answer: AnswerConfig = Field(default_factory=AnswerConfig, description="Answer extraction before scoring.")
    reward_timeout_s: float = Field(
        5.0, gt=0, le=600, description="A reward call running longer is stopped and scores 0 (counted, logged)."
    )


class DatasetTaskConfig(Section):
    """Prompts and answers from a local file (jsonl, json, parquet, csv, arrow) read with the `datasets`
    library, scored by a named reward (decentrl/tasks/dataset.py; needs the `tasks` extra)."""

    type: Literal["dataset"] = "dataset"
    path: str = Field(min_length=1, description="The data file (by extension: .jsonl/.json, .parquet, .csv, .arrow).")
    prompt_column: str = Field("prompt", min_length=1, description="Column of the prompt text (a string).")
    messages_column: str | None = Field(
        None, description="Column of chat messages ([{role, content}, ...]); when set, used instead of prompt_column."
    )
    answer_column: str = Field("answer", min_length=1, description="Column of the reference answer (string or number).")
    reward: str = Field(
        "exact",
        pattern=r"^(math|exact|regex|contains|[\w.]+:\w+)$",
        description="math (math-verify), exact, regex (the answer is a pattern the extracted answer must fully "
        "match), contains, or 'package.module:function' called as function(completion, answer) -> float in [0, 1].",
    )
    answer: AnswerConfig = Field(default_factory=AnswerConfig, description="Answer extraction before scoring.")
    eval_path: str | None = Field(None, description="A held-out file for `decentrl eval` (same columns).")
    eval_fraction: float = Field(
        0.0, ge=0, lt=1, description="Without eval_path: this share of rows (seeded) is held out of training for eval."
    )
    max_rows: int = Field(1_000_000, ge=1, description="Files with more rows are refused (bounds memory).")
    seed: int = Field(0, ge=0, description="Seed of the held-out choice and of the prompt order.")
    reward_timeout_s: float = Field(
        5.0, gt=0, le=600, description="A reward call running longer is stopped and scores 0 (counted, logged)."
    )


class VerifiersTaskConfig(Section):
    """A verifiers environment (the `verifiers.v1` API): its taskset gives the prompts, its task's
    `@vf.reward` functions score them on the orchestrator (decentrl/tasks/verifiers_env.py; needs
    the `verifiers` extra). Single-turn unless the environment's `Env` converses: then multi-turn,
    through decentrl's episode interface (decentrl/tasks/episodes.py)."""

    type: Literal["verifiers"] = "verifiers"
    taskset: str = Field(
        pattern=r"^[\w./@-]+$",
        description="The taskset id, resolved by verifiers' own loader: an importable module or installed "
        "package exporting its Taskset subclass in __all__ (e.g. 'my_env', 'owner/my-env', 'pkg.module').",
    )
    env: str = Field(
        "", pattern=r"^[\w./@-]*$",
        description="An Env id; empty: the Env the taskset's package exports, else verifiers' SingleAgentEnv "
        "(single-turn). An Env other than SingleAgentEnv makes the task multi-turn.",
    )
    options: dict[str, object] = Field(
        default_factory=dict, description="The taskset's own config fields (its TasksetConfig), e.g. {task = {...}}."
    )
    size: int = Field(10000, ge=1, le=1_000_000, description="Tasks read from the taskset at most (it may be infinite).")
    eval_fraction: float = Field(
        0.0, ge=0, lt=1, description="This share of the tasks (seeded) is held out of training for `decentrl eval`."
    )
    seed: int = Field(0, ge=0, description="Seed of the held-out choice and of the prompt order.")
    reward_timeout_s: float = Field(
        5.0, gt=0, le=600, description="A reward call running longer is stopped and scores 0 (counted, logged)."
    )
    max_turns: int = Field(8, ge=1, le=256, description="Multi-turn: model turns per episode at most.")
    max_turn_tokens: int = Field(64, ge=1, le=32768, description="Multi-turn: tokens per model turn at most.")
    user_turn: str = Field(
        "{message}", max_length=1000,
        description="Multi-turn: how the environment's message is written into the transcript between model "
        "turns; '{message}' is replaced by it. For a ChatML template: "
        "'\\n<|im_start|>user\\n{message}<|im_end|>\\n<|im_start|>assistant\\n'.",
    )

    @model_validator(mode="after")
    def _user_turn_has_message(self) -> VerifiersTaskConfig:
        if "{message}" not in self.user_turn:
            raise ValueError("task.user_turn must contain '{message}' (where the environment's message goes)")
        return self


TaskConfig = keyed_union(
    SortingTaskConfig, ArithmeticTaskConfig, ChainTaskConfig, CountdownTaskConfig, GuessTaskConfig, ImportTaskConfig, ProposeTaskConfig,
    ReasoningGymTaskConfig, DatasetTaskConfig, VerifiersTaskConfig,
)
