"""Unit tests for the tiny tokenizer and the sorting task's prompts and verifier."""

from __future__ import annotations

import collections
import random

import pytest
from pydantic import ValidationError
from transformers import PreTrainedTokenizerBase

from decentrl.config import SortingTaskConfig
from decentrl.model.build import TINY_SPECIALS, TINY_SYMBOLS
from decentrl.tasks import Prompt, build_task
from decentrl.tasks.sorting import SortingTask


@pytest.fixture
def task() -> SortingTask:
    return SortingTask(SortingTaskConfig(num_digits=4, num_prompts=256, seed=0))


def test_tiny_tokenizer_vocabulary(tokenizer: PreTrainedTokenizerBase) -> None:
    assert len(tokenizer) == len(TINY_SPECIALS) + len(TINY_SYMBOLS) == 14
    assert (tokenizer.pad_token_id, tokenizer.bos_token_id, tokenizer.eos_token_id) == (0, 1, 2)


def test_tiny_tokenizer_encodes_prompt_with_bos(tokenizer: PreTrainedTokenizerBase) -> None:
    ids = tokenizer("3141=").input_ids
    digit = {d: tokenizer.convert_tokens_to_ids(d) for d in "0123456789="}
    assert ids == [tokenizer.bos_token_id, digit["3"], digit["1"], digit["4"], digit["1"], digit["="]]
    assert ids == [1, 7, 5, 8, 5, 3]


@pytest.mark.parametrize("text", ["0", "9", "0123456789", "3141=", "9876543210=", "000="])
def test_tiny_tokenizer_round_trips(tokenizer: PreTrainedTokenizerBase, text: str) -> None:
    ids = tokenizer(text).input_ids
    assert len(ids) == len(text) + 1  # one token per character, plus <s>
    assert tokenizer.decode(ids, skip_special_tokens=True) == text


def test_tiny_tokenizer_decode_drops_special_tokens(tokenizer: PreTrainedTokenizerBase) -> None:
    ids = tokenizer("1134", add_special_tokens=False).input_ids + [tokenizer.eos_token_id, tokenizer.pad_token_id]
    assert tokenizer.decode(ids, skip_special_tokens=True) == "1134"


@pytest.mark.parametrize(
    ("completion", "reward"),
    [
        ("1134", 1.0),  # perfect
        (" 11 34 ", 1.0),  # whitespace is ignored
        ("1143", 0.5),  # two positions right
        ("11", 0.5),  # short answer: missing positions are wrong
        ("113400", 4 / 6),  # extra characters cost as much as wrong ones
        ("1134=====", 4 / 9),
        ("4311", 0.0),
        ("", 0.0),
    ],
)
def test_sorting_reward(task: SortingTask, completion: str, reward: float) -> None:
    assert task.reward(Prompt(prompt_id=0, text="3141="), completion) == pytest.approx(reward)


def test_sorting_reward_of_the_sorted_digits_is_one_for_every_prompt(task: SortingTask) -> None:
    for prompt_id in range(task.num_prompts):
        prompt = task.prompt(prompt_id)
        assert task.reward(prompt, "".join(sorted(prompt.text[:-1]))) == 1.0


def test_prompts_are_deterministic_for_a_seed() -> None:
    config = SortingTaskConfig(num_digits=5, num_prompts=50, seed=7)
    first, second = build_task(config), build_task(config)
    texts = [first.prompt(i).text for i in range(50)]
    assert texts == [second.prompt(i).text for i in range(50)]
    assert all(len(t) == 6 and t.endswith("=") and t[:-1].isdigit() for t in texts)
    assert first.prompt(3) == Prompt(prompt_id=3, text=texts[3])
    other = build_task(SortingTaskConfig(num_digits=5, num_prompts=50, seed=8))
    assert texts != [other.prompt(i).text for i in range(50)]


@pytest.mark.parametrize(("seed", "num_digits", "num_prompts"), [(0, 4, 3000), (7, 2, 37), (12345, 16, 200), (3, 13, 777)])
def test_prompts_are_the_digits_random_choice_draws(seed: int, num_digits: int, num_prompts: int) -> None:
    # The prompts' definition (and that of every journal and run before the fast path): one
    # `rng.choice` per digit. The task draws them in bulk; a prompt id must keep its text.
    rng = random.Random(seed)
    expected = ["".join(rng.choice("0123456789") for _ in range(num_digits)) + "=" for _ in range(num_prompts)]
    task = SortingTask(SortingTaskConfig(num_digits=num_digits, num_prompts=num_prompts, seed=seed))
    assert [task.prompt(i).text for i in range(num_prompts)] == expected


