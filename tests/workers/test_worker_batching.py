"""Generation batched across slots (workers/batching.py) on the real hf backend and a tiny model.

Slots are threads, as in the worker. What a batched call returns must be what each slot would
get on its own: every row at its own budget, its tokens' logprobs those of the model given the
row's own prompt and prefix (reference: a full forward pass, as in test_worker_sampling.py),
whatever else shared the call.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator

import pytest
import torch
from pydantic import ValidationError

from decentrl.api.wire import RunInfo, SamplingParams
from decentrl.config import TinyModelConfig, WorkerConfig
from decentrl.model.build import build_model
from decentrl.rl.determinism import sample_seed, use_deterministic_torch
from tests.workers.test_worker_sampling import TINY, reference_logprobs, write_version
from workers.backends import Completion, never
from workers.backends.hf import HFBackend
from workers.batching import Batcher, Request, batches
from workers.sample import Sample
from workers.worker import fixed_rows


class Recording:
    """The hf backend, recording the rows and budget of every generate call."""

    def __init__(self, inner: HFBackend) -> None:
        self.inner = inner
        self.calls: list[tuple[list[list[int]], int]] = []

    @property
    def version(self) -> int | None:
        return self.inner.version

    def load(self, checkpoint_dir: str, version: int) -> None:
        self.inner.load(checkpoint_dir, version)

    def generate(
        self,
        prompts: list[list[int]],
        sampling: SamplingParams,
        should_stop: Callable[[], bool] = never,
        seeds: list[int] | None = None,
    ) -> list[Completion]:
        self.calls.append((prompts, sampling.max_tokens))
        return self.inner.generate(prompts, sampling, should_stop, seeds=seeds)


class OutOfMemory(Recording):
    """The hf backend whose generate fails, as a decode too large for the device would."""

    def generate(
        self, prompts: list[list[int]], sampling: SamplingParams, should_stop: Callable[[], bool] = never
    ) -> list[Completion]:
        self.calls.append((prompts, sampling.max_tokens))
        raise RuntimeError("out of memory")


class Gated:
    """A backend that batches concurrent calls itself (a server): each call waits at a barrier
    until `parties` calls are in flight at once (it breaks after 10 s if they never are)."""

    version = 3

    def __init__(self, parties: int) -> None:
        self.barrier = threading.Barrier(parties, timeout=10)
        self.calls: list[list[list[int]]] = []

    def generate(
        self, prompts: list[list[int]], sampling: SamplingParams, should_stop: Callable[[], bool] = never
    ) -> list[Completion]:
        self.calls.append(prompts)
        self.barrier.wait()
        return [Completion([7] * sampling.max_tokens, [-0.5] * sampling.max_tokens, "length") for _ in prompts]


class UntilStopped:
    """A backend whose call samples a token every 10 ms until `should_stop` (then "interrupted")
    or the budget; `started` is set when a call begins."""

    def __init__(self) -> None:
        self.version = 1
        self.calls = 0
        self.started = threading.Event()

    def generate(
        self, prompts: list[list[int]], sampling: SamplingParams, should_stop: Callable[[], bool] = never
    ) -> list[Completion]:
        self.calls += 1
        self.started.set()
        tokens = 0
        while tokens < sampling.max_tokens and not should_stop():
            time.sleep(0.01)
            tokens += 1
        finish = "length" if tokens == sampling.max_tokens else "interrupted"
        return [Completion([5] * tokens, [-0.1] * tokens, finish) for _ in prompts]


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> tuple[torch.nn.Module, str]:
    model = build_model(TINY)
    model.generation_config.eos_token_id = None  # every row runs to its budget
    return model.eval(), write_version(str(tmp_path_factory.mktemp("v0")), model)


@pytest.fixture
def backend(model: tuple[torch.nn.Module, str]) -> Recording:
    hf = HFBackend(seed=0)
    hf.load(model[1], 7)
    return Recording(hf)


def run_slots(batcher: Batcher, backend: Recording | Gated, requests: list[Request]) -> None:
    """Each request's slot leads while its request is not done, as Worker._complete does (no
    lock beside the batcher's: it lets one round run at a time when it combines)."""

    def slot(request: Request) -> None:
        while batcher.lead(request):
            assert backend.version is not None
            batcher.generate_next(backend, backend.version, never, own=request)  # type: ignore[arg-type]

    threads = [threading.Thread(target=slot, args=(request,)) for request in requests]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert all(request.done and request.error is None for request in requests)


