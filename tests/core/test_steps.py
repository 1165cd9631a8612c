"""Step splitting for process rewards (decentrl/rl/steps.py): by a delimiter in the decoded text, and
by an episode's model turns.

The delimiter cases run on a hand-made vocabulary (a decode that joins token strings, so where
each step must end is known by construction) and on real byte-level BPE and SentencePiece-style
(Metaspace) tokenizers trained here, where the check is the definition itself: the step's last
token is the first whose prefix decode holds the delimiter run.
"""

from __future__ import annotations

import random
import re

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from decentrl.config import ConfigError, DelimiterStepsConfig, TurnStepsConfig
from decentrl.rl.steps import BatchDecode, Steps, split_steps

# id -> text; "</s>" decodes to nothing (a special token skipped by the decoder).
PIECES = ["Let", " x", "=2", ".\n", "\n", "Then", " y", "=3", "\n\n", "\n\n\n", "So", " 5", "</s>", ".\n\nAnd", " z", "\n\nx"]


def joined(sequences: list[list[int]]) -> list[str]:
    return ["".join("" if PIECES[i] == "</s>" else PIECES[i] for i in ids) for ids in sequences]


def ids_of(*pieces: str) -> list[int]:
    return [PIECES.index(p) for p in pieces]


def split(ids: list[int], decode: BatchDecode = joined, **config: object) -> Steps:
    return split_steps(ids, None, decode=decode, config=DelimiterStepsConfig(**config))


def test_a_step_ends_at_the_token_completing_the_delimiter() -> None:
    # "\n\n" is completed by the second of two "\n" tokens (".\n" then "\n"), then by one token.
    ids = ids_of("Let", " x", "=2", ".\n", "\n", "Then", " y", "=3", "\n\n", "So", " 5", "</s>")
    steps = split(ids)
    assert steps.ends == [4, 8, 11]  # the last step ends at the last token: </s> is in it
    assert steps.texts == ["Let x=2.", "Then y=3", "So 5"]


def test_a_run_of_delimiters_closes_one_step_and_ends_at_the_runs_last_token() -> None:
    ids = ids_of("Let", "\n\n", "\n\n\n", "\n", "So", "</s>")
    steps = split(ids)
    assert steps.ends == [3, 5]  # "\n\n" + "\n\n\n" + "\n" is one run: 6 newlines, completed by token 3
    assert steps.texts == ["Let", "So"]


def test_leading_and_trailing_delimiters_close_no_step() -> None:
    ids = ids_of("\n\n", "Let", " x", "\n\n", "So", "\n\n", "</s>")
    steps = split(ids)
    assert steps.ends == [3, 6]  # the trailing "\n\n" and </s> belong to the last step
    assert steps.texts == ["Let x", "So"]


def test_one_token_completing_two_runs_closes_one_step() -> None:
    # "\n\nx" completes one run and starts the next step; ".\n\nAnd" holds a whole run inside.
    ids = ids_of("Let", "\n\nx", "\n\n", "So", ".\n\nAnd", " z", "</s>")
    steps = split(ids)
    assert steps.ends == [1, 2, 4, 6]
    assert steps.texts == ["Let", "x", "So.", "And z"]
    # Runs completed by the same token: "x" step is empty of its own token, so one step ends at 2.
    ids = ids_of("So", ".\n\nAnd", "\n\nx", "</s>")
    assert split(ids).ends == [1, 2, 3]


def test_a_completion_without_delimiter_or_text_is_one_step() -> None:
    assert split(ids_of("Let", " x", "</s>")) == Steps([2], ["Let x"])
    assert split(ids_of("</s>")) == Steps([0], [""])
    assert split(ids_of("\n\n", "</s>")) == Steps([1], [""])


def test_max_steps_makes_the_rest_the_last_step() -> None:
    ids = ids_of("Let", "\n\n", "Then", "\n\n", "So", "\n\n", " 5", "</s>")
    assert split(ids).ends == [1, 3, 5, 7]
    steps = split(ids, max_steps=2)
    assert steps.ends == [1, 7]
    assert steps.texts == ["Let", "Then\n\nSo\n\n 5"]
    assert split(ids, max_steps=1) == Steps([7], ["Let\n\nThen\n\nSo\n\n 5"])


def test_a_configured_delimiter() -> None:
    ids = ids_of("Let", " x", "=2", ".\n", "Then", " y", "=3", ".\n", "So")
    assert split(ids, delimiter=".\n").ends == [3, 7, 8]
    assert split(ids, delimiter=".\n").texts == ["Let x=2", "Then y=3", "So"]


def counting(decode: BatchDecode, calls: list[int]) -> BatchDecode:
    def counted(sequences: list[list[int]]) -> list[str]:
        calls.append(len(sequences))
        return decode(sequences)

    return counted


def test_a_join_of_token_texts_finds_every_step_in_three_decodes() -> None:
    calls: list[int] = []
    ids = ids_of(*(["Let", " x", "\n\n"] * 20), "So", "</s>")  # 62 tokens, 20 boundaries
    assert split(ids, decode=counting(joined, calls)).ends == [*range(2, 60, 3), 61]
    # The text; each token alone and after its predecessor (the guesses); the guess and the token
    # before it, per boundary.
    assert calls == [1, 62 + 61, 40]