def test_a_pool_spanning_digit_counts() -> None:
    # max_digits: each prompt's length uniform in [num_digits, max_digits], seeded; every length appears.
    task = SortingTask(SortingTaskConfig(num_digits=2, max_digits=8, num_prompts=700, seed=3))
    texts = [task.prompt(i).text for i in range(700)]
    assert texts == [SortingTask(SortingTaskConfig(num_digits=2, max_digits=8, num_prompts=700, seed=3)).prompt(i).text for i in range(700)]
    lengths = collections.Counter(len(t) - 1 for t in texts)
    assert set(lengths) == set(range(2, 9)) and min(lengths.values()) > 60, lengths
    assert all(t.endswith("=") and t[:-1].isdigit() for t in texts)
    assert task.reward(task.prompt(5), "".join(sorted(texts[5][:-1]))) == 1.0
    with pytest.raises(ValidationError, match="max_digits .3. is below task.num_digits .4.: raise max_digits"):
        SortingTaskConfig(num_digits=4, max_digits=3)
    with pytest.raises(ValidationError, match="max_digits"):
        SortingTaskConfig(num_digits=4, max_digits=17)


@pytest.mark.parametrize(
    ("answer", "positions", "permutation", "kept"),
    [
        ("1123459", 1.0, 1.0, 1.0),  # sorted: 1 under every rule
        ("3141592", 1 / 7, 1 / 7, 1 / 7),  # the problem copied: a permutation, its digits right in place
        ("1111111", 2 / 7, 0.0, 2 / 7 * 2 / 7),  # the commonest digit repeated: sorts nothing, keeps two of the digits
        ("1123495", 5 / 7, 5 / 7, 5 / 7),  # a permutation half sorted
        ("112345", 6 / 7, 0.0, 6 / 7 * 6 / 7),  # a digit dropped
        ("11234599", 7 / 8, 0.0, 7 / 8 * 7 / 8),  # a digit added
        ("1123458", 6 / 7, 0.0, 6 / 7 * 6 / 7),  # a digit changed
        ("1123459=", 7 / 8, 0.0, 7 / 8 * 7 / 8), ("", 0.0, 0.0, 0.0),
    ],
)
def test_the_permutation_reward_pays_only_answers_that_keep_every_digit(
    answer: str, positions: float, permutation: float, kept: float
) -> None:
    prompt = Prompt(prompt_id=0, text="3141592=")
    for rule, expected in (("positions", positions), ("permutation", permutation), ("kept", kept)):
        task = SortingTask(SortingTaskConfig(num_digits=7, num_prompts=1, reward=rule))  # type: ignore[arg-type]
        assert task.reward(prompt, answer) == pytest.approx(expected), (rule, answer)


def test_the_kept_reward_pays_a_copy_more_than_the_commonest_digit() -> None:
    # Over a 2-8 digit pool: positions pays the one-digit shortcut more than a copy of the problem
    # (0.3+ against about 0.2); kept turns that round, and still pays the shortcut something.
    config = dict(num_digits=2, max_digits=8, num_prompts=2000, seed=1)
    positions, kept = SortingTask(SortingTaskConfig(**config)), SortingTask(SortingTaskConfig(**config, reward="kept"))
    prompts = [positions.prompt(i) for i in range(2000)]
    commonest = [max(sorted(set(p.text[:-1])), key=p.text.count) * (len(p.text) - 1) for p in prompts]

    def mean(task: SortingTask, answers: list[str]) -> float:
        return sum(task.reward(p, a) for p, a in zip(prompts, answers)) / len(prompts)

    copies = [p.text[:-1] for p in prompts]
    assert mean(positions, commonest) > mean(positions, copies)
    assert 0 < mean(kept, commonest) < mean(kept, copies) == mean(positions, copies)


def test_the_commonest_digit_shortcut_earns_nothing_under_the_permutation_reward() -> None:
    # The shortcut the co-evolution solvers learned (docs/benchmarks.md, "Why no arm wins here"):
    # under positions it pays about a third over a 2-8 digit pool; under permutation only on the
    # problems whose digits are all one digit (where it is the sorted answer).
    config = dict(num_digits=2, max_digits=8, num_prompts=2000, seed=1)
    positions, permutation = SortingTask(SortingTaskConfig(**config)), SortingTask(SortingTaskConfig(**config, reward="permutation"))
    prompts = [positions.prompt(i) for i in range(2000)]
    commonest = [max(sorted(set(p.text[:-1])), key=p.text.count) * (len(p.text) - 1) for p in prompts]
    assert sum(positions.reward(p, a) for p, a in zip(prompts, commonest)) / 2000 > 0.3
    one_digit = [len(set(p.text[:-1])) == 1 for p in prompts]
    assert [permutation.reward(p, a) for p, a in zip(prompts, commonest)] == [float(x) for x in one_digit]
    assert sum(one_digit) < 40
    copies = [permutation.reward(p, p.text[:-1]) for p in prompts]
    assert copies == [positions.reward(p, p.text[:-1]) for p in prompts], "a copy is a permutation: it keeps its place credit"
    with pytest.raises(ValidationError, match="reward"):
        SortingTaskConfig(reward="perm")  # type: ignore[arg-type]
    with pytest.raises(ValidationError, match="reward"):
        SortingTaskConfig(reward=1)  # type: ignore[arg-type]


