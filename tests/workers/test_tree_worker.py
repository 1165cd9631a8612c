"""The tree worker (workers/tree.py) against a real orchestrator on loopback and a real scorer
thread judging steps with the chain task's exact checker: steps posted while chains are decoded,
verdicts read without waiting, wrong chains stopped (tokens saved counted), pivots branched with
the prefix as prompt, and the whole unit accepted by the orchestrator's node rules.

A tiny random model (BASE_CONFIG's architecture) writes digits and '=', so many of its steps are
wrong: the checker's verdicts stop chains often.
"""

from __future__ import annotations

import asyncio
import os
import random
import threading
import time
from collections.abc import Awaitable
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from transformers import PreTrainedTokenizerBase

from decentrl.api.wire import (
    IngestResponse,
    Lease,
    LeaseRequest,
    Rollout,
    RolloutBatch,
    SamplingParams,
    StepBoundary,
    StepPost,
    StepVerdict,
    TreeUnit,
    VerdictList,
)
from decentrl.config import PythonScorerConfig, TinyModelConfig, VerificationConfig
from decentrl.model.build import build_model, build_tiny_tokenizer
from decentrl.model.sampling import sampling_distribution
from decentrl.rl.pivots import RecoveryEstimate
from decentrl.store.checkpoints import CheckpointStore
from decentrl.store.weights import write_hf_dir
from decentrl.tasks import build_task
from decentrl.tasks.chain import check_step
from decentrl.trainer.batching import collate
from decentrl.trainer.step import token_logprobs
from orchestrator.auth import TokenRegistry
from orchestrator.state import RunState
from orchestrator.verify import Verifier
from workers.backends.hf import HFBackend
from workers.scorer import Scorer
from workers.scorers import build_scorer_backend
from workers.tree import Chain, Rows, TreeCounts, VerdictFeed, generate_tree, play_trees

WORKER, SCORER = "worker-secret", "scorer-secret"
TOKENS = [{"name": "alice", "role": "worker", "token": WORKER}, {"name": "judge", "role": "scorer", "token": SCORER}]
TINY = {"hidden_size": 32, "num_layers": 1, "num_heads": 2, "intermediate_size": 64}
BRANCHING = {"pivots": 2, "stop_below": None, "rule": "random", "boundary": "tokens", "step_tokens": 4}


def run(coro: Awaitable[None]) -> None:
    asyncio.run(asyncio.wait_for(coro, timeout=60))  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def backend(tmp_path_factory: Any) -> HFBackend:
    directory = str(tmp_path_factory.mktemp("tree") / "v0")
    os.makedirs(directory)
    model = build_model(TinyModelConfig(**TINY, seed=3))
    build_tiny_tokenizer().save_pretrained(directory)
    model.generation_config.save_pretrained(directory)
    write_hf_dir(directory, model.state_dict(), model.config, extras_from=directory)
    loaded = HFBackend(seed=0)
    loaded.load(directory, 0)
    return loaded


@dataclass
class Served:
    """A tree lease played against a real orchestrator (`_serve_a_tree_lease`), and its answer."""

    state: RunState
    lease: Lease
    sampling: SamplingParams
    samples: list[Rollout]
    answer: IngestResponse
    counts: TreeCounts