@pytest.mark.kernels
def test_queued_slots_share_one_call_and_get_what_each_would_alone(
    backend: Recording, model: tuple[torch.nn.Module, str]
) -> None:
    sampling = SamplingParams(temperature=1.0, max_tokens=6, top_k=5)
    batcher = Batcher(max_rows=64)
    prompts = [[1, 7, 5, 8, 5, 3], [1, 4, 3], [1, 12, 11, 10, 9, 8, 7, 3], [1, 9, 3]]
    # Four slots, one group of 3 rows each, all queued before any leads.
    requests = [batcher.submit([Sample(prompt=p, budget=6) for _ in range(3)], sampling) for p in prompts]
    run_slots(batcher, backend, requests)
    assert len(backend.calls) == 1
    rows, budget = backend.calls[0]
    assert rows == [p for p in prompts for _ in range(3)] and budget == 6
    for request, prompt in zip(requests, prompts, strict=True):
        for sample in request.rows:
            assert len(sample.token_ids) == 6 and sample.finish_reason == "length"
            assert sample.versions == [7] * 6
            assert sample.masks is not None and len(sample.masks) == 6
            expected = reference_logprobs(model[0], prompt, sample.token_ids, sampling)
            assert sample.logprobs == pytest.approx(expected, abs=2e-4)


def test_rows_are_grouped_by_tokens_left_and_sampling_and_capped(backend: Recording) -> None:
    plain = SamplingParams(temperature=1.0, max_tokens=8)
    hot = SamplingParams(temperature=1.5, max_tokens=8)
    batcher = Batcher(max_rows=5)
    # A continued row (3 tokens already sampled, 5 left) and fresh rows (8 left); two samplings.
    continued = Sample(prompt=[1, 5, 3], budget=8, token_ids=[4, 4, 4], logprobs=[-1.0] * 3, versions=[6] * 3)
    requests = [
        batcher.submit([Sample(prompt=[1, 5, 3], budget=8), continued], plain),
        batcher.submit([Sample(prompt=[1, 6, 3], budget=8) for _ in range(2)], hot),
        batcher.submit([Sample(prompt=[1, 7, 3], budget=8) for _ in range(2)], plain),
    ]
    run_slots(batcher, backend, requests)
    # 6 rows > 5: the first lead takes the first two requests (4 rows), the next the third.
    assert [(len(rows), budget) for rows, budget in backend.calls] == [(1, 8), (1, 5), (2, 8), (2, 8)]
    assert backend.calls[1][0] == [[1, 5, 3, 4, 4, 4]]
    assert len(continued.token_ids) == 8 and continued.versions == [6] * 3 + [7] * 5
    assert all(len(s.token_ids) == 8 for r in requests for s in r.rows)


def test_one_slot_larger_than_the_cap_is_cut_into_calls(backend: Recording) -> None:
    batcher = Batcher(max_rows=4)
    rows = [Sample(prompt=[1, 5, 3], budget=3) for _ in range(10)]
    request = batcher.submit(rows, SamplingParams(temperature=1.0, max_tokens=3))
    run_slots(batcher, backend, [request])
    assert [len(rows) for rows, _ in backend.calls] == [4, 4, 2]
    assert all(len(s.token_ids) == 3 for s in request.rows)


def test_a_backend_error_reaches_every_slot_of_its_batch(backend: Recording) -> None:
    batcher = Batcher(max_rows=64)
    sampling = SamplingParams(temperature=1.0, max_tokens=3)
    requests = [batcher.submit([Sample(prompt=[1, 5, 3], budget=3)], sampling) for _ in range(3)]
    failing = OutOfMemory(backend.inner)
    errors: list[BaseException] = []

    def slot(request: Request) -> None:
        try:
            while batcher.lead(request):
                batcher.generate_next(failing, 7, never)  # type: ignore[arg-type]
            request.raise_error()
        except RuntimeError as exc:
            errors.append(exc)

    threads = [threading.Thread(target=slot, args=(r,)) for r in requests]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert [str(e) for e in errors] == ["out of memory"] * 3
    assert [len(rows) for rows, _ in failing.calls] == [3]  # one batch: every slot's error is that call's


