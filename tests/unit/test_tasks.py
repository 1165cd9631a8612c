"""Unit tests for the tiny tokenizer and the sorting task's prompts and verifier."""

from __future__ import annotations

import random

import pytest
from transformers import PreTrainedTokenizerBase

from decentrl.config import SortingTaskConfig
from decentrl.model import TINY_SPECIALS, TINY_SYMBOLS
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
