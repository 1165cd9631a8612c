"""The worker loop: lease prompts, generate with the loaded version, post; swap weights softly.

Run by `decentrl worker` (workers/main.py). Threads share one condition, `_changed`: the
`concurrency` lease slots (workers/lease_loop.py, generating through workers/batching.py) and, in
free-running runs, one thread that hears of new versions as they are announced (workers/versions.py)
and one swapper that pulls them while generation goes on and swaps them in with a soft pause.
Deterministic runs have neither: the slot leading a round loads the version its leases name. One
more thread renews every lease a slot holds until its samples are posted (`Renewals`), and the
slots ask for as many groups as the worker generates in half the lease timeout (`RequestSize`). A
thread that fails stops the worker, and `run` raises its error.
docs/workers.md tells the whole story.
"""

from __future__ import annotations

import contextlib
import logging
import os
import random
import signal
import statistics
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

from decentrl.api.client import InvalidAnswer, OrchestratorClient, OrchestratorError, Stopped
from decentrl.api.wire import (
    IngestResponse,
    Lease,
    LeaseRequest,
    LeaseResponse,
    Rollout,
    RolloutBatch,
    RunInfo,
    SamplingParams,
    TreeUnit,
    WorkerMachine,
)
from decentrl.backoff import backoff
from decentrl.config import SimulationConfig, StoreConfig, WorkerConfig
from decentrl.rl.determinism import sample_seed
from decentrl.rl.pivots import RecoveryEstimate
from decentrl.rl.staleness import is_fresh
from decentrl.store.checkpoints import CheckpointStore, StoreError, VerificationError, policy_url
from decentrl.tasks.episodes import TextCodec
from workers.backends import BATCHING_ITSELF, Backend
from workers.batching import Batcher
from workers.episodes import episode_task_of, run_episodes
from workers.lease_loop import REQUEST_SHARE, Renewals, RequestSize, Spool, answers, on_signals
from workers.sample import Sample, to_rollout
from workers.simulation import SimulatedLatency
from workers.versions import watch_versions

if TYPE_CHECKING:
    from workers.tree import TreeCounts, VerdictFeed

_STALE_SAY_S = 30.0  # how often a worker too far behind to lease says why
log = logging.getLogger("decentrl.worker")
progress_log = logging.getLogger("decentrl.worker.progress")


@dataclass(frozen=True)
class SwapRecord:
    version: int
    seen_at: float  # time.time() the worker learned of the version
    pull_s: float
    pause_s: float  # new generations held back (waiting for in-flight work, then loading)
    loaded_at: float


