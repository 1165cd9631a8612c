"""`[task] type = "dataset"`: prompts and reference answers from a data file, scored by a named reward.

Files are read with the `datasets` library (jsonl/json, parquet, csv, arrow; by extension); a
`path` that is no local file is tried as a hub dataset name (needs the hub). Every row is checked
at start-up, so a missing column or a wrong type fails before any lease, naming the file, row and
field. Rows are held out for `decentrl eval` by `eval_path` or a seeded `eval_fraction`.

Built by decentrl/tasks/__init__.py `build_task`; `reward` is called by the orchestrator (and by `decentrl
eval`) and runs in the reward guard's child process (decentrl/tasks/guard.py).
"""

from __future__ import annotations

import functools
from pathlib import Path

from decentrl.config import AnswerConfig, DatasetTaskConfig
from decentrl.tasks.answers import extract_answer, format_credit
from decentrl.tasks.base import Prompt
from decentrl.tasks.guard import RewardGuard
from decentrl.tasks.rewards import reward_function
from decentrl.tasks.sources import Part, held_out

BUILDERS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv", ".arrow": "arrow"}
ROLES = ("system", "user", "assistant")


class DatasetError(ValueError):
    """A data file that cannot be used; the message names the file, the row and the field."""


def load_rows(path: str, columns: list[str], max_rows: int) -> list[dict]:
    """The rows of `path` (only `columns`), with an error naming the file and a missing column."""
    from datasets import load_dataset

    file = Path(path)
    if file.is_file():
        builder = BUILDERS.get(file.suffix.lower())
        if builder is None:
            raise DatasetError(f"{path}: unknown file type {file.suffix!r} (use one of {', '.join(BUILDERS)})")
        data = load_dataset(builder, data_files=str(file), split="train")
    elif file.suffix.lower() in BUILDERS:
        raise DatasetError(f"{path}: no such file")
    else:  # a hub dataset name: works where the hub is reachable
        data = load_dataset(path, split="train")
    missing = [name for name in columns if name not in data.column_names]
    if missing:
        raise DatasetError(f"{path}: no column {', '.join(map(repr, missing))} (columns: {', '.join(data.column_names)})")
    if len(data) > max_rows:
        raise DatasetError(f"{path}: {len(data)} rows, more than task.max_rows ({max_rows})")
    if len(data) == 0:
        raise DatasetError(f"{path}: no rows")
    return data.select_columns(columns).to_list()


def check_row(path: str, number: int, row: dict, config: DatasetTaskConfig) -> Prompt:
    """The row as a prompt, or an error naming file, row (counting from 1) and field."""
    where = f"{path}: row {number}"
    answer = row[config.answer_column]
    if isinstance(answer, bool) or not isinstance(answer, (str, int, float)):
        raise DatasetError(f"{where}: field {config.answer_column!r} must be a string or a number (got {type(answer).__name__})")
    if config.messages_column is None:
        text = row[config.prompt_column]
        if not isinstance(text, str) or not text:
            raise DatasetError(f"{where}: field {config.prompt_column!r} must be a non-empty string (got {text!r:.60})")
        return Prompt(prompt_id=number - 1, text=text)
    messages = row[config.messages_column]
    if not isinstance(messages, list) or not messages:
        raise DatasetError(f"{where}: field {config.messages_column!r} must be a non-empty list of messages")
    pairs = []
    for i, message in enumerate(messages):
        if not (isinstance(message, dict) and message.get("role") in ROLES and isinstance(message.get("content"), str)):
            raise DatasetError(
                f"{where}: field {config.messages_column!r}[{i}] must be {{role: one of {'/'.join(ROLES)}, content: string}}"
            )
        pairs.append((message["role"], message["content"]))
    return Prompt(prompt_id=number - 1, text="\n".join(content for _, content in pairs), messages=tuple(pairs))


def scorer(reward_name: str, answer_config: AnswerConfig):  # noqa: ANN201 - the guard's child calls it
    """score(completion, reference) for the guard's child, the reward function resolved once."""
    reward = reward_function(reward_name)

    def score(completion: str, reference: str) -> float:
        answer = extract_answer(completion, answer_config)
        return 0.0 if answer is None else reward(answer, reference)

    return score


class DatasetTask:
    def __init__(self, config: DatasetTaskConfig, part: Part = "train") -> None:
        self.config = config
        prompt_column = config.messages_column or config.prompt_column
        columns = [prompt_column, config.answer_column]
        rows = [
            (check_row(path, number, row, config), str(row[config.answer_column]))
            for path in self._paths(config, part)
            for number, row in enumerate(load_rows(path, columns, config.max_rows), start=1)
        ]
        if config.eval_path is None and config.eval_fraction > 0:
            held = held_out(len(rows), config.eval_fraction, config.seed)
            rows = [row for i, row in enumerate(rows) if (i in held) == (part == "eval")]
            if not rows:
                raise DatasetError(f"{config.path}: eval_fraction {config.eval_fraction} leaves no {part} rows")
        self._prompts = [Prompt(i, p.text, p.messages) for i, (p, _) in enumerate(rows)]
        self._answers = [answer for _, answer in rows]
        self.num_prompts = len(rows)
        self.part = part
        reward_function(config.reward)  # an unknown import fails here, at start-up
        self._guard = RewardGuard(
            functools.partial(scorer, config.reward, config.answer), timeout_s=config.reward_timeout_s,
            name=f"dataset {config.reward}",
        )

    @staticmethod
    def _paths(config: DatasetTaskConfig, part: Part) -> list[str]:
        return [config.eval_path] if part == "eval" and config.eval_path is not None else [config.path]

    def prompt(self, prompt_id: int) -> Prompt:
        return self._prompts[prompt_id]

    def answer(self, prompt_id: int) -> str:
        return self._answers[prompt_id]

    def reward(self, prompt: Prompt, completion_text: str) -> float:
        """Correctness, plus `answer.format_reward` for an answer found in the format (training only)."""
        return self.correctness(prompt, completion_text) + format_credit(completion_text, self.config.answer)

    def correctness(self, prompt: Prompt, completion_text: str) -> float:
        return self._guard(prompt.prompt_id, completion_text, self._answers[prompt.prompt_id])

    @property
    def reward_failures(self) -> dict[str, int]:
        return dict(self._guard.failures)

    def heldout_task(self) -> DatasetTask:
        if self.config.eval_path is None and self.config.eval_fraction == 0:
            raise ValueError("this dataset task holds nothing out: set task.eval_path or task.eval_fraction")
        return DatasetTask(self.config, part="eval")