def test_a_version_the_lead_cannot_load_fails_only_its_own_requests() -> None:
    """Deterministic runs: when the lead cannot load the head's version (refused: tampered or
    unloadable), every slot waiting on that version gets the error at once (and hands its leases
    back); requests of other versions stay queued and another lead serves them."""
    batcher = Batcher(max_rows=64)
    sampling = SamplingParams(temperature=1.0, max_tokens=3)
    bad = [batcher.submit([Sample(prompt=[1, 5, 3], budget=3)], sampling, 3) for _ in range(2)]
    good = batcher.submit([Sample(prompt=[1, 5, 3], budget=3)], sampling, 4)
    assert batcher.lead(bad[0])  # this slot leads the round of version 3
    batcher.fail_next(RuntimeError("version 3 cannot be loaded"))
    for request in bad:
        assert not batcher.lead(request)  # done: no slot waits for a round that will never come
        with pytest.raises(RuntimeError, match="version 3 cannot be loaded"):
            request.raise_error()
    assert batcher.next_version() == 4 and not good.done
    assert batcher.lead(good)  # the lead passed on


def test_a_backend_that_batches_requests_itself_is_called_by_every_slot_at_once() -> None:
    """Not combining (an OpenAI-compatible server batches concurrent requests itself): every
    slot's round runs at once, each with its own rows only; combined, the barrier would break."""
    batcher = Batcher(max_rows=64, combine=False)
    sampling = SamplingParams(temperature=1.0, max_tokens=2)
    requests = [batcher.submit([Sample(prompt=[1, i], budget=2) for _ in range(2)], sampling) for i in range(3)]
    backend = Gated(3)
    run_slots(batcher, backend, requests)
    assert sorted(backend.calls) == [[[1, i]] * 2 for i in range(3)]
    assert all(s.token_ids == [7, 7] and s.versions == [3, 3] for r in requests for s in r.rows)


@pytest.mark.parametrize("combine", [True, False])
def test_a_swap_holds_new_rounds_back_and_interrupts_the_one_in_flight_at_its_deadline(combine: bool) -> None:
    """The soft pause: the swap's block runs once the round in flight ended, interrupted at the
    deadline (its rows go on after the swap, under the new version); a round asked for meanwhile
    waits for the swap to end."""
    batcher = Batcher(max_rows=8, combine=combine)
    backend = UntilStopped()

    def slot(request: Request) -> None:
        while batcher.lead(request):
            assert backend.version is not None
            batcher.generate_next(backend, backend.version, own=request)  # type: ignore[arg-type]

    first = batcher.submit([Sample(prompt=[1], budget=1000)], SamplingParams(temperature=1.0, max_tokens=1000))
    threading.Thread(target=slot, args=(first,), daemon=True).start()
    assert backend.started.wait(10)
    asked = time.monotonic()
    with batcher.swapping(0.3):
        assert time.monotonic() - asked >= 0.3 and first.done and batcher.paused
        (row,) = first.rows
        assert row.finish_reason is None and row.token_ids and set(row.versions) == {1}  # interrupted, to go on
        second = batcher.submit([Sample(prompt=[2], budget=3)], SamplingParams(temperature=1.0, max_tokens=3))
        waiting = threading.Thread(target=slot, args=(second,), daemon=True)
        waiting.start()
        time.sleep(0.3)
        assert backend.calls == 1 and not second.done  # held back while the swap runs
        backend.version = 2
    waiting.join(10)
    assert second.done and second.rows[0].versions == [2, 2, 2] and not batcher.paused and not batcher.pause_due()


def seeded_group(prompt: list[int], prompt_id: int, size: int = 4, budget: int = 8) -> list[Sample]:
    """One deterministic group: `size` rows of `prompt`, each seeded as a worker seeds them."""
    return [
        Sample(
            prompt=prompt, budget=budget, seed=sample_seed(0, prompt_id, j, 7), index=j, group=f"g{prompt_id}", version=7
        )
        for j in range(size)
    ]


@pytest.fixture(scope="module")
def demo_model(tmp_path_factory: pytest.TempPathFactory) -> str:
    """The demo's model size (configs/local.toml): unlike TINY, its CPU forward was not
    batch-invariant (2026-11-24), so the control below could see a shape change."""
    model = build_model(TinyModelConfig(hidden_size=128, num_layers=2, num_heads=4, intermediate_size=256, seed=0))
    return write_version(str(tmp_path_factory.mktemp("demo")), model)


