"""The `hf` scorer backend (workers/scorers/hf.py) on a tiny Qwen2 sequence classifier built from a
config with the tiny chat model's tokenizer, saved with save_pretrained and loaded back (no hub).

Every score is checked against the model run by hand on one unpadded text, so batching, padding,
the chat template, truncation and the label/transform choice are all held to a reference."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForSequenceClassification, AutoTokenizer, Qwen2Config, Qwen2ForSequenceClassification

from decentrl.api.wire import ChatMessage, ScoreItem
from decentrl.config import HFScorerConfig
from workers.scorers import BackendConfigError, build_scorer_backend
from workers.scorers.hf import HFScoreBackend, step_prefixes


def write_classifier(chat_dir: Path, out: Path, num_labels: int) -> Path:
    tokenizer = AutoTokenizer.from_pretrained(chat_dir)
    config = Qwen2Config(
        vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=2, max_position_embeddings=256, num_labels=num_labels, pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(0)
    Qwen2ForSequenceClassification(config).save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def rm_dir(chat_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_classifier(chat_dir, tmp_path_factory.mktemp("rm"), num_labels=1)


def item(completion: str, steps: list[str] | None = None, prompt: str = "0123=", **extra: object) -> ScoreItem:
    return ScoreItem(rollout_id=f"r-{completion}", prompt_id=0, prompt=prompt, completion=completion, steps=steps, **extra)


def reference_logits(path: Path, text: str, *, max_length: int = 10_000, chat: bool = True) -> torch.Tensor:
    """The classifier's logits for one text alone: no padding, the ids cut from the left by hand."""
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForSequenceClassification.from_pretrained(path).eval()
    ids = tokenizer(text, add_special_tokens=not chat)["input_ids"][-max_length:]
    with torch.no_grad():
        return model(input_ids=torch.tensor([ids])).logits[0]


def chat_text(path: Path, prompt: str, completion: str) -> str:
    tokenizer = AutoTokenizer.from_pretrained(path)
    messages = [{"role": "user", "content": prompt}, {"role": "assistant", "content": completion}]
    return tokenizer.apply_chat_template(messages, tokenize=False)


@pytest.mark.kernels
def test_scores_match_the_model_run_alone_whatever_the_batch(rm_dir: Path) -> None:
    completions = ["0123", "3210", "0", "01230123012301230123"]  # lengths differ: batches are padded
    backend = build_scorer_backend(HFScorerConfig(path=str(rm_dir), batch_size=3))
    verdicts = backend.score([item(c) for c in completions])
    for completion, verdict in zip(completions, verdicts, strict=True):
        expected = reference_logits(rm_dir, chat_text(rm_dir, "0123=", completion))[0].item()
        assert verdict.score == pytest.approx(expected, abs=1e-5)
        assert verdict.step_scores is None and verdict.error is None
    assert len({v.score for v in verdicts}) == len(completions)  # the texts are told apart
    again = build_scorer_backend(HFScorerConfig(path=str(rm_dir), batch_size=1)).score([item(c) for c in completions])
    assert [v.score for v in again] == pytest.approx([v.score for v in verdicts], abs=1e-5)


def test_step_scores_are_the_scores_of_the_prefixes_ending_at_each_step(rm_dir: Path) -> None:
    backend = HFScoreBackend(HFScorerConfig(path=str(rm_dir)))
    completion = "01 23\n45 67\n89"
    steps = ["01 23", "45 67", "89"]
    assert step_prefixes(completion, steps) == ["01 23", "01 23\n45 67", completion]
    verdict = backend.score([item(completion, steps)])[0]
    assert verdict.step_scores is not None and len(verdict.step_scores) == 3
    for prefix, score in zip(step_prefixes(completion, steps) or [], verdict.step_scores, strict=True):
        assert score == pytest.approx(reference_logits(rm_dir, chat_text(rm_dir, "0123=", prefix))[0].item(), abs=1e-5)
    assert verdict.step_scores[-1] == pytest.approx(verdict.score)  # the last prefix is the whole completion


def test_a_step_that_is_not_in_the_completion_fails_that_item_only(rm_dir: Path) -> None:
    backend = HFScoreBackend(HFScorerConfig(path=str(rm_dir)))
    assert step_prefixes("abc", ["b", "a"]) is None  # out of order
    bad, good = backend.score([item("0123", ["01", "99"]), item("0123", ["01", "23"])])
    assert bad.score is None and bad.error is not None and "step" in bad.error
    assert good.score is not None and good.step_scores is not None and len(good.step_scores) == 2