class Progress:
    """A worker's own progress, one log line every `interval_s`; updated under `Worker._changed`."""

    def __init__(self, interval_s: float = 10.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.interval_s = interval_s
        self.clock = clock
        self.accepted = 0
        self.tokens = 0
        self.version = -1
        self.rejected: Counter[str] = Counter()
        self.abandoned = 0  # hedging: leases not posted, another copy filled their place first
        self.gone = 0  # leases not posted: a renewal found them closed (expired, or a copy that lost)
        self._mark = (clock(), 0)  # (time, tokens) at the last line

    def posted(self, batch: RolloutBatch, result: IngestResponse) -> None:
        self.accepted += result.accepted
        self.rejected.update(rejection.reason for rejection in result.rejected)
        self.tokens += sum(len(rollout.completion_token_ids) for rollout in batch.rollouts)
        self.version = max(self.version, *(rollout.policy_version for rollout in batch.rollouts))
        now = self.clock()
        if now - self._mark[0] >= self.interval_s:
            progress_log.info("%s", self.line(now))
            self._mark = (now, self.tokens)

    def line(self, now: float) -> str:
        rate = (self.tokens - self._mark[1]) / max(now - self._mark[0], 1e-9)
        rejected = ", ".join(f"{reason} {count}" for reason, count in sorted(self.rejected.items())) or "none"
        abandoned = f"  lost copies abandoned {self.abandoned}" if self.abandoned else ""
        gone = f"  leases gone {self.gone}" if self.gone else ""
        return (
            f"progress: v{self.version}  rollouts accepted {self.accepted}  {rate:.0f} tokens/s  rejected: {rejected}"
            f"{abandoned}{gone}"
        )


class Worker:
    def __init__(
        self,
        config: WorkerConfig,
        *,
        worker_id: str,
        cache_dir: str,
        client: OrchestratorClient,
        backend: Backend,
        store: StoreConfig = StoreConfig(),
        simulation: SimulationConfig = SimulationConfig(),
        spool_dir: str | None = None,
        machine: Callable[[], WorkerMachine] | None = None,
    ) -> None:
        """`machine`: what this worker computes on, sent with every lease request (/v1/status shows it)."""
        self.config = config
        self._machine = machine
        self.worker_id = worker_id
        self.cache_dir = cache_dir
        self.client = client
        self.backend = backend
        self.info: RunInfo = client.info()
        require_routes(self.info, backend)
        self.episode_task = episode_task_of(self.info)  # None: single-turn task
        if self.info.deterministic and self.episode_task is not None:
            raise ValueError(
                f"run {self.info.run_name!r} is deterministic and multi-turn: deterministic runs support "
                "single-turn tasks only (docs/reproducibility.md); set deterministic = false in the run's config"
            )
        self._codec: TextCodec | None = None  # episodes: the model's tokenizer, from the first version loaded
        if (self.info.policies is None) != (config.policy is None) or config.policy not in (self.info.policies or [None]):
            raise ValueError(
                f"worker.policy = {config.policy!r} but run {self.info.run_name!r} has "
                + (f"two policies {self.info.policies}: set worker.policy to one" if self.info.policies else "one: remove it")
            )
        # A run of two policies: the info names this worker's policy's stream; a configured store URL is the run's root.
        url = policy_url(store.url, config.policy) if store.url else self.info.store_url
        self.store = CheckpointStore.from_config(store.for_reader(url), run_name=self.info.run_name)
        self.spool = Spool(spool_dir or os.path.join(cache_dir, "spool", worker_id), self._send)
        self._stop = threading.Event()
        # Guards what the threads share below; notified whenever any of it changes, and on stop.
        self._changed = threading.Condition()
        self.announced: int | None = self.info.policy_version
        self._seen_at: dict[int, float] = {}
        self._store_failing = False  # set by the swapper while pulls fail; slots then keep a fresh older version
        self.refused: dict[int, str] = {}  # version -> why it was not loaded; skipped for good
        # Hedging: the leases the slots hold, and those another copy filled first (`_lost` is
        # replaced whole, so `_post` reads it without the lock).
        self._held: set[str] = set()
        self._lost: frozenset[str] = frozenset()
        # Renewals: every lease held is renewed until let go (posted, handed back, or found closed:
        # then `_gone`, abandoned like a lost copy). `_posting`: leases whose samples are being posted.
        self._renewals = Renewals(
            self._renew, failed=self._renewals_failed, gone=self._lease_gone, passing=(ConnectionError, InvalidAnswer)
        )
        self._gone: set[str] = set()
        self._posting: set[str] = set()
        timeout = self.info.lease_timeout_s
        self.request_size = RequestSize(
            most=config.groups_per_request, target_s=None if timeout is None else REQUEST_SHARE * timeout
        )
        self._errors: list[Exception] = []  # what ended a thread (a slot, the swapper, the renewals): `run` raises the first
        latency = SimulatedLatency.of(simulation, worker_id)
        self._samples_for: Callable[[list[Lease], SamplingParams], list[Sample]] = (
            self._generate_leases if latency is None
            else latency.around(
                self._generate_leases, abandoned=lambda leases, _: all(self._abandoned(l.lease_id) for l in leases),
                woken=self._changed,
            )
        )
        self.progress = Progress()
        # Tree leases (workers/tree.py): the verdict long-poll, started with the first; the pivots' estimate.
        self._feed: VerdictFeed | None = None
        self._tree_rng = random.Random()
        self._tree_estimate = RecoveryEstimate()
        self.tree_counts: TreeCounts | None = None
        self.swaps: list[SwapRecord] = []
        self.first_generation_at: dict[int, float] = {}  # version -> time.time() of its first generation
        self._batcher = Batcher(
            max_rows=config.max_batch_rows, fixed_rows=fixed_rows(self.info, config), abandoned=self._abandoned,
            combine=config.backend not in BATCHING_ITSELF,
        )

    def request_stop(self, *_: object) -> None:
        """SIGTERM: every slot finishes the generation in flight, posts it, then exits; a request
        that fails from now on is not retried (a post's rollouts stay spooled for the next start)."""
        self._stop.set()
        if self._feed is not None:
            self._feed.close(wait=False)
        self.client.stop()
        with self._changed:
            self._changed.notify_all()

    def run(self, max_iterations: int | None = None) -> None:
        """Generate until stopped (SIGTERM, `request_stop`) or every slot made `max_iterations` requests.
        A thread that fails (a slot, the swapper, the renewals) stops the worker as SIGTERM does, and
        its error is raised here once the other slots have posted what they generated."""
        on_signals(self.request_stop, signal.SIGTERM)
        self.spool.resend()  # work finished but not acknowledged before a previous exit
        renewer = threading.Thread(target=self._renewals.run, name="renewals", daemon=True)
        renewer.start()
        if not self.info.deterministic:  # a deterministic run's slots load the versions their leases name
            threading.Thread(target=self._guarded, args=(self._swapper,), name="swapper", daemon=True).start()
            threading.Thread(target=self._guarded, args=(self._watch,), name="versions", daemon=True).start()
        slots = [
            threading.Thread(target=self._guarded, args=(self._slot, i, max_iterations), name=f"slot-{i}", daemon=True)
            for i in range(self.config.concurrency)
        ]
        for slot in slots:
            slot.start()
        while any(slot.is_alive() for slot in slots):
            for slot in slots:
                slot.join(timeout=0.5)  # short joins keep the main thread responsive to signals
        self.request_stop()
        self._renewals.close()  # every lease is let go by now: its thread ends after the renewal in flight
        while renewer.is_alive():
            renewer.join(timeout=0.5)
        self.spool.resend()
        left = len(self.spool.pending())
        log.info(
            "worker %s stopping after %d rollouts, %d versions refused, %d lost copies abandoned, %d leases gone%s",
            self.worker_id, self.rollouts_posted, len(self.refused), self.copies_abandoned, self.progress.gone,
            f"; {left} batches stay spooled in {self.spool.directory} for the next start" if left else "",
        )
        if self._errors:
            raise self._errors[0]

    def _guarded(self, target: Callable[..., None], *args: object) -> None:
        """A thread's body: an error stops the worker (as SIGTERM does) and `run` raises it."""
        try:
            target(*args)
        except Stopped:  # a request given up because the worker stops: no failure
            pass
        except Exception as exc:  # noqa: BLE001 - kept for `run` to raise; the thread never dies unnoticed
            self._failed(exc, threading.current_thread().name)

    def _failed(self, error: Exception, what: str) -> None:
        log.error(
            "%s failed (%s: %s); the worker stops: generations in flight are finished and posted, leases not "
            "started are handed back", what, type(error).__name__, error,
        )
        with self._changed:
            self._errors.append(error)
        self.request_stop()

    def _note_version(self, version: int | None) -> None:
        if version is None:
            return
        with self._changed:
            self._seen_at.setdefault(version, time.time())
            if self.announced is None or version > self.announced:
                self.announced = version
                self._changed.notify_all()

    def _await_version(self, version: int | None) -> None:
        """Wait until `version` (the leases') is loaded: the lease budget assumes groups are sampled
        under their lease's version. Only while the store is failing does an older fresh one serve."""
        with self._changed:
            while (
                version is not None
                and not self._stop.is_set()
                and not self._store_failing
                and version not in self.refused
                and (self.backend.version is None or self.backend.version < version)
            ):
                self._changed.wait(timeout=0.5)

    def _fresh(self) -> bool:
        loaded = self.backend.version
        return loaded is not None and self.announced is not None and is_fresh(self.announced, loaded, self.info.max_staleness)

    def _due(self) -> bool:
        return self.announced is not None and self.announced != self.backend.version and self.announced not in self.refused

    def _watch(self) -> None:
        """Free-running runs: hear of new versions as they are announced (workers/versions.py), one
        long-poll outstanding, while the swapper pulls; lease answers tell of versions too."""
        watch_versions(
            self.client, known=lambda: self.announced, heard=self._note_version, stop=self._stop,
            wait_s=self.config.version_wait_s, retry_s=self.config.version_poll_s,
        )

    def _swapper(self) -> None:
        """The one place weights change (free-running runs): it pulls and swaps in the newest version
        announced (`_watch` and lease answers tell it). It never dies of a version: a failing store
        is retried, a version that fails verification or loading is refused."""
        failures = 0
        while not self._stop.is_set():
            with self._changed:
                while not self._due() and not self._stop.is_set():
                    self._changed.wait()
                version = self.announced
            if self._stop.is_set():
                return
            assert version is not None
            started = time.perf_counter()
            with contextlib.suppress(UnloadableVersion):  # refused: generation goes on with the weights loaded before
                if (path := self._pull(version, failures)) is None:
                    failures += 1  # the loaded version is kept while it is fresh (slots check)
                    continue
                failures = 0
                self._swap(path, version, pull_s=time.perf_counter() - started)

    def _pull(self, version: int, failures: int) -> str | None:
        """`version`'s verified local directory, or None after a backoff when the store could not
        be read. A version that fails verification is refused: UnloadableVersion."""
        try:
            path = self.store.pull(version, self.cache_dir)
        except VerificationError as exc:  # the store answered with something not to be trusted
            raise self._refuse(version, exc) from exc
        except (StoreError, OSError) as exc:
            with self._changed:
                self._store_failing = True
                self._changed.notify_all()
            delay = backoff(failures + 1, cap_s=10.0)
            log.warning("pulling version %d failed (%s); retrying in %.1fs", version, exc, delay)
            self._stop.wait(delay)
            return None
        self._store_failing = False
        return path

    def _refuse(self, version: int, exc: Exception) -> UnloadableVersion:
        """Skip `version` for good; the error to raise."""
        with self._changed:
            self.refused[version] = f"{type(exc).__name__}: {exc}"
            self._changed.notify_all()
        log.error(
            "refused version %d (%s): %s; still generating with version %s (%d versions refused so far)",
            version, type(exc).__name__, exc, self.backend.version, len(self.refused),
        )
        return UnloadableVersion(version, self.refused[version])

    def _swap(self, path: str, version: int, *, pull_s: float) -> None:
        """Load `version` with a soft pause: the round in flight is interrupted at the deadline."""
        paused = time.perf_counter()
        with self._batcher.swapping(self.config.swap_deadline_s):
            self._install(path, version, pull_s=pull_s, paused=paused)

    def _install(self, path: str, version: int, *, pull_s: float, paused: float) -> None:
        """Load `version` (no generation runs) and record it; any failure refuses it. The backends
        check before they copy (`copy_into`), so the weights loaded before stay whole."""
        try:
            if self.episode_task is not None and self._codec is None:
                self._codec = load_codec(path)
            self.backend.load(path, version)
        except Exception as exc:  # noqa: BLE001 - CheckpointError, VerificationError, a backend's own
            raise self._refuse(version, exc) from exc
        now = time.time()
        record = SwapRecord(version, self._seen_at.get(version, now), pull_s, time.perf_counter() - paused, now)
        self.swaps.append(record)
        with self._changed:
            self._changed.notify_all()
        log.info(
            "loaded version %d: pull %.2fs, pause %.2fs, %.2fs after it was announced",
            version, record.pull_s, record.pause_s, record.loaded_at - record.seen_at,
        )

    def _slot(self, index: int, max_iterations: int | None) -> None:
        """One lease loop: ask (for `request_size` groups), hold the leases (renewed from the answer
        until posted, handed back or found closed), generate, post; slot 0 also resends what a
        failed send left spooled."""
        asked = answers(
            lambda: self._ask(LeaseRequest(worker_id=self.worker_id, max_groups=self.request_size.groups())),
            stop=self._stop, passing=(ConnectionError, InvalidAnswer),
        )
        iteration = 0
        carried: LeaseResponse | None = None  # an answer a tree round asked for but could not start (held already)
        while True:
            response, held = (carried, True) if carried is not None else (next(asked, None), False)
            carried = None
            if response is None:
                return
            iteration += 0 if held else 1  # an answer carried over was counted when asked
            if not response.leases:
                self._stop.wait(response.retry_after_s)
            else:
                if not held:
                    self._hold(response.leases)
                try:
                    if not self.info.deterministic:
                        self._await_version(response.policy_version)
                    if self._stop.is_set():
                        self._hand_back(response.leases)
                        return
                    started = time.monotonic()
                    if isinstance(response.leases[0].unit, TreeUnit):  # a run's leases are all trees, or none
                        may_ask = None if max_iterations is None else max(0, max_iterations - iteration)
                        carried, asked_in_round = self._play_trees(response, may_ask=may_ask)
                        iteration += asked_in_round
                    else:
                        samples = self._samples_for(response.leases, response.sampling)
                        if not any(self._abandoned(lease.lease_id) for lease in response.leases):  # a whole request's time
                            self.request_size.finished(len(response.leases), time.monotonic() - started)
                        self._post(response.leases, samples, response.sampling)
                except UnloadableVersion as exc:  # deterministic runs: the leases' version cannot be loaded
                    log.error("%s; handing its leases back", exc)
                    self._hand_back(response.leases)
                    self._stop.wait(backoff(1, base_s=5.0))
                finally:
                    self._let_go(response.leases)
                if index == 0 and self.spool.unsent:
                    self.spool.resend()
            if max_iterations is not None and iteration >= max_iterations and carried is None:
                return

    def _ask(self, request: LeaseRequest) -> LeaseResponse | None:
        """A lease answer once the loaded version is fresh (no stale rollouts); None: stopping.
        Waiting longer than `_STALE_SAY_S`, it says why, every `_STALE_SAY_S`."""
        with self._changed:
            said = time.monotonic()
            while not self._stop.is_set() and not self.info.deterministic and not self._fresh():
                self._changed.wait(timeout=1.0)
                if time.monotonic() - said >= _STALE_SAY_S and self.backend.version is not None:
                    said = time.monotonic()
                    self._say_stale()
        if self._stop.is_set():
            return None
        return self._request(request)

    def _request(self, request: LeaseRequest) -> LeaseResponse:
        if self._machine is not None:
            request = request.model_copy(update={"machine": self._machine()})
        response = self.client.lease(request)
        self._note_version(response.policy_version)
        self._note_lost(response.superseded)
        return response

    def _say_stale(self) -> None:
        """Why this worker holds no lease: its versions arrive later than the run's staleness allows."""
        trips = [r.loaded_at - r.seen_at for r in self.swaps[-5:]]
        log.warning(
            "version %s loaded, %s announced: more than max_staleness = %d behind, so no lease (its rollouts would "
            "be refused as stale); a version's trip from announce to loaded takes %s here. A worker whose trip "
            "outlasts max_staleness training steps never catches up: a faster link, or a larger max_staleness",
            self.backend.version, self.announced, self.info.max_staleness,
            f"{statistics.median(trips):.1f} s (median of the last {len(trips)})" if trips else "longer than it has yet taken",
        )

    def _generate_leases(self, leases: list[Lease], sampling: SamplingParams) -> list[Sample]:
        """One sample per member of every leased group (an episode, in a multi-turn task)."""
        if self.episode_task is not None:
            assert self._codec is not None  # set with the first version, loaded before any generation
            owners = [lease for lease in leases for _ in range(lease.group_size)]
            return run_episodes(owners, sampling, task=self.episode_task, codec=self._codec, complete=self._complete)
        samples = [self._new_sample(lease, j, sampling.max_tokens) for lease in leases for j in range(lease.group_size)]
        self._complete(samples, sampling)
        return samples

    def _new_sample(self, lease: Lease, j: int, budget: int) -> Sample:
        """Sample j of `lease`; in a deterministic run seeded and bound to the lease's version."""
        if not self.info.deterministic:
            return Sample(prompt=lease.prompt_token_ids, budget=budget)
        if (version := lease.policy_version) is None:
            raise ValueError(f"lease {lease.lease_id} of a deterministic run names no policy_version")
        seed = sample_seed(self.info.seed, lease.prompt_id, j, version)
        return Sample(prompt=lease.prompt_token_ids, budget=budget, seed=seed, index=j, group=lease.lease_id, version=version)

    def _generate(self, prompts: list[list[int]], sampling: SamplingParams) -> list[Sample]:
        """Completions of bare prompts (tests and benchmarks/worker.py drive the worker with it)."""
        samples = [Sample(prompt=prompt, budget=sampling.max_tokens) for prompt in prompts]
        self._complete(samples, sampling)
        return samples

    def _complete(self, samples: list[Sample], sampling: SamplingParams) -> None:
        """Complete every sample up to its budget, across weight swaps (an interrupted one goes on
        from prompt + tokens so far). A deterministic run queues one request per version named."""
        while unfinished := [s for s in samples if s.finish_reason is None and not self._abandoned(s.group)]:
            wanted = sorted({s.version for s in unfinished}, key=lambda v: -1 if v is None else v)
            requests = [
                self._batcher.submit([s for s in unfinished if s.version == v], sampling, v) for v in wanted
            ]
            for request in requests:
                while self._batcher.lead(request):  # this slot generates the queued rows of every slot
                    if (needed := self._batcher.next_version()) is not None:
                        try:
                            self._load(needed)
                        except UnloadableVersion as exc:  # its rows' slots hand their leases back
                            self._batcher.fail_next(exc)
                            continue
                    version = self.backend.version
                    assert version is not None
                    self.first_generation_at.setdefault(version, time.time())
                    self._batcher.generate_next(self.backend, version, own=request)
            for request in requests:
                request.raise_error()

    def _load(self, version: int) -> None:
        """Deterministic runs (the lead, no round beside it): make `version` the loaded one. A
        failing store is retried: a lease that expires meanwhile is leased again under the same version."""
        if self.backend.version == version:
            return
        if version in self.refused:
            raise UnloadableVersion(version, self.refused[version])
        started, failures = time.perf_counter(), 0
        while (path := self._pull(version, failures)) is None:
            if self._stop.is_set():  # the slot hands its leases back rather than wait for the store
                raise UnloadableVersion(version, "the store could not be read before the worker stopped")
            failures += 1
        pulled = time.perf_counter()
        self._install(path, version, pull_s=pulled - started, paused=pulled)

    def _hold(self, leases: list[Lease]) -> None:
        """Leases answered: held (hedging reads `_held`) and renewed from now until let go. Their
        deadline is this machine's receipt time + the run's lease timeout (a little later than the
        orchestrator's: the answer's transit), so that a skewed clock does not move renewals."""
        received, timeout = time.time(), self.info.lease_timeout_s
        with self._changed:
            self._held.update(lease.lease_id for lease in leases)
        for lease in leases:
            self._renewals.hold(lease.lease_id, lease.deadline if timeout is None else received + timeout)

    def _renew(self, lease_id: str) -> float | None:
        """The renewals' call: the lease's new deadline by this machine's clock (as in `_hold`). A
        deterministic run's slot that waits for a failing store makes no progress: its leases are
        not renewed then (None) and run out as a dead worker's would, so that their places are
        leased again (docs/reproducibility.md)."""
        if self.info.deterministic and self._store_failing:
            return None
        sent = time.time()
        deadline = self.client.renew_lease(lease_id, self.worker_id).deadline
        return deadline if self.info.lease_timeout_s is None else sent + self.info.lease_timeout_s

    def _renewals_failed(self) -> None:
        """The renewals ended on an error other than a lease gone or an unreachable orchestrator
        (a revoked token, a bug): no lease would be renewed any more, so the worker stops."""
        assert self._renewals.error is not None
        self._failed(self._renewals.error, "renewing leases")

    def _lease_gone(self, lease_id: str, error: OrchestratorError) -> None:
        """A renewal found `lease_id` closed (it expired while renewals could not get through, or it
        was a copy that lost): abandoned as a lost copy is (rows not generated yet are dropped in a
        deterministic run; nothing of it is posted). A lease whose samples are being posted is no
        news: it completed."""
        with self._changed:
            if lease_id not in self._held or lease_id in self._posting or lease_id in self._lost:
                return
            self._gone.add(lease_id)
            self._lost = self._lost | {lease_id}
            self._changed.notify_all()  # a slot in its simulated delay may stop
        log.warning("lease %s was closed while this worker held it (%s); its samples are not posted", lease_id, error.message)

    def _note_lost(self, lease_ids: list[str]) -> None:
        """Copies told lost that this worker holds are abandoned (other ids are ignored), and no
        longer renewed."""
        with self._changed:
            if news := self._held.intersection(lease_ids):
                self._lost = self._lost | news
                self._changed.notify_all()  # a slot in its simulated delay may stop
        for lease_id in news:
            self._renewals.let_go(lease_id)

    def _let_go(self, leases: list[Lease]) -> None:
        ids = {lease.lease_id for lease in leases}
        for lease_id in ids:
            self._renewals.let_go(lease_id)
        with self._changed:
            self._held -= ids
            self._lost = self._lost - ids
            self._gone -= ids
            self._posting -= ids

    def _abandoned(self, lease_id: str | None) -> bool:
        return lease_id in self._lost

    @property
    def rollouts_posted(self) -> int:
        return self.progress.accepted

    @property
    def copies_abandoned(self) -> int:
        return self.progress.abandoned

    def _hand_back(self, leases: list[Lease]) -> None:
        for lease in leases:
            self._renewals.let_go(lease.lease_id)  # no renewal races the hand-back
            if self._abandoned(lease.lease_id):
                continue  # closed already: nothing to give back
            try:
                self.client.release_lease(lease.lease_id, self.worker_id)
            except ConnectionError:
                log.info("could not hand back lease %s; it expires at its deadline", lease.lease_id)
            except OrchestratorError as exc:  # closed meanwhile: expired, or a copy that lost, not told yet
                log.info("lease %s needs no handing back: %s", lease.lease_id, exc.message)

    def _ask_in_round(self) -> LeaseResponse | None:
        """The next lease answer for a tree round that goes on (`_play_trees`), asked only while the
        round may go on: not stopping, no swap nor other slot waiting for the round, the loaded
        version fresh (a stale worker would wait for a swap that waits for this round). None: none
        asked, or none came (the slot asks again as it always does)."""
        with self._changed:
            if self._stop.is_set() or self.info.deterministic or not self._fresh():
                return None
        if self._batcher.wanted():
            return None
        try:
            response = self._request(LeaseRequest(worker_id=self.worker_id, max_groups=self.request_size.groups()))
        except (ConnectionError, InvalidAnswer, Stopped) as exc:
            log.info("lease request within a tree round failed (%s); the slot asks again", exc)
            return None
        self._hold(response.leases)
        return response

    def _in_round(self, response: LeaseResponse) -> bool:
        """Whether an answer asked within a tree round may be played in it: leases of the version
        loaded (or older and fresh), and no swap nor other slot waiting for the round."""
        wanted, loaded = response.policy_version, self.backend.version
        return (bool(response.leases) and not self._stop.is_set() and not self._batcher.wanted()
                and (wanted is None or (loaded is not None and wanted <= loaded)))

    def _play_trees(self, first: LeaseResponse, *, may_ask: int | None) -> tuple[LeaseResponse | None, int]:
        """Tree leases ([orchestrator.tree], docs/rewards.md "Pivots"): generated step by step
        (workers/tree.py `play_trees`: as many units' roots decoded together as `first` holds), the
        next leases' roots decoded while one waits for its roots' last verdicts, in one round of
        their own (no swap inside it: a tree's branches keep its roots' version); each spooled and
        sent whole as it ends. When `first`'s leases are all started, the round asks for the next
        answer (`_ask_in_round`, at most `may_ask` answers; None: no bound) and goes on with its
        leases, so that the last lease of an answer waits for its verdicts while the next answer's
        roots are decoded; it ends (its units finished, then a swap may come) once no answer is
        asked or one comes that it cannot play (`_in_round`). Returns that answer (held, for the
        slot to play next; None if there is none; handed back if the round fails) and how many
        answers the round asked for (the slot counts them as its iterations).
        A backend that cannot decode step by step (`plays_trees`: openai) refuses them: they are
        handed back at once, and the worker stops with the reason."""
        if not self.backend.plays_trees:
            self._hand_back(first.leases)
            raise ValueError(
                f"tree leases ([orchestrator.tree]) are decoded step by step by the hf and vllm backends; the "
                f"{self.config.backend!r} backend cannot, so its leases were handed back: set [worker] backend = 'hf' or 'vllm'"
            )
        from workers.tree import TreeCounts, VerdictFeed, play_trees  # torch: imported where a tree lease is played
        if self._feed is None:
            self._feed, self.tree_counts = VerdictFeed(self.client, self.worker_id).start(), TreeCounts()
        assert self.tree_counts is not None
        asked: list[LeaseResponse] = []  # answers asked within the round, in order
        chained: list[Lease] = []  # their leases played in the round: let go as each is done, or at its end
        left: list[LeaseResponse] = []  # the answer it could not play

        def playing() -> Iterator[tuple[Lease, SamplingParams]]:
            response: LeaseResponse | None = first
            while response is not None:
                for lease in response.leases:
                    if not self._abandoned(lease.lease_id):  # asked as each one starts
                        yield lease, response.sampling
                response = None if may_ask is not None and len(asked) >= may_ask else self._ask_in_round()
                if response is None:
                    return
                asked.append(response)
                if not self._in_round(response):
                    left.append(response)
                    return
                chained.extend(response.leases)

        try:
            with self._batcher.round_of_its_own():
                for lease, rollouts in play_trees(
                    self.backend, self.client, playing(), run_name=self.info.run_name, worker_id=self.worker_id, feed=self._feed,
                    rng=self._tree_rng, estimate=self._tree_estimate, counts=self.tree_counts, width=len(first.leases),
                ):
                    self._tree_done(lease, rollouts)
                    if any(lease.lease_id == other.lease_id for other in chained):
                        self._let_go([lease])  # no more renewals (the first answer's leases: the slot lets them go)
        except BaseException:
            for response in left:  # held, never started, and no slot will play it: its prompts out again now
                self._hand_back(response.leases)
                self._let_go(response.leases)
            raise
        finally:
            self._let_go(chained)
        return (left[0] if left else None), len(asked)

    def _tree_done(self, lease: Lease, rollouts: list[Rollout]) -> None:
        """A tree lease played: spooled and sent whole, roots first. Its roots may have had fewer
        step boundaries than it has pivots (chains of one step have none): then it holds a pivot
        each, the unit the orchestrator completes (orchestrator/leases.py `tree_pivots`), and is
        counted short (`TreeCounts.short`, by the play)."""
        with self._changed:
            if lease.lease_id in self._lost:
                return
            self._posting.add(lease.lease_id)
        self.spool.post(RolloutBatch(rollouts=rollouts))

    def _post(self, leases: list[Lease], samples: list[Sample], sampling: SamplingParams) -> None:
        """Spool and send the samples of `leases`, less those of copies that lost and of leases
        found closed; the others stay renewed until the post is answered."""
        with self._changed:
            lost = self._lost
            self.progress.gone += sum(lease.lease_id in self._gone for lease in leases)
            self.progress.abandoned += sum(lease.lease_id in lost and lease.lease_id not in self._gone for lease in leases)
            self._posting.update(lease.lease_id for lease in leases if lease.lease_id not in lost)
        owners = [lease for lease in leases for _ in range(lease.group_size)]
        rollouts = [
            to_rollout(self.info.run_name, self.worker_id, lease, sample, sampling, keep_routing=self.info.keep_routing)
            for lease, sample in zip(owners, samples, strict=True)
            if lease.lease_id not in lost
        ]
        if rollouts:
            self.spool.post(RolloutBatch(rollouts=rollouts))

    def _send(self, batch: RolloutBatch) -> None:
        """The spool's send: post, then count what was acknowledged (a ConnectionError keeps it spooled)."""
        result = self.client.post_rollouts(batch)
        with self._changed:  # slots post at once: the counts are shared
            expired_before = self.progress.rejected["lease_expired"]
            self.progress.posted(batch, result)
        if result.rejected:
            reasons = Counter(rejection.reason for rejection in result.rejected)
            log.info("orchestrator rejected %d rollouts: %s", len(result.rejected), dict(reasons))
            if reasons["lease_expired"] and not expired_before:  # once a run
                log.warning(
                    "%d rollouts came back lease_expired: their leases ran out before the post, because no renewal "
                    "reached the orchestrator within its lease timeout (it was unreachable, or this machine was "
                    "suspended or stalled, for that long; see the warnings before this) or they were sent from the "
                    "spool after a restart; if it recurs, raise [orchestrator] lease_timeout_s",
                    reasons["lease_expired"],
                )


class UnloadableVersion(Exception):
    """A version this worker refused; a deterministic run's slot hands its leases back."""

    def __init__(self, version: int, why: str) -> None:
        super().__init__(f"version {version} cannot be loaded ({why})")


def fixed_rows(info: RunInfo, config: WorkerConfig) -> int | None:
    """A deterministic run's call shape in rows (workers/batching.py), None in any other run."""
    if not info.deterministic:
        return None
    rows = config.deterministic_groups_per_call * info.group_size
    if rows > config.max_batch_rows:
        raise ValueError(
            f"deterministic_groups_per_call = {config.deterministic_groups_per_call} groups of {info.group_size} "
            f"rows is {rows} rows per call, over max_batch_rows = {config.max_batch_rows}: lower "
            "worker.deterministic_groups_per_call (the same on every worker of the run) or raise worker.max_batch_rows"
        )
    return rows


def require_routes(info: RunInfo, backend: Backend) -> None:
    if info.keep_routing and not backend.records_routes:
        raise ValueError(
            f"run {info.run_name!r} keeps MoE routing (its trainer replays each token's experts) but the "
            f"{type(backend).__name__} backend cannot record routes; use [worker] backend = \"hf\" "
            "(docs/routing.md), or set [model] keep_routing = false in the run's config"
        )


def load_codec(checkpoint_dir: str) -> TextCodec:
    """The model's tokenizer, from a pulled version (a LoRA adapter's from its base model)."""
    from transformers import AutoTokenizer

    from decentrl.store.weights import model_dir
    from decentrl.tasks.episodes import tokenizer_codec

    return tokenizer_codec(AutoTokenizer.from_pretrained(model_dir(checkpoint_dir)))