def _serve_a_tree_lease(
    make_config: Any, tokenizer: PreTrainedTokenizerBase, serve_orchestrator: Any, backend: HFBackend,
    monkeypatch: pytest.MonkeyPatch, *, tree: dict[str, Any], sampling: dict[str, Any] | None = None, keep_cache: bool = True,
    seed: int | None = None, verifier: Verifier | None = None,
) -> Served:
    """One tree lease of the chain task leased from a real orchestrator on loopback, its steps
    judged by a real scorer thread with the task's exact checker, played by `generate_tree` and
    posted. With a `verifier` the run's verification is its config's."""
    # 15 ms a decoding step, a real model's pace: the tiny model alone ends a chain in milliseconds,
    # before any verdict can come back over HTTP, and then nothing is ever stopped.
    forward = backend.model.forward
    monkeypatch.setattr(backend.model, "forward", lambda *args, **kwargs: (time.sleep(0.015), forward(*args, **kwargs))[1])
    checks = {"verification": verifier.config.model_dump()} if verifier is not None else {}
    config = make_config(
        task={"type": "chain", "num_digits": 4, "num_prompts": 16, "seed": 0},
        sampling={"temperature": 1.0, "max_tokens": 48, **(sampling or {})},
        orchestrator={"tree": {"k": 2, "marker": "=", **tree}, "lease_wait_s": 0.0, "rewards": {"lease_timeout_s": 10.0}, **checks},
        trainer={"groups_per_step": 1}, group_size=4,
    )
    state = RunState(config=config, task=build_task(config.task), tokenizer=tokenizer)
    state.announce(0)
    scorer_config = PythonScorerConfig(function="workers.scorers.chain:judge", max_items=16, min_wait_s=0.01)
    served: list[Served] = []

    async def scenario() -> None:
        async with serve_orchestrator(state, TokenRegistry(TOKENS), verifier=verifier) as server:
            scorer = Scorer(scorer_config, scorer_id="s0", client=server.client(SCORER), backend=build_scorer_backend(scorer_config))
            scoring = threading.Thread(target=scorer.run, daemon=True)
            scoring.start()
            worker = server.client(WORKER)
            feed = VerdictFeed(worker, "w0", wait_s=0.5).start()
            counts = TreeCounts()
            try:
                response = await asyncio.to_thread(worker.lease, LeaseRequest(worker_id="w0", max_groups=1))
                (lease,) = response.leases
                samples = await asyncio.to_thread(
                    generate_tree, backend, worker, lease, response.sampling, run_name=config.run_name, worker_id="w0", feed=feed,
                    rng=random.Random(0), estimate=RecoveryEstimate(), counts=counts, keep_cache=keep_cache, seed=seed,
                )
                answer = await asyncio.to_thread(worker.post_rollouts, RolloutBatch(rollouts=samples))
            finally:
                scorer.request_stop()
                await asyncio.to_thread(feed.close)
                await asyncio.to_thread(scoring.join, 15)
            served.append(Served(state, lease, response.sampling, samples, answer, counts))

    run(scenario())
    return served[0]


@pytest.mark.parametrize(
    ("keep_cache", "tree"),
    [
        (True, {"pivots": 0, "stop_below": 0.5}),  # stopping: a random model's chains go wrong at once
        (False, {"pivots": 0, "stop_below": 0.5}),
        (True, BRANCHING),
    ],
)
def test_a_tree_lease_is_generated_scored_stopped_and_branched(
    make_config: Any, tokenizer: PreTrainedTokenizerBase, serve_orchestrator: Any, backend: HFBackend, keep_cache: bool,
    tree: dict[str, Any], monkeypatch: pytest.MonkeyPatch,
) -> None:
    served = _serve_a_tree_lease(make_config, tokenizer, serve_orchestrator, backend, monkeypatch, tree=tree, keep_cache=keep_cache)
    state, lease, samples, answer, counts = served.state, served.lease, served.samples, served.answer, served.counts
    pivots = tree["pivots"]
    assert answer.rejected == [] and answer.accepted == 4 + 2 * pivots, answer
    assert lease.lease_id not in state.leases  # the unit is complete
    roots, branches = samples[:4], samples[4:]
    assert all(s.node is None for s in roots)
    assert {s.node.node_id for s in branches} == {f"b{n}" for n in range(pivots)}  # type: ignore[union-attr]
    for branch in branches:
        parent = next(s for s in roots if s.rollout_id == branch.node.parent.rollout_id)  # type: ignore[union-attr]
        at = branch.node.parent.at  # type: ignore[union-attr]
        assert branch.prompt_token_ids == parent.prompt_token_ids + parent.completion_token_ids[:at]
        assert len(branch.completion_token_ids) <= served.sampling.max_tokens - at
    assert counts.steps_posted >= sum(len(s.step_ends or ()) for s in samples)  # and those cut after a wrong one
    assert counts.generated == sum(len(s.completion_token_ids) for s in samples)
    assert all(s.sampling_mask is None for s in samples)  # no top-k/top-p: the whole vocabulary
    stopped = [s for s in samples if s.finish_reason == "wrong_step"]
    assert counts.verdicts_used == len(stopped)
    if tree["stop_below"] is None:
        assert not stopped and counts.saved == 0
        return
    assert stopped and counts.saved > 0  # a random model's chains go wrong, and would have gone on
    prompt = state.task.prompt(lease.prompt_id).text
    for sample in stopped:  # each ends with its step judged wrong by the exact checker, the ones before right
        text = tokenizer.decode(sample.completion_token_ids, skip_special_tokens=True)
        assert check_step(prompt, text) is False
        assert all(check_step(prompt, text[:i + 1]) for i, c in enumerate(text[:-1]) if c == "=")