def test_wrong_guesses_fall_back_to_bisection() -> None:
    # A decode whose text of a token depends on the two before it (" x y=" becomes "X="): the
    # guesses from single tokens and pairs overshoot the text, and bisection finds the ends.
    def contextual(sequences: list[list[int]]) -> list[str]:
        return [text.replace(" x y=", "X=") for text in joined(sequences)]

    calls: list[int] = []
    ids = ids_of(*([" x", " y", "=3", "\n\n"] * 8), "So", "</s>")
    steps = split(ids, decode=counting(contextual, calls))
    assert steps.ends == [*range(3, 32, 4), 33]
    assert steps.texts == ["X=3"] * 8 + ["So"]
    assert calls[:3] == [1, 34 + 33, 16] and 3 < len(calls) <= 3 + 6 and max(calls[3:]) <= 8  # bisection rounds


def test_random_completions_end_steps_where_a_brute_force_search_does() -> None:
    rng = random.Random(3)
    for _ in range(300):
        ids = [rng.randrange(len(PIECES)) for _ in range(rng.randrange(1, 30))]
        steps = split(ids)
        (text,) = joined([ids])
        run_ends = [m.end() for m in re.finditer("(?:\n\n)+", text) if 0 < m.start() and m.end() < len(text)]
        # Brute force: the first token whose prefix holds each interior run, kept if a later
        # token follows and no later run is completed by the same token.
        first = [next(t for t in range(len(ids)) if joined([ids[: t + 1]])[0].startswith(text[:e])) for e in run_ends]
        expected = sorted({t for t in first if t < len(ids) - 1}) + [len(ids) - 1]
        assert steps.ends == expected, (ids, text)
        assert len(steps.texts) == len(steps.ends)
        # The texts are the whole text, less delimiters and the whitespace around steps.
        assert re.sub(r"\s", "", "".join(steps.texts)) == re.sub(r"\s", "", text), (ids, text)


def trained_tokenizer(kind: str) -> Tokenizer:
    corpus = ["Let x = 2.\n\nThen y = 3 so x + y = 5.\n\nThe answer is 5.", "Step one: add.\n\n\nStep two: check. Done"] * 50
    if kind == "byte_level":  # GPT-2 / Qwen / Llama 3 style
        tokenizer = Tokenizer(models.BPE())
        tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tokenizer.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["</s>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    else:  # SentencePiece style: "▁" for spaces, the leading one dropped on decode
        tokenizer = Tokenizer(models.BPE())
        tokenizer.pre_tokenizer = pre_tokenizers.Metaspace()
        tokenizer.decoder = decoders.Metaspace()
        trainer = trainers.BpeTrainer(vocab_size=200, special_tokens=["</s>"])
    tokenizer.train_from_iterator(corpus, trainer)
    return tokenizer


@pytest.mark.parametrize("kind", ["byte_level", "metaspace"])
def test_real_tokenizers_end_each_step_at_the_first_token_holding_its_delimiter(kind: str) -> None:
    tokenizer = trained_tokenizer(kind)
    text = "Let x = 2.\n\nThen y = 3 so x + y = 5.\n\n\nThe answer is 5.\n\n"
    ids = tokenizer.encode(text).ids + [tokenizer.token_to_id("</s>")]

    def decode(sequences: list[list[int]]) -> list[str]:
        return tokenizer.decode_batch(sequences, skip_special_tokens=True)

    steps = split(ids, decode=decode)
    assert steps.texts == ["Let x = 2.", "Then y = 3 so x + y = 5.", "The answer is 5."]
    full = decode([ids])[0]
    for end, prefix in zip(steps.ends, ["Let x = 2.\n\n", "Let x = 2.\n\nThen y = 3 so x + y = 5.\n\n"]):
        assert decode([ids[: end + 1]])[0].startswith(prefix)
        assert not decode([ids[:end]])[0].startswith(prefix)
        assert full.startswith(prefix)
    assert steps.ends[-1] == len(ids) - 1


def test_turns_are_the_runs_of_model_tokens() -> None:
    ids = ids_of("Let", " x", "\n", "Then", " y", "=3", "\n", "So", " 5")
    mask = [1, 1, 0, 1, 1, 1, 0, 1, 1]
    steps = split_steps(ids, mask, decode=joined, config=TurnStepsConfig())
    assert steps == Steps([1, 5, 8], ["Let x", "Then y=3", "So 5"])
    # Environment tokens after the last turn belong to no step.
    steps = split_steps(ids[:7], mask[:7], decode=joined, config=TurnStepsConfig())
    assert steps.ends == [1, 5]
    # Past max_steps the remaining turns, and the environment tokens between them, are the last step.
    steps = split_steps(ids, mask, decode=joined, config=TurnStepsConfig(max_steps=2))
    assert steps == Steps([1, 8], ["Let x", "Then y=3\nSo 5"])


def test_turns_without_a_mask_or_a_model_token_are_one_step() -> None:
    ids = ids_of("Let", " x", "\n")
    assert split_steps(ids, None, decode=joined, config=TurnStepsConfig()) == Steps([2], ["Let x\n"])
    assert split_steps(ids, [0, 0, 0], decode=joined, config=TurnStepsConfig()) == Steps([2], ["Let x\n"])


@pytest.mark.parametrize(
    ("section", "match"),
    [
        ({"steps": {"delimiter": ""}}, "delimiter"),
        ({"steps": {"max_steps": 0}}, "max_steps"),
        ({"steps": {"type": "sentences"}}, "type"),
        ({"steps": {"type": "turns", "delimiter": "\n"}}, "delimiter"),
        ({"process": "sum"}, "process"),
        ({"process_weight": -1.0}, "process_weight"),
        ({"process_weight": 0.0, "outcome_weight": 0.0}, "set process_weight > 0"),
    ],
)
def test_bad_process_reward_config_is_rejected(make_config: object, section: dict[str, object], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        make_config(orchestrator={"advantages": section})  # type: ignore[operator]
