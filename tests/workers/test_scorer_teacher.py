"""The `teacher` scorer backend (workers/scorers/teacher.py): a tiny causal LM with the run's tiny
tokenizer, saved with save_pretrained and loaded back (no hub).

Every log-prob is held to a direct transformers forward of the same model over the same ids,
one unpadded sequence at a time, so batching and padding are checked against a reference; a
teacher with another tokenizer is refused at start-up, in the backend and from a real
`decentrl scorer` process against a real orchestrator on loopback."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM

from decentrl.api.wire import RunInfo, ScoreItem
from decentrl.config import TeacherScorerConfig, TinyModelConfig
from decentrl.model.build import build_model, build_tiny_tokenizer, load_text_tokenizer
from decentrl.model.tokenizer import vocab_digest
from decentrl.tasks import build_task
from orchestrator.auth import TokenRegistry
from orchestrator.state import RunState
from workers.scorer import checked
from workers.scorers import BackendConfigError, Verdict, build_scorer_backend

TEACHER = TinyModelConfig(hidden_size=32, num_layers=2, num_heads=2, intermediate_size=64, seed=7)
REPO = Path(__file__).resolve().parents[2]


def write_teacher(out: Path, config: TinyModelConfig = TEACHER) -> Path:
    """A tiny model of the run's architecture and tokenizer, as a version in a store would hold it."""
    build_model(config).save_pretrained(out)
    build_tiny_tokenizer().save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def teacher_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_teacher(tmp_path_factory.mktemp("teacher"))


def run_info(**fields: Any) -> RunInfo:
    """/v1/info of a distilling run whose student uses the tiny tokenizer (the orchestrator's own
    tokenizers-only copy of it, decentrl/model/build.py `load_text_tokenizer`)."""
    student = load_text_tokenizer(TinyModelConfig())
    values = {"run_name": "distill", "store_url": "memory://x", "policy_version": 0, "max_staleness": 1,
              "group_size": 2, "vocab_size": len(student), "vocab_digest": vocab_digest(student), **fields}
    return RunInfo(**values)


def item(prompt: list[int], completion: list[int]) -> ScoreItem:
    return ScoreItem(rollout_id=f"r-{completion}", prompt_id=0, prompt="p", completion="c",
                     prompt_token_ids=prompt, completion_token_ids=completion)


def reference_logprobs(path: Path, prompt: list[int], completion: list[int], temperature: float = 1.0) -> list[float]:
    """log p(completion_t | prompt, completion_<t) by a plain forward of one unpadded sequence."""
    model = AutoModelForCausalLM.from_pretrained(path).eval()
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([prompt + completion])).logits[0].double() / temperature
    logprobs = logits.log_softmax(-1)
    return [logprobs[len(prompt) + t - 1, token].item() for t, token in enumerate(completion)]


@pytest.mark.kernels
def test_token_logprobs_equal_a_direct_forward_whatever_the_batch(teacher_dir: Path) -> None:
    cases = [([1, 5, 6, 7, 3], [4, 5, 2]), ([1, 9, 3], [12, 4, 13, 6, 5, 2]), ([1, 4, 4, 4, 4, 3], [2]),
             ([1, 8, 3], [8, 8, 8, 8])]  # prompts and completions of different lengths: rows are padded
    for batch_size, temperature in ((3, 1.0), (1, 1.0), (4, 0.7)):
        config = TeacherScorerConfig(path=str(teacher_dir), batch_size=batch_size, temperature=temperature)
        verdicts = build_scorer_backend(config, run=run_info()).score([item(p, c) for p, c in cases])
        for (prompt, completion), verdict in zip(cases, verdicts, strict=True):
            expected = reference_logprobs(teacher_dir, prompt, completion, temperature)
            assert verdict.token_logprobs == pytest.approx(expected, abs=1e-5)
            assert verdict.score == pytest.approx(torch.tensor(expected).mean().exp().item(), abs=1e-6)
            assert verdict.error is None and all(v <= 0 for v in verdict.token_logprobs or [])