@pytest.fixture
def deterministic_torch() -> Iterator[None]:
    """The kernel settings a deterministic run's worker applies (`use_deterministic_torch`), at 2
    threads (where the flash attention kernel made a row depend on its place in the call), put
    back afterwards for the rest of the session."""
    saved = (torch.get_num_threads(), torch.are_deterministic_algorithms_enabled(), torch.backends.cudnn.benchmark,
             torch.backends.cudnn.deterministic, torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32,
             torch.backends.cuda.flash_sdp_enabled())
    use_deterministic_torch(2)
    yield
    threads, algorithms, benchmark, cudnn_deterministic, matmul_tf32, cudnn_tf32, flash = saved
    torch.set_num_threads(threads)
    torch.use_deterministic_algorithms(algorithms)
    torch.backends.cudnn.benchmark, torch.backends.cudnn.deterministic = benchmark, cudnn_deterministic
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = matmul_tf32, cudnn_tf32
    torch.backends.cuda.enable_flash_sdp(flash)


def test_a_round_of_its_own_hears_when_a_swap_or_another_slot_waits_for_it() -> None:
    # A tree round that could go on across lease answers ends when `wanted`: a slot waiting for a
    # round (here another round of its own), or a swap waiting for the round to end.
    batcher = Batcher(max_rows=4)

    def waits_then_gets(enter: Callable[[], object]) -> None:
        with enter():  # type: ignore[attr-defined]
            pass

    for waiter in (batcher.round_of_its_own, lambda: batcher.swapping(60.0)):
        thread = threading.Thread(target=waits_then_gets, args=(waiter,), daemon=True)
        with batcher.round_of_its_own():
            assert not batcher.wanted()
            thread.start()
            deadline = time.monotonic() + 10
            while not batcher.wanted() and time.monotonic() < deadline:
                time.sleep(0.001)
            assert batcher.wanted()
        thread.join(timeout=10)
        assert not thread.is_alive() and not batcher.wanted()  # it had its turn: nobody waits


@pytest.mark.usefixtures("deterministic_torch")
@pytest.mark.kernels
def test_a_group_is_bitwise_the_same_alone_or_beside_other_groups_at_the_fixed_shape(demo_model: str) -> None:
    """Deterministic runs: a group's tokens and logprobs are bitwise equal whether it is
    generated alone (the call filled with repeats of its rows), beside other groups, or in
    another place of the call, because every call has the same shape (workers/batching.py).
    The control: the same group alone in a call of its own size (no filler) differs."""
    hf = HFBackend(seed=0)  # eos kept: rows finish at different steps, as in a run
    hf.load(demo_model, 7)
    backend = Recording(hf)
    sampling = SamplingParams(temperature=1.0, max_tokens=8)
    prompts = {i: [1, 4 + i % 9, 5 + i % 7, 3, 6 + i % 5, 7] for i in range(8)}

    def generate(*ids: int, fixed_rows: int | None) -> dict[int, list[Sample]]:
        batcher = Batcher(max_rows=64, fixed_rows=fixed_rows)
        groups = {i: seeded_group(prompts[i], i) for i in ids}
        requests = [batcher.submit(group, sampling, 7) for group in groups.values()]  # one slot per group
        run_slots(batcher, backend, requests)
        return groups

    def bits(group: list[Sample]) -> list[tuple[list[int], list[float]]]:
        return [(s.token_ids, s.logprobs) for s in group]

    alone = generate(0, fixed_rows=12)[0]
    assert [len(rows) for rows, _ in backend.calls] == [12]  # 4 rows + 8 filler
    beside = generate(1, 0, 2, fixed_rows=12)[0]
    among_others = generate(3, 4, 0, 5, 6, fixed_rows=12)[0]  # two calls: 3,4,0 then 5,6 filled
    assert all(len(rows) == 12 for rows, _ in backend.calls)
    assert bits(beside) == bits(alone) and bits(among_others) == bits(alone)
    unfilled = generate(0, fixed_rows=None)[0]  # 4 rows: another shape
    assert len(backend.calls[-1][0]) == 4
    if shape_changes_logits(hf, [s.prompt + s.token_ids for s in alone]):  # the shape is what must be fixed
        assert [s.logprobs for s in unfilled] != [s.logprobs for s in alone]