def test_random_policy_scores_low(task: SortingTask, tokenizer: PreTrainedTokenizerBase) -> None:
    # Uniform sampling over the whole vocabulary, stopping at </s> or after 6 tokens, as a
    # freshly initialized model roughly does: the reward must leave room to learn.
    rng = random.Random(0)
    vocab, eos = len(tokenizer), tokenizer.eos_token_id
    rewards = []
    for i in range(2000):
        ids: list[int] = []
        while len(ids) < 6 and (not ids or ids[-1] != eos):
            ids.append(rng.randrange(vocab))
        text = tokenizer.decode(ids, skip_special_tokens=True)
        rewards.append(task.reward(task.prompt(i % task.num_prompts), text))
    mean = sum(rewards) / len(rewards)
    assert 0.0 < mean < 0.2
    assert all(0.0 <= r <= 1.0 for r in rewards)


# -- arithmetic, countdown, user tasks ----------------------------------------------------

from decentrl.config import ArithmeticTaskConfig, CountdownTaskConfig, ImportTaskConfig, parse_config  # noqa: E402
from decentrl.tasks.arithmetic import evaluate  # noqa: E402
from decentrl.tasks.countdown import score  # noqa: E402


def test_arithmetic_verifier_is_exact() -> None:
    task = build_task(ArithmeticTaskConfig())
    assert task.num_prompts == 512
    for prompt_id in range(task.num_prompts):
        prompt = task.prompt(prompt_id)
        right = evaluate(prompt.text[:-1])
        assert task.reward(prompt, f" {right}") == 1.0
        assert task.reward(prompt, str(right + 1)) == 0.0
    assert evaluate("2+3*4") == 14 and evaluate("(2+3)*4") == 20 and evaluate("-5-5") == -10
    with pytest.raises(ValueError, match="not an integer expression"):
        evaluate("__import__('os')")


@pytest.mark.parametrize(
    ("completion", "reward"),
    [("50+25", 1.0), ("(3*25)", 1.0), ("25*3 = 75", 1.0), ("75", 0.0), ("25+25+25", 0.0), ("50/0", 0.0), ("x", 0.0),
     ("(50-25)*3", 1.0), ("(50*3)/2", 0.0), ("50+26-1", 0.0)],
)
def test_countdown_verifier(completion: str, reward: float) -> None:
    assert score([3, 7, 25, 50], 75, completion) == reward


def test_countdown_prompts_have_the_numbers_and_target() -> None:
    task = build_task(CountdownTaskConfig())
    assert task.num_prompts == 512
    assert task.prompt(0).text == "numbers 13 25 14 2 target 53:"
    assert task.reward(task.prompt(0), "13+25+14+2-1") == 0.0  # 1 is not given
    assert task.reward(task.prompt(0), "25+14+14") == 0.0  # 14 is given once
    assert task.reward(task.prompt(0), "25*2+14-13+2") == 0.0  # 2 used twice
    assert task.reward(task.prompt(0), "13+25+14+2-1+1") == 0.0


def test_jsonl_errors_say_what_to_fix(tmp_path: object) -> None:
    bad = tmp_path / "bad.jsonl"  # type: ignore[operator]
    bad.write_text('{"question": "1+1"}\n{"q": 2}\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:2: missing field\(s\) question"):
        build_task(ArithmeticTaskConfig(path=str(bad)))
    with pytest.raises(ValueError, match="not found"):
        build_task(ArithmeticTaskConfig(path="nope.jsonl"))


def test_user_task_by_import_path() -> None:
    config = parse_config({"task": {"type": "import", "target": "decentrl.tasks.sorting:SortingTask",
                                    "options": {"config": SortingTaskConfig(num_prompts=9)}}})
    assert isinstance(config.task, ImportTaskConfig)
    task = build_task(config.task)
    assert task.num_prompts == 9 and task.prompt(0).text.endswith("=")
    with pytest.raises(ValueError, match="has no 'Missing'"):
        build_task(ImportTaskConfig(target="decentrl.tasks.sorting:Missing"))
    with pytest.raises(ValueError, match="cannot import"):
        build_task(ImportTaskConfig(target="no_such_module:Task"))
