"""Answer extraction (decentrl/tasks/answers.py) on completions the way a chat model writes them,
the optional format credit, and `decentrl eval` scoring correctness without it. The dataset and
reasoning-gym tasks run for real (rewards through the guard's child process); they are skipped,
with the reason, where the `tasks` extra is not installed."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from decentrl.config import AnswerConfig, ConfigError, TinyModelConfig, parse_config
from decentrl.tasks import build_task
from decentrl.tasks.answers import extract_answer, format_credit, last_boxed, last_number
from tests.conftest import MakeConfig

EXTRA = 'needs the tasks extra: pip install -e ".[tasks]"'
DOCS = Path(__file__).parents[2] / "docs" / "tasks.md"

# The sample completions of docs/tasks.md's "Answer formats" table, in its column order.
SAMPLES = [
    "7 + 5 = 12",
    "The answer is 1,234.",
    "Let's see.\nSo x = -3.5\n",
    "\\boxed{3}? No: \\boxed{\\frac{1}{2}}",
    "2 * 3 = 6, plus 4: <answer>10</answer>",
    "I don't know.",
]
EXPECTED = {  # format -> what it extracts from each sample (None: nothing found, scores 0)
    "raw": ["7 + 5 = 12", "The answer is 1,234.", "Let's see.\nSo x = -3.5", SAMPLES[3], SAMPLES[4], "I don't know."],
    "tag": [None, None, None, None, "10", None],
    "boxed": [None, None, None, "\\frac{1}{2}", None, None],
    "last_line": ["7 + 5 = 12", "The answer is 1,234.", "So x = -3.5", SAMPLES[3], SAMPLES[4], "I don't know."],
    "last_number": ["12", "1234", "-3.5", "2", "10", None],
}


@pytest.mark.parametrize("answer_format", list(EXPECTED))
def test_each_format_on_chat_model_completions(answer_format: str) -> None:
    config = AnswerConfig(format=answer_format)
    assert [extract_answer(text, config) for text in SAMPLES] == EXPECTED[answer_format]


def test_docs_table_shows_what_each_format_extracts() -> None:
    """docs/tasks.md's table is these extractions: a change to an extractor shows up there."""
    def cell(value: str | None) -> str:
        return "none" if value is None else "`" + value.replace("\n", "\\n") + "`"

    text = DOCS.read_text()
    for answer_format, values in EXPECTED.items():
        row = next(line for line in text.splitlines() if line.startswith(f"| `{answer_format}` |"))
        assert row.rstrip(" |").split(" | ")[2:] == [cell(v) for v in values], answer_format


@pytest.mark.parametrize(
    ("text", "number"),
    [
        ("So the total is $1,000,000.", "1000000"),  # thousands separators and a dollar sign
        ("She owes -$5", "-5"),
        ("x = -3", "-3"),  # a lone digit: the second alternative
        ("5-3", "-3"),  # a hyphen right before a digit reads as a minus, as in lm-eval
        ("0.5 of 3.25.", "3.25"),  # one trailing period dropped
        ("version 1.2.3", "1.2.3"),  # not a number, taken as lm-eval takes it
        ("It is 12. Hmm...", "12"),  # an ellipsis has no digit: skipped
        ("no digits at all, none.", None),
        ("", None),
    ],
)
def test_last_number_reads_numbers_as_lm_eval_flexible_extract(text: str, number: str | None) -> None:
    assert last_number(text) == number


@pytest.mark.parametrize(
    ("text", "content"),
    [
        ("\\boxed{\\frac{1}{2}}", "\\frac{1}{2}"),
        ("\\boxed{ \\{1, \\{2\\}\\} }", "\\{1, \\{2\\}\\}"),  # nested braces, stripped
        ("\\boxed{1} then \\boxed{2} then \\boxed{x^{3}}", "x^{3}"),  # the last of several
        ("\\boxed{1} and finally \\fbox{7}", "7"),
        ("\\fbox{7}, I mean \\boxed{8}", "8"),
        ("\\boxed{1} and \\boxed{unclosed", None),  # the last one is not closed
        ("boxed 5", None),
    ],
)
def test_last_boxed_balances_braces(text: str, content: str | None) -> None:
    assert last_boxed(text) == content


def test_format_credit_only_for_a_non_empty_answer_in_the_format() -> None:
    boxed = AnswerConfig(format="boxed", format_reward=0.1)
    assert format_credit("so \\boxed{5}", boxed) == 0.1
    assert format_credit("so 5", boxed) == 0.0
    assert format_credit("so \\boxed{ }", boxed) == 0.0  # an empty box earns nothing
    assert format_credit("so \\boxed{5}", AnswerConfig(format="boxed")) == 0.0  # off by default
    tag = AnswerConfig(format="tag", tag="final", format_reward=0.25)
    assert format_credit("<final>x</final>", tag) == 0.25 and format_credit("<answer>x</answer>", tag) == 0.0