def test_an_item_too_long_or_without_token_ids_is_a_failure_not_a_crash(teacher_dir: Path) -> None:
    backend = build_scorer_backend(TeacherScorerConfig(path=str(teacher_dir), max_length=6), run=run_info())
    plain = ScoreItem(rollout_id="r", prompt_id=0, prompt="p", completion="c")
    verdicts = backend.score([item([1, 5, 3], [4, 2]), item([1, 5, 6, 7, 3], [4, 2]), plain])
    assert verdicts[0].score is not None and len(verdicts[0].token_logprobs or []) == 2
    assert verdicts[1].score is None and "7 tokens, over [scorer] max_length = 6" in (verdicts[1].error or "")
    assert verdicts[2].score is None and "no token ids" in (verdicts[2].error or "")


def test_the_loop_posts_log_probs_only_when_they_fit_the_item() -> None:
    wanted = item([1, 3], [4, 5, 2])
    good = checked(wanted, Verdict(0.5, token_logprobs=[-0.1, -2.0, -0.3]), 0.0, 1.0)
    assert good.token_logprobs == [-0.1, -2.0, -0.3] and good.failure is None
    for bad in (Verdict(0.5), Verdict(0.5, token_logprobs=[-0.1]), Verdict(0.5, token_logprobs=[-0.1, 0.5, -1.0]),
                Verdict(0.5, token_logprobs=[-0.1, float("nan"), -1.0])):
        assert checked(wanted, bad, 0.0, 1.0).failure == "parse"
    plain = ScoreItem(rollout_id="r", prompt_id=0, prompt="p", completion="c")
    assert checked(plain, Verdict(0.5, token_logprobs=[-1.0]), 0.0, 1.0).token_logprobs is None  # not wanted: left out


def test_a_teacher_with_another_vocabulary_is_refused_at_start_up(teacher_dir: Path, chat_dir: Path) -> None:
    with pytest.raises(BackendConfigError) as refused:
        build_scorer_backend(TeacherScorerConfig(path=str(chat_dir)), run=run_info())
    message = str(refused.value)
    other = len(build_tiny_tokenizer())
    assert "another tokenizer" in message and f"the run's (the student's) {other}" in message
    assert "its vocabulary has 2" in message  # the chat model's byte-level BPE: 259 + merges
    with pytest.raises(BackendConfigError, match="does not distill"):
        build_scorer_backend(TeacherScorerConfig(path=str(teacher_dir)), run=run_info(vocab_digest=None))
    with pytest.raises(BackendConfigError, match="same size, but other tokens or ids"):
        build_scorer_backend(TeacherScorerConfig(path=str(teacher_dir)), run=run_info(vocab_digest="0" * 64))


def test_decentrl_scorer_with_another_tokenizer_exits_2_naming_both_sizes(
    chat_dir: Path, make_config: Any, tokenizer: Any, serve_orchestrator: Any, tmp_path: Path
) -> None:
    config = make_config(orchestrator={"rewards": {"type": "sum", "model_weight": 0.0}, "advantages": {"distill": {}}})
    state = RunState(config=config, task=build_task(config.task), tokenizer=load_text_tokenizer(config.model))
    tokens = TokenRegistry([{"name": "teacher", "role": "scorer", "token": "s"}])

    async def scenario() -> subprocess.CompletedProcess[str]:
        async with serve_orchestrator(state, tokens) as server:
            command = [sys.executable, "-m", "decentrl", "scorer", "--orchestrator", server.url, "--token", "s",
                       "--set", "scorer.type=teacher", "--set", f"scorer.path={chat_dir}"]
            env = {**os.environ, "PYTHONPATH": str(REPO)}
            return await asyncio.to_thread(subprocess.run, command, capture_output=True, text=True, env=env, timeout=120)

    done = asyncio.run(scenario())
    assert done.returncode == 2, done.stderr
    assert "another tokenizer" in done.stderr and f"the run's (the student's) {len(tokenizer)}" in done.stderr
