"""The `dataset` and `reasoning_gym` task sources and their rewards: real files read with the
`datasets` library, real reasoning-gym generators, rewards through the guard's child process.
Skipped, with the reason, where the `tasks` extra is not installed."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from decentrl.config import AnswerConfig, parse_config
from decentrl.tasks import build_task
from decentrl.tasks.answers import extract_answer

EXTRA = 'needs the tasks extra: pip install -e ".[tasks]"'
datasets = pytest.importorskip("datasets", reason=EXTRA)
pytest.importorskip("reasoning_gym", reason=EXTRA)
pytest.importorskip("math_verify", reason=EXTRA)

ROWS = [
    {"question": "What is 1/2 + 1/4?", "answer": "3/4"},
    {"question": "What is 2 * 21?", "answer": 42},
    {"question": "Name a prime.", "answer": "7"},
    {"question": "Spell cat.", "answer": "c-a-t"},
]


def write_jsonl(path: Path, rows: list[dict[str, Any]]) -> str:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)


def dataset_task(path: str, **fields: Any):  # noqa: ANN201 - a DatasetTask
    task = {"type": "dataset", "path": path, "prompt_column": "question", **fields}
    return build_task(parse_config({"task": task}).task)


@pytest.mark.parametrize("suffix", [".jsonl", ".parquet", ".csv", ".arrow"])
def test_every_file_type_gives_the_same_prompts(tmp_path: Path, suffix: str) -> None:
    rows = [{"question": r["question"], "answer": str(r["answer"])} for r in ROWS]
    table = datasets.Dataset.from_list(rows)
    path = tmp_path / f"data{suffix}"
    if suffix == ".jsonl":
        write_jsonl(path, rows)
    elif suffix == ".parquet":
        table.to_parquet(str(path))
    elif suffix == ".csv":
        table.to_csv(str(path), index=False)
    else:
        from datasets.arrow_writer import ArrowWriter

        with ArrowWriter(path=str(path)) as writer:
            for row in rows:
                writer.write(row)
            writer.finalize()
    task = dataset_task(str(path))
    assert [task.prompt(i).text for i in range(task.num_prompts)] == [r["question"] for r in ROWS]
    assert task.reward(task.prompt(1), " 42 ") == 1.0


def test_named_rewards_score_what_they_say(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "d.jsonl", ROWS)
    math_task = dataset_task(path, reward="math", answer={"format": "boxed"})
    assert math_task.reward(math_task.prompt(0), "so it is \\boxed{\\frac{3}{4}}") == 1.0
    assert math_task.reward(math_task.prompt(0), "so it is \\boxed{0.75}") == 1.0
    assert math_task.reward(math_task.prompt(0), "so it is \\boxed{0.7}") == 0.0
    assert math_task.reward(math_task.prompt(0), "0.75 but not boxed") == 0.0  # no answer found
    contains = dataset_task(path, reward="contains")
    assert contains.reward(contains.prompt(2), "I pick 7.") == 1.0
    assert contains.reward(contains.prompt(2), "I pick 5.") == 0.0
    regex = dataset_task(path, reward="regex", answer={"format": "tag", "tag": "answer"})
    assert regex.reward(regex.prompt(3), "<think>hm</think><answer>c-a-t</answer>") == 1.0
    assert regex.reward(regex.prompt(3), "<answer>cat</answer>") == 0.0  # "c-a-t" as a pattern
    exact = dataset_task(path, reward="exact", answer={"format": "last_line"})
    assert exact.reward(exact.prompt(1), "thinking...\n42") == 1.0


def test_an_importable_reward_function(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "my_rewards.py").write_text("def length_match(answer, reference):\n    return float(len(answer) == len(reference))\n")
    monkeypatch.syspath_prepend(str(tmp_path))  # a spawned child inherits sys.path
    task = dataset_task(write_jsonl(tmp_path / "d.jsonl", ROWS), reward="my_rewards:length_match")
    assert task.reward(task.prompt(0), "abc") == 1.0
    assert task.reward(task.prompt(0), "abcd") == 0.0
    with pytest.raises(ValueError, match="no 'missing'"):
        dataset_task(write_jsonl(tmp_path / "d.jsonl", ROWS), reward="my_rewards:missing")


def test_chat_messages_column(tmp_path: Path) -> None:
    rows = [{"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"}], "answer": "4"}]
    task = dataset_task(write_jsonl(tmp_path / "m.jsonl", rows), messages_column="messages")
    assert task.prompt(0).messages == (("system", "Be brief."), ("user", "2+2?"))


def test_held_out_split_by_fraction_and_by_file(tmp_path: Path) -> None:
    rows = [{"question": f"q{i}", "answer": str(i)} for i in range(20)]
    path = write_jsonl(tmp_path / "d.jsonl", rows)
    task = dataset_task(path, eval_fraction=0.25)
    held = task.heldout_task()
    train_texts = {task.prompt(i).text for i in range(task.num_prompts)}
    held_texts = {held.prompt(i).text for i in range(held.num_prompts)}
    assert (len(train_texts), len(held_texts)) == (15, 5) and not train_texts & held_texts
    assert held.reward(held.prompt(0), held.answer(0)) == 1.0  # answers follow their prompts
    other = write_jsonl(tmp_path / "eval.jsonl", [{"question": "held", "answer": "x"}])
    assert dataset_task(path, eval_path=other).heldout_task().prompt(0).text == "held"
    with pytest.raises(ValueError, match="holds nothing out"):
        dataset_task(path).heldout_task()


# -- bad input: each fails at start-up naming the file, the row and the field ---------------------


@pytest.mark.parametrize(
    ("rows", "fields", "message"),
    [
        ([{"question": "q", "solution": "1"}], {}, r"d\.jsonl: no column 'answer' \(columns: question, solution\)"),
        ([{"question": "q", "answer": "1"}, {"question": "r", "answer": [1, 2]}], {},
         r"d\.jsonl: row 2: field 'answer' must be a string or a number \(got list\)"),
        ([{"question": "q", "answer": "1"}, {"question": "", "answer": "2"}], {},
         r"d\.jsonl: row 2: field 'question' must be a non-empty string"),
        ([{"question": "q", "answer": True}], {}, r"row 1: field 'answer' must be a string or a number \(got bool\)"),
        ([{"msgs": [{"role": "robot", "content": "x"}], "answer": "1"}], {"messages_column": "msgs"},
         r"row 1: field 'msgs'\[0\] must be \{role: one of system/user/assistant"),
    ],
)
def test_bad_rows_name_file_row_and_field(tmp_path: Path, rows: list[dict[str, Any]], fields: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        dataset_task(write_jsonl(tmp_path / "d.jsonl", rows), **fields)


def test_bad_files_say_what_to_fix(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"nothere\.jsonl: no such file"):
        dataset_task(str(tmp_path / "nothere.jsonl"))
    (tmp_path / "d.txt").write_text("x")
    with pytest.raises(ValueError, match=r"unknown file type '\.txt'"):
        dataset_task(str(tmp_path / "d.txt"))
    with pytest.raises(ValueError, match="more than task.max_rows"):
        dataset_task(write_jsonl(tmp_path / "d.jsonl", ROWS), max_rows=2)
    with pytest.raises(Exception, match=r"task\.reward: String should match pattern"):
        dataset_task(write_jsonl(tmp_path / "d.jsonl", ROWS), reward="eval(1)")


# -- reasoning-gym -------------------------------------------------------------------------------


def rg_task(*specs: dict[str, Any], **fields: Any):  # noqa: ANN201 - a ReasoningGymTask
    return build_task(parse_config({"task": {"type": "reasoning_gym", "datasets": list(specs), **fields}}).task)


def test_reasoning_gym_prompts_and_its_own_scorer() -> None:
    task = rg_task({"name": "spell_backward", "options": {"min_word_len": 3, "max_word_len": 4}}, size=50, seed=3)
    prompt = task.prompt(0)
    word = prompt.text.rsplit(" ", 1)[-1]
    assert prompt.text.startswith("Spell this word backward") and task.answer(0) == word[::-1]
    assert task.reward(prompt, word[::-1]) == 1.0
    assert 0.0 < task.reward(prompt, word[::-1][:2]) < 1.0  # spell_backward's partial credit
    again = rg_task({"name": "spell_backward", "options": {"min_word_len": 3, "max_word_len": 4}}, size=50, seed=3)
    assert [again.prompt(i).text for i in range(50)] == [task.prompt(i).text for i in range(50)]  # seeded


def test_reasoning_gym_weighted_mix_and_answer_tag() -> None:
    task = rg_task({"name": "count_bits", "weight": 3}, {"name": "spell_backward"}, size=40, answer={"format": "tag"})
    kinds = {task.prompt(i).text.split(" ")[0] for i in range(40)}
    assert kinds == {"How", "Spell"}
    assert all(task.reward(task.prompt(i), f"<answer>{task.answer(i)}</answer>") == 1.0 for i in range(6))
    assert task.reward(task.prompt(0), task.answer(0)) == 0.0  # no tag: no answer


def test_reasoning_gym_bad_names_and_options() -> None:
    with pytest.raises(
        ValueError, match=r"task\.datasets\.0\.name: unknown reasoning-gym dataset 'spell_backwards' \(did you mean spell_backward"
    ):
        rg_task({"name": "spell_backwards"})
    with pytest.raises(ValueError, match="options rejected by reasoning-gym.*bogus"):
        rg_task({"name": "spell_backward", "options": {"bogus": 1}})


def test_answer_extraction_formats() -> None:
    assert extract_answer(" 42\n", AnswerConfig()) == "42"
    assert extract_answer("<answer>1</answer> <answer> 2 </answer>", AnswerConfig(format="tag")) == "2"
    assert extract_answer("\\boxed{\\frac{1}{2}} and \\boxed{x^{2}}", AnswerConfig(format="boxed")) == "x^{2}"
    assert extract_answer("\\boxed{unclosed", AnswerConfig(format="boxed")) is None
    assert extract_answer("a\n\nb\n", AnswerConfig(format="last_line")) == "b"


def test_control_bytes_are_no_whitespace_around_an_answer() -> None:
    """A policy learned to end its answer with \\x1d, which str.strip() removes: such an answer is
    not exactly right, only contained (reasoning-gym's partial credit)."""
    from decentrl.tasks.rewards import exact

    assert extract_answer("1\x1d", AnswerConfig()) == "1\x1d"
    assert extract_answer("1\x1d2", AnswerConfig(format="last_line")) == "1\x1d2"
    assert exact("1\x1d", "1") == 0.0 and exact(" 1 \n", "1") == 1.0
    task = build_task(parse_config({"task": {"type": "reasoning_gym", "datasets": [{"name": "gcd"}], "size": 2}}).task)
    answer = task.answer(0)
    assert task.reward(task.prompt(0), answer + "\n") == 1.0
    assert task.reward(task.prompt(0), answer + "\x1d") == pytest.approx(len(answer) / (len(answer) + 1))