@pytest.mark.parametrize(
    ("answer", "message"),
    [
        ({"format": "boxed", "format_reward": -0.1}, r"task\.answer\.format_reward: Input should be greater than or equal to 0"),
        ({"format": "boxed", "format_reward": 1.5}, r"task\.answer\.format_reward: Input should be less than or equal to 1"),
        ({"format": "raw", "format_reward": 0.1}, r"format_reward needs a format a completion can miss.*'raw'"),
        ({"format": "last_line", "format_reward": 0.1}, r"format_reward needs a format a completion can miss.*'last_line'"),
        ({"format": "last_digit"}, r"task\.answer\.format: Input should be 'raw', 'tag', 'boxed', 'last_line' or 'last_number'"),
    ],
)
def test_bad_answer_config_names_the_key(answer: dict[str, Any], message: str) -> None:
    task = {"type": "reasoning_gym", "datasets": [{"name": "basic_arithmetic"}], "answer": answer}
    with pytest.raises(ConfigError, match=message):
        parse_config({"task": task})


# -- real tasks, end to end through their reward -------------------------------------------------


def test_reasoning_gym_arithmetic_scored_by_the_last_number() -> None:
    """basic_arithmetic, answered as a chat model answers: its own score_answer on the last number."""
    pytest.importorskip("reasoning_gym", reason=EXTRA)
    answer = {"format": "last_number", "format_reward": 0.1}
    task_config = {"type": "reasoning_gym", "datasets": [{"name": "basic_arithmetic"}], "size": 8, "seed": 1, "answer": answer}
    task = build_task(parse_config({"task": task_config}).task)
    for i in range(4):
        prompt, right = task.prompt(i), task.answer(i)
        expression = prompt.text.removeprefix("Calculate ").rstrip(".")
        worked = f"Let's compute it step by step.\n{expression} = {right}."
        assert task.correctness(prompt, worked) == 1.0
        assert task.reward(prompt, worked) == pytest.approx(1.1)
        wrong = f"{expression} = {int(right) + 1000}"
        partial = task.correctness(prompt, wrong)  # score_answer's partial credit for a near string
        assert partial < 1.0 and task.reward(prompt, wrong) == pytest.approx(partial + 0.1)
        assert task.reward(prompt, "I cannot do that.") == 0.0  # no number: no answer, no credit


def write_rows(path: Path, rows: list[dict[str, Any]]) -> str:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)


def test_dataset_task_boxed_math_with_format_credit(tmp_path: Path) -> None:
    pytest.importorskip("datasets", reason=EXTRA)
    pytest.importorskip("math_verify", reason=EXTRA)
    rows = [{"question": "What is 1/2 + 1/4?", "answer": "3/4"}, {"question": "What is 2 * 21?", "answer": 42}]
    answer = {"format": "boxed", "format_reward": 0.2}
    task = build_task(parse_config({"task": {
        "type": "dataset", "path": write_rows(tmp_path / "d.jsonl", rows), "prompt_column": "question",
        "reward": "math", "answer": answer,
    }}).task)
    first, second = task.prompt(0), task.prompt(1)
    assert task.reward(first, "1/2 = 2/4, plus 1/4 is \\boxed{\\frac{3}{4}}") == pytest.approx(1.2)
    assert task.correctness(first, "1/2 = 2/4, plus 1/4 is \\boxed{\\frac{3}{4}}") == 1.0
    assert task.reward(first, "It is \\boxed{0.75}.") == pytest.approx(1.2)  # math-verify: 0.75 = 3/4
    assert task.reward(second, "2 * 21 = \\boxed{41}") == pytest.approx(0.2)  # formatted, wrong
    assert task.reward(second, "2 * 21 = 42") == 0.0  # right, but not boxed
    plain = build_task(parse_config({"task": {
        "type": "dataset", "path": str(tmp_path / "d.jsonl"), "prompt_column": "question", "reward": "exact",
        "answer": {"format": "last_number"},
    }}).task)
    assert plain.reward(plain.prompt(1), "2 * 21 = 42.") == 1.0  # no format_reward: correctness alone


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A random tiny model as the trainer publishes it: its completions are digits (and '=')."""
    from decentrl.model.build import build_model, build_tiny_tokenizer
    from decentrl.store.weights import write_hf_dir

    directory = str(tmp_path_factory.mktemp("v1"))
    model = build_model(TinyModelConfig(hidden_size=32, num_layers=2, num_heads=2, intermediate_size=64, seed=5))
    build_tiny_tokenizer().save_pretrained(directory)
    model.generation_config.save_pretrained(directory)
    write_hf_dir(directory, model.state_dict(), model.config, extras_from=directory)
    return directory


def test_eval_scores_correctness_without_format_credit(
    tmp_path: Path, make_config: MakeConfig, checkpoint: str
) -> None:
    """Every answer found is "correct" (the reference is the pattern '.*') and earns as much again
    in format credit: a training reward is 0 or 2. Eval's figure must be 0 or 1 per sample."""
    pytest.importorskip("datasets", reason=EXTRA)
    from workers.evaluate import evaluate

    rows = [{"question": f"{i:04d}=", "answer": ".*"} for i in range(8)]
    task_config = parse_config({"task": {
        "type": "dataset", "path": write_rows(tmp_path / "d.jsonl", rows), "prompt_column": "question",
        "reward": "regex", "answer": {"format": "last_number", "format_reward": 1.0},
    }}).task
    config = make_config(sampling={"temperature": 1.0, "max_tokens": 8}).model_copy(update={"task": task_config})
    task = build_task(task_config)
    assert task.reward(task.prompt(0), "12") == 2.0  # what training would give a found answer
    result = evaluate(config, checkpoint, 1, prompts=8, samples_per_prompt=4, split="train", seed=3)
    assert result.reward_mean > 0  # answers were found ...
    assert result.reward_mean == pytest.approx(result.solved_fraction)  # ... and scored 1, not 2
