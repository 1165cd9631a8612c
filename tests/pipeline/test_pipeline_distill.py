"""On-policy distillation wired end to end, every part real but in one process: a tiny student
samples completions of leased prompts (its own sampling log-probs), a real orchestrator on
loopback takes them and queues them for scoring, the scorer loop with the `teacher` backend
(a tiny model of another seed with the run's tokenizer, checked at start-up) leases them over
HTTP and posts the teacher's log-probs, the trainer fetches the batch over HTTP and trains the
student a few steps through its own step functions (rank_share, accumulate_gradients).

The batch's token advantages are the teacher's log-probs (a direct forward of the teacher)
minus the student's, every parameter trains, and the student's reverse KL to the teacher on
those samples falls."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
import torch

from decentrl.api.wire import Lease, Rollout, TrainBatch
from decentrl.config import TeacherScorerConfig
from decentrl.model.build import build_model, load_text_tokenizer
from decentrl.tasks import build_task
from decentrl.trainer.batching import collate, rank_share
from decentrl.trainer.step import accumulate_gradients, token_logprobs
from orchestrator.auth import TokenRegistry
from orchestrator.state import RunState
from tests.workers.test_scorer_teacher import reference_logprobs, write_teacher
from workers.scorer import Scorer
from workers.scorers import build_scorer_backend

TOKENS = [{"name": "teacher", "role": "scorer", "token": "s"}, {"name": "trainer", "role": "trainer", "token": "t"}]
MAX_TOKENS = 6


def sample(model: torch.nn.Module, prompt: list[int], eos: int, generator: torch.Generator) -> tuple[list[int], list[float]]:
    """One completion at temperature 1 and the log-prob of each sampled token, as a worker posts them."""
    ids, logprobs = list(prompt), []
    with torch.no_grad():
        for _ in range(MAX_TOKENS):
            distribution = model(input_ids=torch.tensor([ids])).logits[0, -1].log_softmax(-1)
            token = int(torch.multinomial(distribution.exp(), 1, generator=generator))
            ids.append(token)
            logprobs.append(distribution[token].item())
            if token == eos:
                break
    return ids[len(prompt):], logprobs


def reverse_kl(model: torch.nn.Module, batch: TrainBatch, teacher: list[list[float]]) -> float:
    """Mean over the batch's tokens of log p_student - log p_teacher (the per-token estimate)."""
    with torch.no_grad():
        tensors = collate(batch.samples, 0)
        student = token_logprobs(model, tensors, 1.0)
    gaps = [
        value - t for row, lp in enumerate(teacher)
        for value, t in zip(student[row][tensors.completion_mask[row] > 0].tolist(), lp, strict=True)
    ]
    return sum(gaps) / len(gaps)


def test_a_teacher_scorer_distills_into_the_student_through_the_orchestrator(
    make_config: Any, make_rollout: Any, serve_orchestrator: Any, tmp_path: Path
) -> None:
    config = make_config(trainer={"groups_per_step": 2, "steps": 3}, orchestrator={
        "lease_wait_s": 0.0, "rewards": {"type": "sum", "model_weight": 0.0}, "advantages": {"distill": {"weight": 1.0}}})
    teacher_dir = write_teacher(tmp_path / "teacher")
    tokenizer = load_text_tokenizer(config.model)
    state = RunState(config=config, task=build_task(config.task), tokenizer=tokenizer)
    state.announce(0)
    torch.manual_seed(0)
    student = build_model(config.model)
    generator = torch.Generator().manual_seed(0)
    leases: list[Lease] = state.grant_leases("w/w0", 2)
    for lease in leases:
        rollouts: list[Rollout] = []
        for _ in range(lease.group_size):
            ids, logprobs = sample(student, list(lease.prompt_token_ids), tokenizer.eos_token_id, generator)
            finish = "stop" if ids[-1] == tokenizer.eos_token_id else "length"
            rollouts.append(make_rollout(lease, ids, logprobs=logprobs, finish_reason=finish))
        assert state.ingest(rollouts, "w/w0").accepted == lease.group_size
    scorer_config = TeacherScorerConfig(path=str(teacher_dir), max_items=4, min_wait_s=0.05)

    async def scenario() -> TrainBatch:
        async with serve_orchestrator(state, TokenRegistry(TOKENS)) as server:
            client = server.client("s")
            info = await asyncio.to_thread(client.info)
            backend = await asyncio.to_thread(build_scorer_backend, scorer_config, info)
            scorer = Scorer(scorer_config, scorer_id="teacher-0", client=client, backend=backend)
            counts = await asyncio.to_thread(scorer.run, max_leases=2)  # 6 samples, 4 a lease
            assert (counts.scored, counts.failed, counts.lost) == (6, 0, 0)
            batch = await asyncio.to_thread(server.client("t").batch, 0, "r0")
            assert batch is not None
            return batch

    batch = asyncio.run(asyncio.wait_for(scenario(), timeout=60))
    teacher = [reference_logprobs(teacher_dir, list(s.prompt_token_ids), list(s.completion_token_ids)) for s in batch.samples]
    for sample_, teacher_logprobs in zip(batch.samples, teacher, strict=True):
        expected = [t - s for t, s in zip(teacher_logprobs, sample_.logprobs, strict=True)]
        assert sample_.token_advantages is not None
        assert list(sample_.token_advantages) == pytest.approx(expected, abs=1e-5)

    before = {name: p.detach().clone() for name, p in student.named_parameters()}
    kl_before = reverse_kl(student, batch, teacher)
    optimizer = torch.optim.AdamW(student.parameters(), lr=1e-2)
    for _ in range(4):  # one batch, several steps, as a stale batch would be: the IS correction applies
        _, totals, micro = rank_share(batch, rank=0, world=1, config=config.trainer, max_tokens=MAX_TOKENS, pad_id=0,
                                      device=torch.device("cpu"))
        loss, _ = accumulate_gradients(student, None, micro, totals=totals, config=config.trainer, temperature=1.0)
        assert torch.isfinite(loss)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    changed = [name for name, p in student.named_parameters() if not torch.equal(p.detach(), before[name])]
    assert changed == [name for name, _ in student.named_parameters()], "every parameter trains"
    assert reverse_kl(student, batch, teacher) < kl_before - 0.05