def test_long_texts_keep_their_end_when_truncated_on_the_left(rm_dir: Path) -> None:
    completion = "0123456789" * 6
    text = chat_text(rm_dir, "0123=", completion)
    cut = HFScoreBackend(HFScorerConfig(path=str(rm_dir), max_length=12)).score([item(completion)])[0]
    assert cut.score == pytest.approx(reference_logits(rm_dir, text, max_length=12)[0].item(), abs=1e-5)
    whole = HFScoreBackend(HFScorerConfig(path=str(rm_dir))).score([item(completion)])[0]
    assert whole.score != pytest.approx(cut.score, abs=1e-5)


def test_text_input_and_chat_messages(rm_dir: Path) -> None:
    text_backend = HFScoreBackend(HFScorerConfig(path=str(rm_dir), input="text", transform="sigmoid"))
    verdict = text_backend.score([item("3210")])[0]
    expected = reference_logits(rm_dir, "0123=3210", chat=False)[0].sigmoid().item()
    assert verdict.score == pytest.approx(expected, abs=1e-5) and 0 < verdict.score < 1
    chat_backend = HFScoreBackend(HFScorerConfig(path=str(rm_dir)))
    messages = [ChatMessage(role="system", content="sort"), ChatMessage(role="user", content="0123=")]
    with_system = chat_backend.score([item("3210", messages=messages)])[0]
    tokenizer = AutoTokenizer.from_pretrained(rm_dir)
    text = tokenizer.apply_chat_template(
        [m.model_dump() for m in messages] + [{"role": "assistant", "content": "3210"}], tokenize=False
    )
    assert with_system.score == pytest.approx(reference_logits(rm_dir, text)[0].item(), abs=1e-5)


def test_several_labels_need_a_label_and_softmax_reads_its_probability(chat_dir: Path, tmp_path: Path) -> None:
    path = write_classifier(chat_dir, tmp_path / "rm2", num_labels=3)
    with pytest.raises(BackendConfigError, match="3 labels"):
        HFScoreBackend(HFScorerConfig(path=str(path)))
    with pytest.raises(BackendConfigError, match="0..2"):
        HFScoreBackend(HFScorerConfig(path=str(path), label=3))
    verdict = HFScoreBackend(HFScorerConfig(path=str(path), label=2, transform="softmax")).score([item("0123")])[0]
    expected = reference_logits(path, chat_text(path, "0123=", "0123")).softmax(-1)[2].item()
    assert verdict.score == pytest.approx(expected, abs=1e-6)


def test_one_label_refuses_another_label_or_a_softmax(rm_dir: Path) -> None:
    with pytest.raises(BackendConfigError, match="one label"):
        HFScoreBackend(HFScorerConfig(path=str(rm_dir), label=1))
    with pytest.raises(BackendConfigError, match="softmax"):
        HFScoreBackend(HFScorerConfig(path=str(rm_dir), label=0, transform="softmax"))


@pytest.mark.gpu
def test_the_reward_model_scores_on_a_gpu_as_on_the_cpu(rm_dir: Path) -> None:
    items = [item(c, ["01", c[2:]]) for c in ("0123", "0132", "01230123")]
    cpu = HFScoreBackend(HFScorerConfig(path=str(rm_dir))).score(items)
    gpu = HFScoreBackend(HFScorerConfig(path=str(rm_dir), device="cuda")).score(items)
    half = HFScoreBackend(HFScorerConfig(path=str(rm_dir), device="cuda", dtype="bfloat16")).score(items)
    for c, g, h in zip(cpu, gpu, half, strict=True):
        assert g.score == pytest.approx(c.score, abs=1e-4) and g.step_scores == pytest.approx(c.step_scores, abs=1e-4)
        assert h.score == pytest.approx(c.score, abs=0.1)  # bfloat16 weights: close, not equal


def test_a_partial_step_is_judged_as_the_prefix_ending_with_it(rm_dir: Path) -> None:
    """A model PRM on POST /v1/steps' items: the verdict on step j of a sample still being generated
    is the model's score of the text so far (it ends with step j), posted as that step's score."""
    from workers.scorer import checked

    backend = HFScoreBackend(HFScorerConfig(path=str(rm_dir)))
    partial = item("01 23\n45 67\n", ["01 23\n", "45 67\n"], step=1)
    verdict = backend.score([partial])[0]
    expected = reference_logits(rm_dir, chat_text(rm_dir, "0123=", "01 23\n45 67\n"))[0].item()
    assert verdict.score == pytest.approx(expected, abs=1e-5)
    result = checked(partial, verdict, -1e9, 1e9)
    assert result is not None and result.step == 1 and result.step_scores is None
    assert result.score == pytest.approx(expected, abs=1e-5)