def shape_changes_logits(hf: HFBackend, rows: list[list[int]]) -> bool:
    """Whether this machine's forward gives `rows` other logits in a call of 3x as many rows (with
    the deterministic settings on, it can be shape-invariant too: then the control above has
    nothing to see; on the machine of 2026-11-24 it was not)."""
    width = min(len(row) for row in rows)  # rows that stopped early are ragged
    ids = torch.tensor([row[:width] for row in rows])
    with torch.inference_mode():
        alone = hf.model(input_ids=ids, use_cache=False).logits
        among = hf.model(input_ids=torch.cat([ids] * 3), use_cache=False).logits[: len(rows)]
    return not torch.equal(alone, among)


@pytest.mark.usefixtures("deterministic_torch")
@pytest.mark.kernels
def test_rows_of_an_abandoned_group_are_dropped_before_their_round_and_the_rest_stay_bitwise(demo_model: str) -> None:
    """A hedge's losing copy (its lease told lost) queued beside other groups: its rows leave the
    queue before the round and are never generated; the call keeps its fixed shape (filler
    repeats the remaining rows), so the group beside it is bitwise what it is alone. A request
    left with no rows is done without a round; one with rows left gets them generated."""
    hf = HFBackend(seed=0)
    hf.load(demo_model, 7)
    backend = Recording(hf)
    sampling = SamplingParams(temperature=1.0, max_tokens=8)
    prompts = {i: [1, 4 + i % 9, 5 + i % 7, 3, 6 + i % 5, 7] for i in range(3)}

    def bits(group: list[Sample]) -> list[tuple[list[int], list[float]]]:
        return [(s.token_ids, s.logprobs) for s in group]

    alone = seeded_group(prompts[0], 0)
    batcher = Batcher(max_rows=64, fixed_rows=12)
    run_slots(batcher, backend, [batcher.submit(alone, sampling, 7)])
    lost = {"g1", "g2"}
    batcher = Batcher(max_rows=64, fixed_rows=12, abandoned=lambda group: group in lost)
    kept, dropped, other = (seeded_group(prompts[i], i) for i in range(3))
    # One slot holding two leases (place 1's copy lost), another holding only a lost one.
    both, only_lost = batcher.submit(kept + dropped, sampling, 7), batcher.submit(other, sampling, 7)
    run_slots(batcher, backend, [both, only_lost])
    assert [len(rows) for rows, _ in backend.calls] == [12, 12]  # one call each time, the same shape
    assert backend.calls[1][0] == [prompts[0]] * 12  # the kept group and its filler, nothing of the lost
    assert both.rows == kept and only_lost.rows == []
    assert all(s.token_ids == [] and s.finish_reason is None for s in dropped + other)
    assert bits(kept) == bits(alone)


def test_deterministic_calls_are_whole_groups_of_one_prompt_length_filled_to_the_shape() -> None:
    short, long = [1, 5, 3], [1, 5, 6, 3]
    groups = [seeded_group(short, 0, 2), seeded_group(long, 1, 2), seeded_group(short, 2, 2), seeded_group(short, 3, 2)]
    sampling = SamplingParams(temperature=1.0, max_tokens=8)
    requests = [Request(group, sampling, 7) for group in groups]
    calls = batches(requests, max_rows=64, fixed_rows=4)
    assert [([s.group for s in call.rows], call.filler) for call in calls] == [
        (["g0", "g0", "g2", "g2"], 0), (["g3", "g3"], 2), (["g1", "g1"], 2)
    ]
    assert calls[1].prompts() == [short] * 4 and calls[1].seeds() == [s.seed for s in groups[3]] * 2
    assert [len(c.rows) for c in batches(requests, max_rows=64)] == [2, 2, 2, 2]  # no shape: a group per call
    with pytest.raises(ValueError, match="does not fit a fixed shape of 1 rows"):
        batches(requests, max_rows=64, fixed_rows=1)