@pytest.mark.parametrize("tree", [{"pivots": 0, "stop_below": 0.5}, BRANCHING], ids=["stopping", "branching"])
def test_tree_samples_with_top_k_carry_each_tokens_kept_ids_to_the_trainer(
    make_config: Any, tokenizer: PreTrainedTokenizerBase, serve_orchestrator: Any, backend: HFBackend,
    tree: dict[str, Any], monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Sampled from the top 5 ids: every tree sample (roots, chains cut at a wrong step, branches)
    # carries per completion token the ids it was sampled among - the top 5 of its distribution
    # given its prompt and the tokens before - and the trainer, truncating its own distribution to
    # them, computes the worker's logprobs again (importance ratio 1). Without them it normalizes
    # over the whole vocabulary, and every tree sample's ratio is off.
    # Seeded: a root of seed 8 goes on 30 tokens (450 ms) past its first wrong step, time for its verdict to cut it.
    served = _serve_a_tree_lease(make_config, tokenizer, serve_orchestrator, backend, monkeypatch, tree=tree,
                                 sampling={"top_k": 5}, seed=8)
    samples, sampling = served.samples, served.sampling
    assert served.answer.rejected == [] and served.answer.accepted == 4 + 2 * tree["pivots"], served.answer
    if tree["pivots"]:
        assert [s.node is not None for s in samples] == [False] * 4 + [True] * 4
    else:
        assert any(s.finish_reason == "wrong_step" for s in samples)  # cut where a step was judged wrong
    for sample in samples:
        mask, ids = sample.sampling_mask, sample.completion_token_ids
        assert mask is not None and len(mask) == len(ids)
        assert all(token in kept and len(kept) <= sampling.top_k for token, kept in zip(ids, mask, strict=True))
        with torch.no_grad():
            logits = backend.model(input_ids=torch.tensor([sample.prompt_token_ids + ids])).logits[0, len(sample.prompt_token_ids) - 1 : -1]
        top = sampling_distribution(logits.double(), sampling).isfinite()
        assert mask == [row.nonzero().squeeze(-1).tolist() for row in top]
    batch = served.state.take_batch(0)  # the unit, as the orchestrator hands it to the trainer
    assert batch is not None and {s.rollout_id for s in batch.samples} == {s.rollout_id for s in samples}
    tensors = collate(batch.samples, pad_id=0)
    assert tensors.kept_ids is not None
    with torch.no_grad():
        trainer = token_logprobs(backend.model, tensors, sampling.temperature)
    ratio = (trainer - tensors.sampler_logprobs)[tensors.completion_mask.bool()].exp()
    torch.testing.assert_close(ratio, torch.ones_like(ratio), atol=2e-4, rtol=0)


def test_a_stop_string_ends_root_and_branch_chains(
    make_config: Any, tokenizer: PreTrainedTokenizerBase, serve_orchestrator: Any, backend: HFBackend,
    monkeypatch: pytest.MonkeyPatch, tmp_path: Any,
) -> None:
    # "=" ends a chain as the plain path ends a completion: with the token that completes it,
    # finish "stop", its last step ended there - roots and branches (a branch looks in its
    # continuation). Verification on: the orchestrator checks every finish_reason against the
    # tokens ("stop": they end with end-of-sequence or a stop string); no logprob spot checks.
    checks = VerificationConfig(enabled=True, new_worker_checks=0, spot_check_fraction=0.0)
    verifier = Verifier(checks, store=CheckpointStore(f"file://{tmp_path}/store"), cache_dir=str(tmp_path / "vc"),
                        build=lambda: build_model(TinyModelConfig(**TINY)))
    served = _serve_a_tree_lease(make_config, tokenizer, serve_orchestrator, backend, monkeypatch, tree=BRANCHING,
                                 sampling={"stop": ["="]}, seed=11, verifier=verifier)
    samples = served.samples
    assert served.answer.rejected == [] and served.answer.accepted == 4 + 2 * BRANCHING["pivots"], served.answer
    ended = []
    for sample in samples:
        text = tokenizer.decode(sample.completion_token_ids, skip_special_tokens=True)
        assert "=" not in text[:-1]  # nothing goes on past a stop string
        assert sample.step_ends[-1] == len(sample.completion_token_ids)  # type: ignore[index]
        if text.endswith("="):
            assert sample.finish_reason == "stop"
            ended.append(sample.node is None)
    assert True in ended and False in ended  # roots and branches alike


def test_a_branch_looks_for_stop_strings_in_its_continuation_alone(tokenizer: PreTrainedTokenizerBase) -> None:
    # A stop string begun in a branch's prefix (its prompt) and completed by its first token does
    # not end it: the plain path never looks in a prompt, nor the orchestrator's check of a "stop"
    # sample, which reads its completion ids alone. Completed within the continuation, it does.
    ids = {c: tokenizer.convert_tokens_to_ids(c) for c in "0123456789="}
    unit = TreeUnit(kind="tree", k=2, pivots=1, boundary=StepBoundary(type="tokens", tokens=4))
    branch = Chain("b", [ids[c] for c in "7324=91"], 8, node={"node_id": "b0", "parent": {"rollout_id": "a", "at": 2}})
    rows = Rows([branch], unit, text_of=lambda t: tokenizer.decode(t, skip_special_tokens=True), eos_ids=set(), stops=["12"],
                on_step=lambda chain, step: None, verdict=lambda rollout_id, step: None, counts=TreeCounts())
    for c in "2512":
        rows.take(0, ids[c], -1.0)
    assert branch.finish == "stop" and branch.tokens == [ids[c] for c in "2512"] and branch.ends == [4]


class _LateJudge:
    """A client whose scorer judges each posted step `delay_s` after its post, long after the
    unpaced tiny model ends its chains: step 0 right, every later step wrong."""

    timeout_s = 1.0

    def __init__(self, delay_s: float, gates: dict[str, str] | None = None) -> None:
        self.delay_s = delay_s
        self.gates = gates or {}  # lease -> the lease whose first posted step releases its verdicts
        self.posted: list[str] = []  # the lease of each step posted, in order
        self.posted_rollouts: list[str] = []  # and its sample
        self.calls = 0  # POST /v1/steps
        self.judged: list[tuple[float, StepVerdict]] = []
        self.lock = threading.Lock()

    def post_steps(self, post: StepPost) -> None:
        with self.lock:
            self.calls += 1
            self.posted += [post.lease_id] * len(post.steps)
            self.posted_rollouts += [step.rollout_id for step in post.steps]
            for step in post.steps:
                verdict = StepVerdict(lease_id=post.lease_id, rollout_id=step.rollout_id, step=step.step,
                                      score=self.score(step.rollout_id, step.step), seq=len(self.judged) + 1)
                self.judged.append((time.monotonic() + self.delay_s, verdict))

    def score(self, rollout_id: str, step: int) -> float:
        return float(step == 0)

    def verdicts(self, worker_id: str, after: int, wait_s: float = 0.0) -> VerdictList:
        time.sleep(0.01)
        with self.lock:
            ready = []
            for due, v in self.judged[after:]:  # in their numbers' order, as a journal hands them out
                if due > time.monotonic() or self.gates.get(v.lease_id, v.lease_id) not in self.posted:
                    break
                ready.append(v)
        return VerdictList(verdicts=ready, last=max([after] + [v.seq for v in ready]))


def _judged_play(
    backend: HFBackend, client: _LateJudge, lease: Lease, *, verdict_wait_s: float, rng: int = 0, seed: int | None = None
) -> tuple[list[Rollout], TreeCounts]:
    """`lease` played by `generate_tree` against `client`'s judge (8 tokens a chain), in a run whose
    steps a scorer judges (an earlier unit's verdict in): the roots' verdicts are waited for."""
    feed = VerdictFeed(client, "w0", wait_s=0.0)  # type: ignore[arg-type]
    feed.scores[("an earlier unit's", 0)] = 1.0
    feed.start()
    counts = TreeCounts()
    try:
        samples = generate_tree(backend, client, lease, SamplingParams(temperature=1.0, max_tokens=8), run_name="r",  # type: ignore[arg-type]
                                worker_id="w0", feed=feed, rng=random.Random(rng), estimate=RecoveryEstimate(), counts=counts,
                                seed=seed, verdict_wait_s=verdict_wait_s)
    finally:
        feed.close()
    return samples, counts


@pytest.mark.parametrize("rule", ["last_right", "random", "utility"])
@pytest.mark.parametrize("pivots", [2, 3])
def test_a_unit_branches_from_every_boundary_its_rule_leaves_when_they_are_fewer(rule: str, pivots: int) -> None:
    """As many pivots as the unit has, or every step boundary its roots have if fewer: the unit the
    orchestrator completes (orchestrator/leases.py `tree_pivots`). `last_right` picks no boundary
    of a chain wrong from its first step; the rest is topped up at random."""
    from workers.tree import _pivots

    class Verdicts:
        def score(self, rollout_id: str, step: int) -> float | None:
            return 0.0 if (rollout_id, step) == ("a", 0) else None

    wrong = Chain("a", [1], 8, tokens=[5] * 6, ends=[2, 4, 6], finish="stop")  # judged wrong at its first step, not cut
    ones = [Chain(name, [1], 8, tokens=[5] * 6, ends=[6], finish="stop") for name in ("b", "c")]  # one step: no boundary
    unit = TreeUnit(kind="tree", k=2, pivots=pivots, boundary=StepBoundary(type="tokens", tokens=2), rule=rule)  # type: ignore[arg-type]
    chosen = _pivots([wrong, *ones], unit, Verdicts(), random.Random(0), RecoveryEstimate(), rule)  # type: ignore[arg-type]
    assert sorted((c.rollout_id, c.at) for c in chosen) == [("a", 2), ("a", 4)]


@pytest.mark.parametrize("wait_s", [0.0, 5.0])
def test_pivots_are_chosen_on_the_roots_last_verdicts(backend: HFBackend, wait_s: float) -> None:
    # The roots end before any verdict is back; waiting for them (the default) finds every
    # chain judged wrong from its step 1, so `last_right` branches after step 0 - not from past
    # a wrong step, where no branch can recover (a chain not known as failed is no candidate).
    client = _LateJudge(delay_s=1.0)  # long after the unpaced roots end, even on a loaded host
    unit = TreeUnit(kind="tree", k=2, pivots=1, boundary=StepBoundary(type="tokens", tokens=2), rule="last_right")
    lease = Lease(lease_id="l0", prompt_id=0, prompt_token_ids=build_tiny_tokenizer()("7324=").input_ids, group_size=4,
                  deadline=time.time() + 60, unit=unit)
    samples, counts = _judged_play(backend, client, lease, verdict_wait_s=wait_s)
    roots = {s.rollout_id: s for s in samples[:4]}
    parents = [s.node.parent for s in samples[4:]]  # type: ignore[union-attr]
    assert len(parents) == 2 and len({(p.rollout_id, p.at) for p in parents}) == 1
    parent = parents[0]
    assert len(roots[parent.rollout_id].step_ends or ()) >= 2  # a pivot is never a chain's end
    if wait_s:
        assert parent.at == roots[parent.rollout_id].step_ends[0]  # type: ignore[index]
        assert counts.verdict_timeouts == 0 and 0.1 < counts.verdict_wait_s < wait_s
    else:  # nothing known: the deepest boundary of any chain, past its wrong step
        assert parent.at == roots[parent.rollout_id].step_ends[-2]  # type: ignore[index]
        assert counts.verdict_timeouts == 1


class _OneRight(_LateJudge):
    """Every step wrong but those of the first sample posted (`one_right`): all right."""

    def __init__(self, one_right: bool) -> None:
        super().__init__(delay_s=0.05)
        self.one_right = one_right

    def score(self, rollout_id: str, step: int) -> float:
        return float(self.one_right and rollout_id == self.posted_rollouts[0])


@pytest.mark.parametrize("one_right", [True, False])
def test_a_unit_that_branches_all_failed_branches_only_when_no_root_is_known_right(backend: HFBackend, one_right: bool) -> None:
    """A root whose every step is judged right leaves the unit its roots alone (counted
    `unbranched`, not short): the unit the orchestrator completes (orchestrator/leases.py `tree_pivots`)."""
    client = _OneRight(one_right)
    unit = TreeUnit(kind="tree", k=2, pivots=1, boundary=StepBoundary(type="tokens", tokens=2), rule="random", branch="all_failed")
    lease = Lease(lease_id="l0", prompt_id=0, prompt_token_ids=build_tiny_tokenizer()("7324=").input_ids, group_size=4,
                  deadline=time.time() + 60, unit=unit)
    samples, counts = _judged_play(backend, client, lease, verdict_wait_s=5.0)
    assert counts.verdict_timeouts == 0 and [s.node for s in samples[:4]] == [None] * 4
    if one_right:
        assert len(samples) == 4 and (counts.unbranched, counts.short) == (1, 0)
    else:
        assert len(samples) == 4 + 2 and (counts.unbranched, counts.short) == (0, 0)


def test_a_seeded_unit_draws_the_same_roots_pivots_and_branches_every_time(backend: HFBackend) -> None:
    # Seeded from (run seed, prompt, version, node path, index) alone: two plays of the unit with
    # different worker RNGs, and verdicts that come at different times, give the same samples;
    # another run seed gives others. The pivots are chosen once every root verdict is in (a scorer
    # judges this run's steps: the worker waits for them), so when they come cannot change the pick.
    unit = TreeUnit(kind="tree", k=3, pivots=2, boundary=StepBoundary(type="tokens", tokens=2), rule="random")
    lease = Lease(lease_id="l0", prompt_id=5, prompt_token_ids=build_tiny_tokenizer()("7324=").input_ids, group_size=4,
                  deadline=time.time() + 60, unit=unit, policy_version=0)

    def play(seed: int, rng: int, delay_s: float = 0.0) -> list[tuple[Any, ...]]:
        samples, counts = _judged_play(backend, _LateJudge(delay_s=delay_s), lease, verdict_wait_s=30.0, rng=rng, seed=seed)
        assert counts.verdict_timeouts == 0  # every root verdict was in when the pivots were chosen
        root_of = {s.rollout_id: j for j, s in enumerate(samples[:4])}
        return [(None if s.node is None else (root_of[s.node.parent.rollout_id], s.node.parent.at),  # type: ignore[union-attr]
                 tuple(s.prompt_token_ids), tuple(s.completion_token_ids), tuple(s.step_ends or ())) for s in samples]

    first = play(seed=7, rng=0)
    assert len(first) == 4 + 2 * 3 and len({row[2] for row in first[:4]}) > 1  # the roots differ from each other
    assert play(seed=7, rng=1) == first
    assert play(seed=7, rng=1, delay_s=0.3) == first  # verdicts long after the roots end: the same pick
    other = play(seed=8, rng=0)
    assert [row[2] for row in other[:4]] != [row[2] for row in first[:4]]


def _two_leases(pivots: int = 1, k: int = 2, rule: str = "last_right") -> list[Lease]:
    unit = TreeUnit(kind="tree", k=k, pivots=pivots, boundary=StepBoundary(type="tokens", tokens=2), rule=rule)  # type: ignore[arg-type]
    ids = build_tiny_tokenizer()("7324=").input_ids
    return [Lease(lease_id=f"l{n}", prompt_id=n, prompt_token_ids=ids, group_size=4, deadline=time.time() + 60, unit=unit,
                  policy_version=0) for n in range(2)]


@pytest.mark.parametrize("ahead", [0, 1])
def test_the_next_units_roots_are_decoded_while_a_unit_waits_for_its_verdicts(backend: HFBackend, ahead: int) -> None:
    # The verdicts on l0's steps come only once l1's first step is posted: a worker that waits
    # for them before decoding anything else (ahead 0) waits its whole verdict_wait_s in vain and
    # branches l0 on no verdict; one that decodes l1's roots meanwhile (ahead 1, the default)
    # finds them in, and those late verdicts still act: l0 branches after its last right step.
    client = _LateJudge(delay_s=0.0, gates={"l0": "l1"})
    feed = VerdictFeed(client, "w0", wait_s=0.0)  # type: ignore[arg-type]
    feed.scores[("an earlier unit's", 0)] = 1.0  # a scorer judges this run's steps (none judged: no wait)
    feed.start()
    counts = TreeCounts()
    sampling = SamplingParams(temperature=1.0, max_tokens=8)
    played = []
    try:
        for lease, samples in play_trees(backend, client, [(lease, sampling) for lease in _two_leases()], run_name="r",  # type: ignore[arg-type]
                                         worker_id="w0", feed=feed, rng=random.Random(0), estimate=RecoveryEstimate(),
                                         counts=counts, verdict_wait_s=1.0 if ahead == 0 else 10.0, ahead=ahead):
            played.append((lease.lease_id, samples))
    finally:
        feed.close()
    assert [lease_id for lease_id, _ in played] == ["l0", "l1"]  # in the leases' order
    # Every step posted once; steps that end together (the rows' boundaries every 2 tokens) go in one post.
    assert len(client.posted_rollouts) == counts.steps_posted and client.calls < counts.steps_posted
    first = client.posted.index("l1")
    roots = {s.rollout_id: s for s in played[0][1][:4]}
    parent = played[0][1][4].node.parent  # type: ignore[union-attr]
    if ahead:
        assert counts.verdict_timeouts == 0 and counts.verdict_wait_s < 10.0
        assert parent.at == roots[parent.rollout_id].step_ends[0]  # type: ignore[index]
        # l1's roots were decoded (their first step posted) before any of l0's branches was
        branch_ids = {s.rollout_id for s in played[0][1][4:]}
        assert branch_ids and not branch_ids & set(client.posted_rollouts[: first + 1])
    else:
        assert counts.verdict_timeouts == 1 and counts.verdict_wait_s >= 1.0  # l0 waited in vain; l1 did not
        assert set(client.posted[:first]) == {"l0"} and set(client.posted[first:]) == {"l1"}  # l1 only once l0 was done


def test_overlapped_seeded_units_draw_what_they_draw_one_at_a_time(backend: HFBackend) -> None:
    # The overlap changes when a unit's roots are decoded, not what it draws: seeded, the same
    # samples (roots, pivots, branches) as played one after the other.
    sampling = SamplingParams(temperature=1.0, max_tokens=8)

    def play(ahead: int, width: int = 1) -> list[list[tuple[Any, ...]]]:
        client = _LateJudge(delay_s=0.0)
        feed = VerdictFeed(client, "w0", wait_s=0.0)  # type: ignore[arg-type]
        feed.scores[("an earlier unit's", 0)] = 1.0  # pivots chosen once the roots' verdicts are in, either way
        feed.start()
        try:
            units = [samples for _, samples in play_trees(
                backend, client, [(lease, sampling) for lease in _two_leases(pivots=2, k=3, rule="utility")],  # type: ignore[arg-type]
                run_name="r", worker_id="w0", feed=feed, rng=random.Random(ahead), estimate=RecoveryEstimate(),
                counts=TreeCounts(), seed=7, ahead=ahead, width=width)]
        finally:
            feed.close()
        rows = []
        for samples in units:
            root_of = {s.rollout_id: j for j, s in enumerate(samples[:4])}
            rows.append([(None if s.node is None else (root_of[s.node.parent.rollout_id], s.node.parent.at),  # type: ignore[union-attr]
                          tuple(s.prompt_token_ids), tuple(s.completion_token_ids), tuple(s.step_ends or ())) for s in samples])
        return rows

    one_at_a_time = play(ahead=0)
    assert [len(rows) for rows in one_at_a_time] == [4 + 2 * 3] * 2
    assert play(ahead=1) == one_at_a_time
    assert play(ahead=1, width=2) == one_at_a_time  # both units' roots decoded in one batch


def test_verdicts_at_a_fixed_lag_give_a_prm_unit_the_same_samples_and_counts_whatever_the_scorer_delay(
    backend: HFBackend, monkeypatch: pytest.MonkeyPatch
) -> None:
    # `verdict_lag_tokens`: a step's verdict acts exactly 2 tokens after its step ended, waited for
    # if it is late, held if it is early; so a scorer answering at once and one answering 0.3 s
    # late (a loaded machine against a quiet one) stop the same chains at the same tokens, and the
    # unit's samples and counts are the same. Without the option the prompt scorer stops chains a
    # few paced tokens after their wrong step and the late one stops none.
    forward = backend.model.forward
    monkeypatch.setattr(backend.model, "forward", lambda *args, **kwargs: (time.sleep(0.005), forward(*args, **kwargs))[1])
    unit = TreeUnit(kind="tree", k=2, pivots=1, boundary=StepBoundary(type="tokens", tokens=2), stop_below=0.5,
                    rule="last_right", verdict_lag_tokens=2)
    lease = Lease(lease_id="l0", prompt_id=5, prompt_token_ids=build_tiny_tokenizer()("7324=").input_ids, group_size=4,
                  deadline=time.time() + 60, unit=unit, policy_version=0)

    def play(delay_s: float) -> tuple[list[tuple[Any, ...]], TreeCounts]:
        client = _LateJudge(delay_s=delay_s)  # step 0 right, every later step wrong
        feed = VerdictFeed(client, "w0", wait_s=0.0).start()  # type: ignore[arg-type]
        counts = TreeCounts()
        try:
            samples = generate_tree(backend, client, lease, SamplingParams(temperature=1.0, max_tokens=16), run_name="r",  # type: ignore[arg-type]
                                    worker_id="w0", feed=feed, rng=random.Random(0), estimate=RecoveryEstimate(),
                                    counts=counts, seed=7, verdict_wait_s=30.0)
        finally:
            feed.close()
        root_of = {s.rollout_id: j for j, s in enumerate(samples[:4])}
        return [(None if s.node is None else (root_of[s.node.parent.rollout_id], s.node.parent.at),  # type: ignore[union-attr]
                 tuple(s.prompt_token_ids), tuple(s.completion_token_ids), s.finish_reason, tuple(s.step_ends or ()))
                for s in samples], counts

    prompt, prompt_counts = play(delay_s=0.0)
    late, late_counts = play(delay_s=0.3)
    assert late == prompt
    stopped = [row for row in prompt if row[3] == "wrong_step"]
    assert stopped and all(row[4][-1] == 4 for row in stopped)  # each cut at its wrong step 1's end
    figures = ("generated", "discarded", "saved", "verdicts_used", "decode_steps", "verdict_timeouts")
    assert [getattr(late_counts, f) for f in figures] == [getattr(prompt_counts, f) for f in figures]
    assert prompt_counts.discarded == 2 * prompt_counts.verdicts_used == 2 * len(stopped)  # exactly the lag each
    assert late_counts.verdict_timeouts == 0 and late_counts.verdict_wait_s > 0.2  # the late verdicts were waited for


@pytest.mark.parametrize("pivots", [0, 1])
def test_a_unit_with_verdicts_at_a_fixed_lag_is_sent_with_every_verdict_in(backend: HFBackend, pivots: int) -> None:
    # Its verdicts are its samples' process rewards when the unit completes (the reward stage reads
    # them then): at a fixed lag every step's verdict, roots' and branches', is in before the unit
    # is handed back to be sent, even from a scorer 0.3 s late, so the rewards depend on the seed
    # alone. Without a lag nothing waits where there is no pivot (an unjudged step trains on the
    # sample's outcome alone).
    unit = TreeUnit(kind="tree", k=2, pivots=pivots, boundary=StepBoundary(type="tokens", tokens=2), stop_below=None,
                    rule="last_right", verdict_lag_tokens=2)  # no chain stops: each runs to its end, its last verdict after it
    lease = Lease(lease_id="l0", prompt_id=5, prompt_token_ids=build_tiny_tokenizer()("7324=").input_ids, group_size=4,
                  deadline=time.time() + 60, unit=unit, policy_version=0)
    for lagged in (True, False):
        client = _LateJudge(delay_s=0.3)
        feed = VerdictFeed(client, "w0", wait_s=0.0).start()  # type: ignore[arg-type]
        try:
            samples = generate_tree(backend, client, lease.model_copy(update={"unit": unit.model_copy(update={  # type: ignore[arg-type]
                                        "verdict_lag_tokens": 2 if lagged else None})}),
                                    SamplingParams(temperature=1.0, max_tokens=16), run_name="r", worker_id="w0", feed=feed,
                                    rng=random.Random(0), estimate=RecoveryEstimate(), counts=TreeCounts(), seed=7,
                                    verdict_wait_s=30.0)
            steps = {(s.rollout_id, j) for s in samples for j in range(len(s.step_ends or ()))}
            judged = steps & feed.scores.keys()
        finally:
            feed.close()
        assert len(samples) == 4 + pivots * 2 and steps
        if lagged:
            assert judged == steps
        elif not pivots:
            assert judged != steps  # the last steps' verdicts were still 0.3 s away


@pytest.mark.parametrize("burst", [1, 3])
def test_a_verdict_acts_at_its_lag_however_many_tokens_an_engine_step_brings(burst: int) -> None:
    # vLLM's engine may hand a row several tokens in one step (`stream_chains` takes them all, then
    # judges): the verdict still acts on the very token that puts its chain `lag` tokens past its
    # step's end, waited for there, and a verdict in long before is held until then.
    unit = TreeUnit(kind="tree", k=2, pivots=1, boundary=StepBoundary(type="tokens", tokens=2), stop_below=0.5,
                    verdict_lag_tokens=3)
    scores = {("a", 0): 1.0, ("a", 1): 0.0}  # both in at once: step 1 (ending at 4 tokens) is wrong
    awaited: list[tuple[str, int, int]] = []
    chain = Chain("a", [1], 12)
    counts = TreeCounts()
    rows = Rows([chain], unit, text_of=lambda t: "x" * len(t), eos_ids=set(), stops=[], on_step=lambda c, s: None,
                verdict=lambda r, s: scores.get((r, s)), counts=counts,
                await_verdict=lambda r, s: (awaited.append((r, s, len(chain.tokens))), scores.get((r, s)))[1])
    for start in range(0, 12, burst):
        for _ in range(burst):
            rows.take(0, 5, -1.0)
        rows.judge()
    assert awaited == [("a", 0, 5), ("a", 1, 7)]  # each step's verdict read 3 tokens after its end (2, 4), not before
    assert chain.finish == "wrong_step" and chain.tokens == [5] * 4 and chain.ends == [2, 4]
    assert counts.discarded == 3 and counts.verdicts_used == 1 and rows.shadow == [12 - 7]


def test_verdict_lag_tokens_needs_a_way_to_wait_for_a_verdict() -> None:
    unit = TreeUnit(kind="tree", k=2, pivots=1, boundary=StepBoundary(type="tokens", tokens=2), stop_below=0.5,
                    verdict_lag_tokens=0)
    with pytest.raises(ValueError, match="await_verdict"):
        Rows([Chain("a", [1], 8)], unit, text_of=str, eos_ids=set(), stops=[], on_step=lambda c, s: None,  # type: ignore[arg-type]
             verdict=lambda r, s: None, counts=TreeCounts())
