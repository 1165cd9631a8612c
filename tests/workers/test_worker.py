"""The worker against a real orchestrator (aiohttp app on loopback, in a thread) and a real
file:// checkpoint store with versions published as the trainer publishes them.

Covers: multi-turn episodes played by the worker and replayed by the orchestrator; sampling
masks accepted end to end; soft-pause swaps producing partial rollouts whose
tokens carry their versions and the logprobs of the version that sampled them; spooling while
the orchestrator is down and resending after it is back; generating on with a fresh version
while the store is unreachable and waiting once it is stale; slots waiting together generated
in one backend call.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from aiohttp import web

from decentrl.api.client import OrchestratorClient
from decentrl.api.wire import LeaseRequest
from decentrl.config import GuessTaskConfig, RunConfig, SimulationConfig, TinyModelConfig, WorkerConfig, parse_config
from decentrl.model.build import build_model, build_tiny_tokenizer
from decentrl.model.stopping import ends_generation
from decentrl.store.checkpoints import CheckpointStore
from decentrl.store.weights import write_hf_dir
from decentrl.tasks import build_task
from decentrl.tasks.episodes import replay_episode, split_turns, tokenizer_codec
from decentrl.tasks.guess import GuessTask
from orchestrator.app import create_app
from orchestrator.auth import TokenRegistry
from orchestrator.state import RunState
from tests.trainer.test_episode_loss_mask import gradients as loss_mask_gradients
from tests.workers.hanging_worker import Hanging
from tests.workers.test_worker_batching import Recording
from workers.backends.hf import HFBackend, sampling_distribution
from workers.worker import Worker

pytestmark = pytest.mark.integration  # real servers and worker processes on loopback

WORKER, TRAINER = "worker-secret", "trainer-secret"
TOKENS = [{"name": "vol", "role": "worker", "token": WORKER}, {"name": "trainer", "role": "trainer", "token": TRAINER}]
TINY = {"type": "tiny", "hidden_size": 32, "num_layers": 1, "num_heads": 2, "intermediate_size": 64}


def run_config(task: dict[str, Any] | None = None, orchestrator: dict[str, Any] | None = None, **sampling: Any) -> RunConfig:
    return parse_config(
        {
            "run_name": "worker-test",
            "group_size": 2,
            "max_staleness": 1,
            "num_workers": 1,
            "trainer_ranks": 1,
            "model": TINY,
            "task": task or {"type": "sorting", "num_prompts": 64},
            "sampling": {"temperature": 1.0, "max_tokens": 6, **sampling},
            "orchestrator": {"host": "127.0.0.1", "port": 0, "journal": False, "batch_wait_s": 0.2, **(orchestrator or {})},
            "trainer": {"groups_per_step": 2, "steps": 3},
        }
    )


class Orchestrator:
    """The real app on 127.0.0.1 in a background event loop; stop() and start() keep its state."""

    def __init__(self, config: RunConfig, store_url: str) -> None:
        self.state = RunState(config=config, task=build_task(config.task), tokenizer=build_tiny_tokenizer())
        self.store_url = store_url
        self.port = 0
        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self.loop.run_forever, daemon=True).start()
        self.runner: web.AppRunner | None = None

    def _call(self, coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout=30)

    def start(self) -> None:
        async def up() -> None:
            app = create_app(state=self.state, tokens=TokenRegistry(TOKENS), store_url=self.store_url)
            self.runner = web.AppRunner(app)
            await self.runner.setup()
            await web.TCPSite(self.runner, "127.0.0.1", self.port).start()
            self.port = self.runner.addresses[0][1]

        self._call(up())

    def stop(self) -> None:
        assert self.runner is not None
        self._call(self.runner.cleanup())

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def client(self, token: str, max_wait_s: float = 5.0) -> OrchestratorClient:
        return OrchestratorClient(self.url, token, timeout_s=30.0, max_wait_s=max_wait_s)


@dataclass
class Setup:
    orchestrator: Orchestrator
    store: CheckpointStore
    store_dir: str
    tmp: str
    models: dict[int, torch.nn.Module]

    def publish(self, version: int, seed: int, *, eos: bool = True) -> None:
        model = build_model(TinyModelConfig(**{k: v for k, v in TINY.items() if k != "type"}, seed=seed))
        if not eos:  # completions run to max_tokens: long enough to be caught by a swap
            model.generation_config.eos_token_id = None
        directory = os.path.join(self.tmp, f"publish-{version}")
        os.makedirs(directory)
        build_tiny_tokenizer().save_pretrained(directory)
        model.generation_config.save_pretrained(directory)
        write_hf_dir(directory, model.state_dict(), model.config, extras_from=directory)
        self.store.publish(version, directory, parent=version - 1 if version else None)
        self.orchestrator.client(TRAINER).announce(version)
        self.models[version] = model.eval()

    def worker(self, simulation: SimulationConfig = SimulationConfig(), **settings: Any) -> Worker:
        return Worker(
            WorkerConfig(**{"groups_per_request": 2, **settings}), worker_id="w0", cache_dir=os.path.join(self.tmp, "cache"),
            client=self.orchestrator.client(WORKER, max_wait_s=1.0), backend=HFBackend(seed=0), simulation=simulation,
        )


def make_setup(
    tmp_path: Any, task: dict[str, Any] | None = None, orchestrator_options: dict[str, Any] | None = None, **sampling: Any
) -> Iterator[Setup]:
    store_dir = str(tmp_path / "store")
    orchestrator = Orchestrator(run_config(task, orchestrator_options, **sampling), f"file://{store_dir}")
    orchestrator.start()
    try:
        yield Setup(orchestrator, CheckpointStore(f"file://{store_dir}"), store_dir, str(tmp_path), {})
    finally:
        if orchestrator.runner is not None:
            orchestrator.stop()
        orchestrator.loop.call_soon_threadsafe(orchestrator.loop.stop)


@pytest.fixture
def setup(tmp_path: Any) -> Iterator[Setup]:
    yield from make_setup(tmp_path, top_k=5, top_p=0.95)


@pytest.fixture
def long_setup(tmp_path: Any) -> Iterator[Setup]:
    yield from make_setup(tmp_path, max_tokens=200)


@pytest.fixture
def guess_setup(tmp_path: Any) -> Iterator[Setup]:
    yield from make_setup(tmp_path, {"type": "guess", "max_number": 9, "max_turns": 4, "num_prompts": 64}, max_tokens=16)


def test_worker_plays_episodes_that_the_orchestrator_replays_and_scores(guess_setup: Setup) -> None:
    setup = guess_setup
    setup.publish(0, seed=0)
    worker = setup.worker()
    assert worker.episode_task is not None  # learned from /v1/info: the worker needs no task option
    worker.run(max_iterations=3)
    status = setup.orchestrator.client(WORKER).status()
    assert status.rollouts_rejected == {} and status.rollouts_accepted == worker.rollouts_posted >= 4
    state = setup.orchestrator.state
    scored = [(rollout, reward) for group in state.ready for rollout, reward in group.samples]
    assert scored
    task, codec = GuessTask(GuessTaskConfig(max_number=9, max_turns=4, num_prompts=64)), tokenizer_codec(build_tiny_tokenizer())
    for rollout, reward in scored:
        mask = rollout.loss_mask
        assert mask is not None and mask[0] == 1 and mask[-1] == 1
        # Environment turns are the environment's answers, with logprob 0.
        for model, ids in split_turns(rollout.completion_token_ids, mask)[1::2]:
            assert not model and codec.decode(ids) in {"0=", "1=", "2="}
        assert all(lp == 0.0 for lp, m in zip(rollout.logprobs, mask) if not m)
        # The orchestrator's reward is the replay's (and the worker's claim agrees).
        replayed = replay_episode(task, task.prompt(rollout.prompt_id), rollout.completion_token_ids, mask,
                                  rollout.finish_reason, rollout.sampling, codec,
                                  ends=lambda ids: ends_generation(ids, eos_ids={build_tiny_tokenizer().eos_token_id},
                                                                   stops=rollout.sampling.stop, text_of=codec.decode))
        assert reward == replayed == rollout.claimed_reward
        # Each model token's logprob is v0's, given the prompt and every turn before it.
        ids = torch.tensor([rollout.prompt_token_ids + rollout.completion_token_ids])
        with torch.no_grad():
            logits = setup.models[0](input_ids=ids).logits[0, len(rollout.prompt_token_ids) - 1 : -1]
        dist = sampling_distribution(logits, rollout.sampling)
        expected = dist.gather(-1, torch.tensor(rollout.completion_token_ids)[:, None]).squeeze(-1)
        model_positions = [i for i, m in enumerate(mask) if m]
        assert [rollout.logprobs[i] for i in model_positions] == pytest.approx(expected[model_positions].tolist(), abs=2e-4)
    assert any(0 in rollout.loss_mask for rollout, _ in scored if rollout.loss_mask)  # some episodes had several turns
    # The trainer gets the masks and trains only model tokens: its gradient ignores the
    # environment tokens' logprobs (tests/trainer/test_episode_loss_mask.py).
    batch = setup.orchestrator.client(TRAINER).batch(0)
    assert batch is not None and all(sample.loss_mask is not None for sample in batch.samples)
    altered = [s.model_copy(update={"logprobs": [lp if m else -7.0 for lp, m in zip(s.logprobs, s.loss_mask or [])]})
               for s in batch.samples]
    for a, b in zip(loss_mask_gradients(batch.samples), loss_mask_gradients(altered), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_worker_posts_truncated_samples_the_orchestrator_accepts(setup: Setup) -> None:
    setup.publish(0, seed=0)
    worker = setup.worker()
    worker.run(max_iterations=3)
    status = setup.orchestrator.client(WORKER).status()
    assert status.rollouts_rejected == {}
    # The orchestrator leases no more groups than the trainer can use fresh: 2 steps' worth here.
    assert status.rollouts_accepted == worker.rollouts_posted >= 4
    samples = [r for lease in setup.orchestrator.state.leases.values() for r in lease.samples]
    samples += [r for group in setup.orchestrator.state.ready for r, _ in group.samples]
    assert samples, "accepted rollouts are held in open leases or ready groups"
    for rollout in samples:
        assert rollout.sampling.top_k == 5 and rollout.sampling_mask is not None
        assert all(t in kept and len(kept) <= 5 for t, kept in zip(rollout.completion_token_ids, rollout.sampling_mask))
    assert worker.spool.pending() == []
    # The masks reach the trainer with its batch (so it truncates its logprobs the same way).
    batch = setup.orchestrator.client(TRAINER).batch(0)
    assert batch is not None and batch.samples
    by_id = {r.rollout_id: r for r in samples}
    for train_sample in batch.samples:
        assert train_sample.sampling_mask == by_id[train_sample.rollout_id].sampling_mask


def test_soft_pause_swap_continues_in_flight_samples_under_the_new_version(long_setup: Setup) -> None:
    setup = long_setup
    setup.publish(0, seed=0, eos=False)
    worker = setup.worker(swap_deadline_s=0.0)  # interrupt in-flight work at once
    worker._swap(setup.store.pull(0, worker.cache_dir), 0, pull_s=0.0)
    response = worker.client.lease(LeaseRequest(worker_id="w0", max_groups=2))
    prompts = [lease.prompt_token_ids for lease in response.leases for _ in range(lease.group_size)]
    result: dict[str, Any] = {}
    generating = threading.Thread(target=lambda: result.update(samples=worker._generate(prompts, response.sampling)))
    generating.start()
    while 0 not in worker.first_generation_at:
        time.sleep(0.001)
    setup.publish(1, seed=1, eos=False)
    worker._swap(setup.store.pull(1, worker.cache_dir), 1, pull_s=0.0)
    generating.join(timeout=120)
    samples = result["samples"]
    for prompt, sample in zip(prompts, samples, strict=True):
        assert len(sample.token_ids) == 200 and sample.finish_reason == "length"
        switch = sample.versions.index(1)
        assert 0 < switch and sample.versions == [0] * switch + [1] * (200 - switch)
        # Each token's logprob is that of the version that sampled it, given the whole prefix.
        ids = torch.tensor([prompt + sample.token_ids])
        for version in (0, 1):
            with torch.no_grad():
                logits = setup.models[version](input_ids=ids).logits[0, len(prompt) - 1 : -1]
            dist = sampling_distribution(logits, response.sampling)
            expected = dist.gather(-1, torch.tensor(sample.token_ids)[:, None]).squeeze(-1).tolist()
            span = slice(0, switch) if version == 0 else slice(switch, 200)
            assert sample.logprobs[span] == pytest.approx(expected[span], abs=2e-4)
    worker._post(response.leases, samples, response.sampling)
    status = worker.client.status()
    assert status.rollouts_rejected == {} and status.rollouts_accepted == len(samples)
    ready = [r for group in setup.orchestrator.state.ready for r, _ in group.samples]
    assert all(r.policy_version == 0 and r.token_versions is not None for r in ready)
    assert worker.swaps[-1].version == 1


def test_rollouts_are_spooled_while_the_orchestrator_is_down_and_resent(setup: Setup) -> None:
    setup.publish(0, seed=0)
    worker = setup.worker()
    worker._swap(setup.store.pull(0, worker.cache_dir), 0, pull_s=0.0)
    response = worker.client.lease(LeaseRequest(worker_id="w0", max_groups=2))
    samples = worker._generate(
        [lease.prompt_token_ids for lease in response.leases for _ in range(lease.group_size)], response.sampling
    )
    setup.orchestrator.stop()
    worker._post(response.leases, samples, response.sampling)  # fails after the client's retries
    assert len(worker.spool.pending()) == 1
    assert worker.rollouts_posted == 0
    setup.orchestrator.start()  # same port, same state: leases still open
    worker.spool.resend()
    assert worker.spool.pending() == []
    assert worker.rollouts_posted == 4
    assert worker.client.status().rollouts_accepted == 4


def test_store_outage_keeps_a_fresh_version_and_waits_once_stale(
    setup: Setup, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    import workers.worker as worker_module

    monkeypatch.setattr(worker_module, "_STALE_SAY_S", 0.5)  # how often the waiting worker says why
    setup.publish(0, seed=0)
    worker = setup.worker(version_poll_s=0.2)
    trainer = setup.orchestrator.client(TRAINER)
    trainer_version = 0
    deadline = time.time() + 240

    trained: set[int] = set()

    def train_until(done: Any) -> None:
        """Act as the trainer: take one batch per version, as a real trainer does (the
        orchestrator's lease budget assumes it), so leasing goes on, until `done()`."""
        while not done() and time.time() < deadline:
            if trainer_version in trained:
                time.sleep(0.2)
            elif trainer.batch(trainer_version) is not None:
                trained.add(trainer_version)
        assert done()

    def wait_until(done: Any) -> None:
        while not done() and time.time() < deadline:
            time.sleep(0.1)
        assert done()

    thread = threading.Thread(target=worker.run, daemon=True)
    thread.start()
    # Spend v0's whole lease budget ((0 + 1 + 1) * 2 groups = 8 rollouts) so that the worker is
    # idle when v1 comes: v1 adds room for exactly 2 groups, which it can only have generated
    # after the announcement. (Counting from 4 raced: a fast worker used those 2 groups before
    # the count below was taken, and with the budget spent nothing more could come.)
    train_until(lambda: worker.rollouts_posted >= 8)
    hidden = setup.store_dir + ".away"
    shutil.move(setup.store_dir, hidden)  # the store is unreachable from now on
    setup.store = CheckpointStore(f"file://{hidden}")  # (the trainer publishes elsewhere meanwhile)
    setup.publish(1, seed=1)  # v1 announced but cannot be pulled: v0 is still fresh (staleness 1)
    trainer_version = 1
    wait_until(lambda: worker.rollouts_posted >= 8 + 4)  # v1's 2 groups, generated at v0 after it was announced
    assert worker.announced == 1
    assert worker.backend.version == 0
    setup.publish(2, seed=2)  # now v0 is two behind: the worker must stop generating with it
    trainer_version = 2
    train_until(lambda: worker.announced == 2)
    time.sleep(1.0)  # a generation already in flight may still finish
    held = worker.rollouts_posted
    time.sleep(1.5)
    assert worker.rollouts_posted == held and worker.backend.version == 0
    said = [r.getMessage() for r in caplog.records if "no lease" in r.getMessage()]
    assert said and said[-1].startswith("version 0 loaded, 2 announced: more than max_staleness = 1 behind, so no lease")
    shutil.move(hidden, setup.store_dir)  # the store is back
    train_until(lambda: worker.rollouts_posted > held)
    assert worker.backend.version == 2
    worker.request_stop()
    thread.join(timeout=60)
    assert not thread.is_alive()
    rejected = worker.client.status().rollouts_rejected
    assert rejected.get("stale", 0) <= 4, rejected  # at most the generation in flight when v2 came


def test_slots_waiting_together_are_generated_in_one_backend_call(setup: Setup) -> None:
    setup.publish(0, seed=0)
    worker = setup.worker(concurrency=4)
    worker._swap(setup.store.pull(0, worker.cache_dir), 0, pull_s=0.0)
    response = worker.client.lease(LeaseRequest(worker_id="w0", max_groups=2))
    prompts = [lease.prompt_token_ids for lease in response.leases for _ in range(lease.group_size)]
    recording = Recording(worker.backend)  # type: ignore[arg-type]
    worker.backend = recording
    results: list[list[Any]] = [[] for _ in range(4)]
    with worker._batcher.swapping(60.0):  # a swap under way: the four slots queue their rows meanwhile
        slots = [threading.Thread(target=lambda i=i: results[i].extend(worker._generate(prompts, response.sampling)))
                 for i in range(4)]
        for slot in slots:
            slot.start()
        while len(worker._batcher._queue) < 4:
            time.sleep(0.001)
    for slot in slots:
        slot.join(timeout=60)
    assert [len(rows) for rows, _ in recording.calls] == [4 * len(prompts)]
    for samples in results:
        assert len(samples) == len(prompts)
        for sample in samples:
            assert sample.finish_reason in ("stop", "length") and 1 <= len(sample.token_ids) <= 6
            assert sample.versions == [0] * len(sample.token_ids)
            assert sample.masks is not None and len(sample.masks) == len(sample.token_ids)
    worker._post(response.leases, results[0], response.sampling)
    assert worker.client.status().rollouts_accepted == len(prompts)


@pytest.fixture
def tree_setup(tmp_path: Any, request: pytest.FixtureRequest) -> Iterator[Setup]:
    yield from make_setup(  # steps of 3 tokens, or of request.param (indirect parametrization)
        tmp_path, {"type": "chain", "num_digits": 4, "num_prompts": 64},
        {"tree": {"k": 2, "pivots": 1, "boundary": "tokens", "step_tokens": getattr(request, "param", 3)}}, max_tokens=12,
    )


def test_the_worker_plays_tree_leases_step_by_step(tree_setup: Setup, monkeypatch: pytest.MonkeyPatch) -> None:
    """`decentrl worker`'s loop hands tree leases to workers/tree.py (the request's two units'
    roots decoded together): their steps posted as they finish, and the whole units (roots and one
    pivot's branches) accepted by the node rules."""
    import workers.tree as tree

    widths: list[int] = []
    start = tree.start_together
    monkeypatch.setattr(tree, "start_together", lambda plays: (widths.append(len(plays)), start(plays))[1])
    tree_setup.publish(0, seed=0)
    worker = tree_setup.worker()
    worker.run(max_iterations=1)
    assert widths == [2]  # one batch of roots
    status = tree_setup.orchestrator.client(WORKER).status()
    assert status.rollouts_rejected == {} and worker.tree_counts is not None
    short = worker.tree_counts.short  # units whose roots ended without a step boundary: their roots alone
    assert short < 2 and status.rollouts_accepted == worker.rollouts_posted == 2 * (2 + 2) - 2 * short  # group_size 2, k = 2
    assert worker.tree_counts.steps_posted > 0 and worker.spool.pending() == []
    state = tree_setup.orchestrator.state
    samples = [r for group in state.ready for r, _ in group.samples]
    branches = [r for r in samples if r.node is not None]
    assert len(branches) == 2 * (2 - short) and all(len(r.prompt_token_ids) > len(samples[0].prompt_token_ids) for r in branches)


def test_a_backend_that_cannot_decode_step_by_step_hands_tree_leases_back(tree_setup: Setup) -> None:
    """An openai worker (no step-wise decoding: `plays_trees` false) given tree leases refuses
    them: handed back at once, for another worker, and the worker stops saying why."""
    tree_setup.publish(0, seed=0)
    worker = tree_setup.worker(backend="openai", openai={"url": "http://127.0.0.1:9", "model": "m"})
    worker.backend = Hanging()  # loads any version, as the server would; never asked to generate
    with pytest.raises(ValueError, match="the 'openai' backend cannot, so its leases were handed back"):
        worker.run(max_iterations=1)
    assert worker.backend.version == 0 and worker.rollouts_posted == 0
    assert not tree_setup.orchestrator.state.leases  # released, not left to expire


def _record_plays(monkeypatch: pytest.MonkeyPatch, worker: Worker, on_first_start: Any = None) -> list[tuple[str, str, int | None]]:
    """(event, lease id, version loaded) for each tree unit's roots decoded ("start", the version
    before them) and pivots chosen and branches decoded ("finish", the version after them)."""
    import workers.tree as tree

    events: list[tuple[str, str, int | None]] = []
    start, finish = tree.TreePlay.start, tree.TreePlay.finish

    def started(play: Any) -> Any:
        events.append(("start", play.lease.lease_id, worker.backend.version))
        done = start(play)
        if on_first_start is not None and len(events) == 1:
            on_first_start()
        return done

    def finished(play: Any, **kwargs: Any) -> Any:
        samples = finish(play, **kwargs)
        events.append(("finish", play.lease.lease_id, worker.backend.version))
        return samples

    monkeypatch.setattr(tree.TreePlay, "start", started)
    monkeypatch.setattr(tree.TreePlay, "finish", finished)
    return events


def test_the_worker_decodes_the_next_answers_roots_while_an_answers_last_unit_waits(
    tree_setup: Setup, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One group a request: each answer's one unit is its last, and the next answer's roots are
    decoded before its pivots are chosen (the round goes on across answers), every unit accepted."""
    tree_setup.publish(0, seed=0)
    worker = tree_setup.worker(groups_per_request=1)
    events = _record_plays(monkeypatch, worker)
    worker.run(max_iterations=3)
    order = [(event, lease_id) for event, lease_id, _ in events]
    leases = list(dict.fromkeys(lease_id for _, lease_id in order))
    assert len(leases) == 3, order
    for earlier, later in zip(leases, leases[1:]):
        assert order.index(("start", later)) < order.index(("finish", earlier)), order
    status = tree_setup.orchestrator.client(WORKER).status()
    assert status.rollouts_rejected == {} and status.rollouts_accepted == worker.rollouts_posted == 3 * (2 + 2)
    assert not tree_setup.orchestrator.state.leases and worker.spool.pending() == []


def test_a_swap_waits_for_the_units_in_play_and_the_round_goes_on_after_it(
    tree_setup: Setup, monkeypatch: pytest.MonkeyPatch
) -> None:
    """v1 is pulled while the first unit's roots are decoded: the round asks no further answer
    (its swap waits), finishes that unit at v0, the swap lands, and the next answers play at v1 -
    never a swap between a unit's roots and its branches."""
    setup = tree_setup
    setup.publish(0, seed=0)
    worker = setup.worker(groups_per_request=1, version_poll_s=0.2)

    def swap_due() -> None:
        setup.publish(1, seed=1)
        deadline = time.time() + 60
        while not worker._batcher.paused and time.time() < deadline:
            time.sleep(0.01)
        assert worker._batcher.paused  # the swapper pulled v1 and waits for the round

    events = _record_plays(monkeypatch, worker, on_first_start=swap_due)
    worker.run(max_iterations=3)
    versions: dict[str, set[int | None]] = {}
    for _, lease_id, version in events:
        versions.setdefault(lease_id, set()).add(version)
    assert [versions[lease_id] for lease_id in dict.fromkeys(lease_id for _, lease_id, _ in events)] == [{0}, {1}, {1}], events
    order = [(event, lease_id) for event, lease_id, _ in events]
    assert order[:2] == [("start", order[0][1]), ("finish", order[0][1])]  # no answer asked while the swap waited
    later = [lease_id for event, lease_id in order[2:] if event == "start"]
    assert order.index(("start", later[1])) < order.index(("finish", later[0]))  # after it, overlapped again
    status = setup.orchestrator.client(WORKER).status()
    assert status.rollouts_rejected == {} and status.rollouts_accepted == worker.rollouts_posted == 3 * (2 + 2)


def test_an_answer_a_failed_tree_round_could_not_play_is_handed_back(
    tree_setup: Setup, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The round asks for the next answer, cannot play it (here: told it may not), and then fails
    finishing its unit: the answer it holds but never started is handed back at once (its prompt out
    again now, not at its deadline) and no longer renewed, and the error still stops the worker."""
    import workers.tree as tree

    setup = tree_setup
    setup.publish(0, seed=0)
    worker = setup.worker(groups_per_request=1)
    monkeypatch.setattr(Worker, "_in_round", lambda self, response: False)

    def failing(play: Any, **kwargs: Any) -> Any:
        raise RuntimeError("step post failed")

    monkeypatch.setattr(tree.TreePlay, "finish", failing)
    with pytest.raises(RuntimeError, match="step post failed"):
        worker.run(max_iterations=2)
    book = setup.orchestrator.state.lease_book
    closed = {lease_id: book.closed_lease(lease_id) for _, lease_id in book.closed_order}
    assert [c.status for c in closed.values()] == ["released"], closed  # type: ignore[union-attr]
    assert len(book.open) == 1  # the unit that failed: let go, it runs out at its deadline
    assert not worker._held and not worker._renewals._due


# A step of 64 tokens and chains of at most 12: every root is one step, so no unit has a step
# boundary to branch from.
@pytest.mark.parametrize("tree_setup", [64], indirect=True)
def test_a_tree_unit_whose_roots_cannot_branch_is_sent_as_their_group(tree_setup: Setup) -> None:
    """A unit whose roots leave no step boundary (a policy drifted to chains of one step) is sent
    as its roots alone and trains as their group, counted short; none is handed back, none is left
    open to wait for its deadline, so its prompt is not leased again and again."""
    setup = tree_setup
    setup.publish(0, seed=0)
    worker = setup.worker()
    worker.run(max_iterations=1)
    state = setup.orchestrator.state
    assert worker.tree_counts is not None and worker.tree_counts.short == 2  # groups_per_request 2
    assert worker.rollouts_posted == 2 * 2 and worker.spool.pending() == []  # group_size 2, no branch
    assert not state.leases and len(state.ready) == 2
    book = state.lease_book
    assert {book.closed_lease(lease_id).status for _, lease_id in book.closed_order} == {"complete"}  # type: ignore[union-attr]
    assert setup.orchestrator.client(WORKER).status().rollouts_rejected == {}