def test_a_round_takes_every_queued_request_of_the_heads_version(backend: Recording) -> None:
    """Deterministic runs: requests of two versions interleaved in the queue are served in two
    rounds (one load each), not one per change of version."""
    batcher = Batcher(max_rows=64, fixed_rows=8)
    sampling = SamplingParams(temperature=1.0, max_tokens=3)
    versions = [7, 8, 7, 8]
    requests = [batcher.submit(seeded_group([1, 5, 3], i, 2, 3), sampling, v) for i, v in enumerate(versions)]
    assert batcher.lead(requests[0])
    batcher.generate_next(backend, 7, never)  # type: ignore[arg-type]
    assert [r.done for r in requests] == [True, False, True, False]
    assert batcher.next_version() == 8 and len(backend.calls) == 1 and len(backend.calls[0][0]) == 8


def test_a_head_abandoned_after_its_version_was_loaded_leaves_the_other_version_queued(backend: Recording) -> None:
    """The lead loaded version 7 for the head; the head is told lost before the round: the round
    generates nothing under 7's weights for the version-8 request behind it (its rows would be
    labelled 7 and refused as wrong_version), and the lead passes on for 8 to be loaded."""
    lost: set[str] = set()
    batcher = Batcher(max_rows=64, fixed_rows=8, abandoned=lambda group: group in lost)
    sampling = SamplingParams(temperature=1.0, max_tokens=3)
    head, behind = (batcher.submit(seeded_group([1, 5, 3], i, 2, 3), sampling, v) for i, v in enumerate([7, 8]))
    assert batcher.lead(head) and batcher.next_version() == 7
    lost.add("g0")  # told while the lead loads version 7
    batcher.generate_next(backend, 7, never)  # type: ignore[arg-type]
    assert backend.calls == [] and head.done and not behind.done
    assert batcher.next_version() == 8 and batcher.lead(behind)  # the lead is free: the next loads 8
    batcher.generate_next(backend, 8, never)  # type: ignore[arg-type]
    assert behind.done and all(s.versions == [8, 8, 8] for s in behind.rows)


def test_a_shape_over_max_batch_rows_is_refused_with_the_fix() -> None:
    info = RunInfo(
        run_name="r", store_url="file:///s", policy_version=None, max_staleness=1, group_size=8, deterministic=True
    )
    assert fixed_rows(info, WorkerConfig(deterministic_groups_per_call=4)) == 32
    assert fixed_rows(info.model_copy(update={"deterministic": False}), WorkerConfig()) is None
    with pytest.raises(ValueError, match="lower worker.deterministic_groups_per_call"):
        fixed_rows(info, WorkerConfig(deterministic_groups_per_call=8, max_batch_rows=32))
    with pytest.raises(ValidationError, match="deterministic_groups_per_call"):
        WorkerConfig(deterministic_groups_per_call=0)
    with pytest.raises(ValidationError, match="deterministic_groups_per_call"):
        WorkerConfig.model_validate({"deterministic_groups_per_call": "8 groups"})


def test_max_rows_below_one_is_refused() -> None:
    with pytest.raises(ValueError, match="max_batch_rows must be at least 1"):
        Batcher(max_rows=0)


def test_worker_progress_line_says_version_accepted_rate_and_rejections(caplog: pytest.LogCaptureFixture) -> None:
    from decentrl.api.wire import IngestResponse, Rejection, Rollout, RolloutBatch, SamplingParams
    from workers.worker import Progress

    now = [0.0]
    progress = Progress(interval_s=10.0, clock=lambda: now[0])
    rollout = Rollout(rollout_id="r", run_name="x", lease_id="l", prompt_id=0, worker_id="w", policy_version=3,
                      prompt_token_ids=[1], completion_token_ids=[1] * 50, logprobs=[-0.1] * 50, finish_reason="stop",
                      sampling=SamplingParams(temperature=1.0, max_tokens=50))
    batch = RolloutBatch(rollouts=[rollout, rollout.model_copy(update={"rollout_id": "s"})])
    with caplog.at_level("INFO", logger="decentrl.worker.progress"):
        now[0] = 5.0
        progress.posted(batch, IngestResponse(accepted=2))
        assert not caplog.records  # not yet: one line every interval_s
        now[0] = 10.0
        progress.posted(batch, IngestResponse(accepted=1, rejected=[Rejection(rollout_id="s", reason="stale")]))
    (record,) = caplog.records
    assert record.getMessage() == "progress: v3  rollouts accepted 3  20 tokens/s  rejected: stale 1"
