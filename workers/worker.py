"""The worker loop: lease prompts, generate with the loaded version, post; swap weights softly.

Called by `decentrl worker` (through workers/main.py), by tests and by benchmarks/worker.py.
Settings are the run config's `[worker]` section (`WorkerConfig`, the one declaration), with
`[store]` for reading versions; the run name, group size, staleness bound, store URL and sampling
come from the orchestrator, so a worker needs no more than its URL and a token.

Threads:
- `concurrency` slots each run lease -> generate -> post. A lock makes backend calls and weight
  swaps exclusive (a backend is not assumed thread-safe); the rows of slots that wait for it are
  generated together, up to `max_batch_rows` per call (workers/batching.py), the way an
  inference server batches concurrent requests. A simulated latency ([simulation], benchmarks
  only) wraps a slot's generation step (workers/simulation.py), so slots overlap their delays.
- one swapper learns of new versions (lease answers, or polling /info), pulls them from the
  store while generation goes on, then swaps with a soft pause: new generations are held back,
  the one in flight may finish until `swap_deadline_s`, after which it is interrupted, the
  weights are swapped, and it continues under the new version as a partial rollout whose
  `token_versions` say which version sampled each token.

Deterministic runs (`RunInfo.deterministic`, docs/reproducibility.md): there is no swapper; each
lease names the version it is sampled under, and the slot that leads a generation round loads
that version (pulling it from the store) before generating; every sample is seeded from (run
seed, prompt id, sample index, version) and generated in calls of one fixed shape
(`deterministic_groups_per_call` groups, workers/batching.py), so a group's samples do not depend
on the groups beside it. With hedging a lease may lose to another worker's copy of its place;
the orchestrator says so in a later lease answer (`LeaseResponse.superseded`, to any slot), and
the worker abandons the copy: its rows still queued are not generated (workers/batching.py), a
simulated delay ends early, and nothing of it is posted or spooled (`copies_abandoned`).

For a multi-turn task (`RunInfo.episode_task`) a slot plays episodes (workers/episodes.py)
instead of single completions; each model turn goes through the same generation path.

(This module passes 400 lines: the loop's two modes share its slots, posting and spooling;
splitting the deterministic path out would split the one place a slot's generation is read.)

Faults: an unreachable orchestrator is retried with exponential backoff and jitter (the client,
then this loop); every finished batch is spooled to disk before it is sent and removed only once
acknowledged (workers/spool.py); an unreachable store leaves the current version in use while it
is fresh (announced - loaded <= max_staleness); a version that fails verification or does not
load is refused, counted (`refused`) and skipped, and generation goes on with the weights last
loaded, which an all-or-nothing load left whole. SIGTERM: no new leases, in-flight generations
finish and are posted, leases not yet started are handed back, then the worker exits.
"""

from __future__ import annotations

import logging
import os
import random
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from decentrl.api.client import InvalidAnswer, OrchestratorClient, OrchestratorError
from decentrl.api.wire import Lease, LeaseRequest, RolloutBatch, RunInfo, SamplingParams
from decentrl.config import SimulationConfig, StoreConfig, WorkerConfig
from decentrl.rl.determinism import sample_seed
from decentrl.store.checkpoints import CheckpointStore, StoreError, VerificationError
from decentrl.tasks.episodes import TextCodec
from workers.backends import Backend
from workers.batching import Batcher
from workers.episodes import episode_task_of, run_episodes
from workers.progress import Progress
from workers.sample import Sample, to_rollout
from workers.simulation import SimulatedLatency
from workers.spool import Spool

log = logging.getLogger("decentrl.worker")


@dataclass(frozen=True)
class SwapRecord:
    version: int
    seen_at: float  # time.time() the worker learned of the version
    pull_s: float
    pause_s: float  # new generations held back (waiting for in-flight work, then loading)
    loaded_at: float


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
        spool_dir: str | None = None,  # default <cache_dir>/spool/<worker_id>
    ) -> None:
        self.config = config
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
        # store.url, when set, overrides the URL the orchestrator announces (a closer mirror);
        # with a public key, versions signed for another run are refused (they name their run).
        self.store = CheckpointStore.from_config(
            store.for_reader(store.url or self.info.store_url), run_name=self.info.run_name
        )
        self.spool = Spool(spool_dir or os.path.join(cache_dir, "spool", worker_id))
        # Hedging (deterministic runs): the leases the slots hold, and those of them another copy
        # filled first (told by the orchestrator), replaced whole under `_told`, which is notified
        # when it grows; a slot's leases leave both when the slot is done with them.
        self._told = threading.Condition()
        self._held: set[str] = set()
        self._lost: frozenset[str] = frozenset()
        latency = SimulatedLatency.of(simulation, worker_id)
        self._samples_for: Callable[[list[Lease], SamplingParams], list[Sample]] = (
            self._generate_leases if latency is None
            else latency.around(self._generate_leases, abandoned=lambda leases, _: self._all_lost(leases), woken=self._told)
        )
        self.stopping = False
        self.rollouts_posted = 0
        self.progress = Progress()
        self.swaps: list[SwapRecord] = []
        self.refused: dict[int, str] = {}  # version -> why it was not loaded; skipped for good
        self.first_generation_at: dict[int, float] = {}  # version -> time.time() of its first generation
        self._lock = threading.Lock()  # backend calls and weight swaps never overlap
        self._batcher = Batcher(
            max_rows=config.max_batch_rows, fixed_rows=fixed_rows(self.info, config), abandoned=self._abandoned
        )
        self._stats_lock = threading.Lock()
        self._versions = threading.Condition()  # guards `announced`; notified when it or the loaded version changes
        self.announced: int | None = self.info.policy_version
        self._seen_at: dict[int, float] = {}
        self._admit = threading.Event()  # cleared during a soft pause: no new generation starts
        self._store_failing = False  # set by the swapper while pulls fail; slots then keep a fresh older version
        self._admit.set()
        self._pause_deadline: float | None = None  # monotonic time after which in-flight work is interrupted
        self._unsent = False  # a send failed: the spool holds work to resend

    def request_stop(self, *_: object) -> None:
        """SIGTERM/SIGINT: every slot finishes the generation in flight, posts it, then exits."""
        self.stopping = True
        with self._versions:
            self._versions.notify_all()

    def run(self, max_iterations: int | None = None) -> None:
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, self.request_stop)
        self._resend_spooled()  # work finished but not acknowledged before a previous exit
        if not self.info.deterministic:  # a deterministic run's slots load the versions their leases name
            threading.Thread(target=self._swapper, name="swapper", daemon=True).start()
        slots = [
            threading.Thread(target=self._slot, args=(i, max_iterations), name=f"slot-{i}", daemon=True)
            for i in range(self.config.concurrency)
        ]
        for slot in slots:
            slot.start()
        while any(slot.is_alive() for slot in slots):
            for slot in slots:
                slot.join(timeout=0.5)  # short joins keep the main thread responsive to signals
        self.request_stop()
        self._resend_spooled()
        left = len(self.spool.pending())
        log.info(
            "worker %s stopping after %d rollouts, %d versions refused, %d lost copies abandoned%s", self.worker_id,
            self.rollouts_posted, len(self.refused), self.copies_abandoned,
            f"; {left} batches stay spooled in {self.spool.directory} for the next start" if left else "",
        )

    # -- versions -------------------------------------------------------------------------

    def _note_version(self, version: int | None) -> None:
        if version is None:
            return
        with self._versions:
            self._seen_at.setdefault(version, time.time())
            if self.announced is None or version > self.announced:
                self.announced = version
                self._versions.notify_all()

    def _await_version(self, version: int | None) -> None:
        """Before generating for leases granted under `version`, wait for the swapper to load
        it: the orchestrator's lease budget assumes groups are sampled under the version they
        were leased at, so an older one would mostly end up dropped as stale. Only while the
        store is failing does generation go on with an older, still fresh, version."""
        with self._versions:
            while (
                version is not None
                and not self.stopping
                and not self._store_failing
                and version not in self.refused
                and (self.backend.version is None or self.backend.version < version)
            ):
                self._versions.wait(timeout=0.5)

    def _fresh(self) -> bool:
        loaded = self.backend.version
        return loaded is not None and self.announced is not None and self.announced - loaded <= self.info.max_staleness

    def _due(self) -> bool:
        return self.announced is not None and self.announced != self.backend.version and self.announced not in self.refused

    def _swapper(self) -> None:
        """The one place weights change: pull the newest announced version, then swap softly.
        It never dies on what a version holds: a store that cannot be read is retried with
        backoff; a version that fails verification or loading is refused and skipped, and
        generation goes on with the weights last loaded (`_refuse`)."""
        failures = 0
        while not self.stopping:
            with self._versions:
                due = self._due()
                if not due:
                    self._versions.wait(timeout=self.config.version_poll_s)
                    due = self._due()
            if self.stopping:
                return
            if not due:
                try:
                    self._note_version(self.client.info().policy_version)
                except ConnectionError as exc:
                    log.warning("version poll failed: %s", exc)
                continue
            version = self.announced
            assert version is not None
            started = time.perf_counter()
            try:
                path = self.store.pull(version, self.cache_dir)
            except VerificationError as exc:  # the store answered with something not to be trusted
                self._refuse(version, exc)
                continue
            except (StoreError, OSError) as exc:
                # Keep generating with the loaded version while it is fresh (slots check).
                failures += 1
                with self._versions:
                    self._store_failing = True
                    self._versions.notify_all()
                delay = backoff(failures, cap_s=10.0)
                log.warning("pulling version %d failed (%s); retrying in %.1fs", version, exc, delay)
                time.sleep(delay)
                continue
            failures = 0
            self._store_failing = False
            try:
                self._swap(path, version, pull_s=time.perf_counter() - started)
            # Any failure to load a verified version is that version's: the backends check before
            # they copy (decentrl/store/weights.py `copy_into`), so the weights loaded before are still whole.
            except Exception as exc:  # noqa: BLE001 - CheckpointError, VerificationError, a backend's own
                self._refuse(version, exc)

    def _refuse(self, version: int, exc: Exception) -> None:
        """Skip `version` for good; slots waiting for it go on with the loaded version while fresh."""
        with self._versions:
            self.refused[version] = f"{type(exc).__name__}: {exc}"
            self._versions.notify_all()
        log.error(
            "refused version %d (%s): %s; still generating with version %s (%d versions refused so far)",
            version, type(exc).__name__, exc, self.backend.version, len(self.refused),
        )

    def _swap(self, path: str, version: int, *, pull_s: float) -> None:
        if self.episode_task is not None and self._codec is None:
            self._codec = load_codec(path)
        paused = time.perf_counter()
        self._admit.clear()
        self._pause_deadline = time.monotonic() + self.config.swap_deadline_s
        try:
            with self._lock:  # waits for the generation in flight (interrupted at the deadline)
                self.backend.load(path, version)
        finally:  # loaded or refused, generation resumes
            self._pause_deadline = None
            self._admit.set()
        record = SwapRecord(
            version=version,
            seen_at=self._seen_at.get(version, time.time()),
            pull_s=pull_s,
            pause_s=time.perf_counter() - paused,
            loaded_at=time.time(),
        )
        self.swaps.append(record)
        with self._versions:
            self._versions.notify_all()
        log.info(
            "loaded version %d: pull %.2fs, pause %.2fs, %.2fs after it was announced",
            version, record.pull_s, record.pause_s, record.loaded_at - record.seen_at,
        )

    def _pause_due(self) -> bool:
        deadline = self._pause_deadline
        return deadline is not None and time.monotonic() >= deadline

    # -- slots ----------------------------------------------------------------------------

    def _slot(self, index: int, max_iterations: int | None) -> None:
        iterations, failures = 0, 0
        while not self.stopping and (max_iterations is None or iterations < max_iterations):
            with self._versions:  # a stale version would only produce rejected rollouts
                while not self.stopping and not self.info.deterministic and not self._fresh():
                    self._versions.wait(timeout=1.0)
            if self.stopping:
                break
            try:
                response = self.client.lease(
                    LeaseRequest(worker_id=self.worker_id, max_groups=self.config.groups_per_request)
                )
            except (ConnectionError, InvalidAnswer) as exc:  # unreachable, or an answer this worker cannot read
                failures += 1
                delay = backoff(failures)
                log.warning("lease request failed (%s); asking again in %.1fs", exc, delay)
                time.sleep(delay)
                continue
            failures = 0
            iterations += 1
            self._note_version(response.policy_version)
            self._note_lost(response.superseded)
            if not response.leases:
                time.sleep(response.retry_after_s)
                continue
            if not self.info.deterministic:
                self._await_version(response.policy_version)
            self._hold(response.leases)
            try:
                if self.stopping:
                    self._hand_back(response.leases)
                    break
                try:
                    samples = self._samples_for(response.leases, response.sampling)
                except UnloadableVersion as exc:  # deterministic runs: the leases' version cannot be loaded
                    log.error("%s; handing its leases back", exc)
                    self._hand_back(response.leases)
                    time.sleep(backoff(1, base_s=5.0))
                    continue
                self._post(response.leases, samples, response.sampling)
            finally:
                self._let_go(response.leases)
            if index == 0 and self._unsent:
                self._resend_spooled()

    def _generate_leases(self, leases: list[Lease], sampling: SamplingParams) -> list[Sample]:
        """One sample per member of every leased group: a completion, or an episode of a
        multi-turn task. The slot's generation step (what a simulated latency wraps)."""
        owners = [lease for lease in leases for _ in range(lease.group_size)]
        if self.info.deterministic:
            return self._generate_seeded(leases, sampling)
        if self.episode_task is None:
            return self._generate([lease.prompt_token_ids for lease in owners], sampling)
        assert self._codec is not None  # set with the first version, loaded before any generation
        return run_episodes(owners, sampling, task=self.episode_task, codec=self._codec, complete=self._complete)

    def _generate(self, prompts: list[list[int]], sampling: SamplingParams) -> list[Sample]:
        samples = [Sample(prompt=prompt, budget=sampling.max_tokens) for prompt in prompts]
        self._complete(samples, sampling)
        return samples

    def _generate_seeded(self, leases: list[Lease], sampling: SamplingParams) -> list[Sample]:
        """Deterministic runs: sample j of a lease is seeded from (run seed, prompt id, j, the
        lease's version) and generated under that version, in calls of a fixed shape."""
        samples = []
        for lease in leases:
            if lease.policy_version is None:
                raise ValueError(f"lease {lease.lease_id} of a deterministic run names no policy_version")
            samples += [
                Sample(
                    prompt=lease.prompt_token_ids, budget=sampling.max_tokens,
                    seed=sample_seed(self.info.seed, lease.prompt_id, j, lease.policy_version), index=j,
                    group=lease.lease_id, version=lease.policy_version,
                )
                for j in range(lease.group_size)
            ]
        self._complete(samples, sampling)
        return samples

    def _complete(self, samples: list[Sample], sampling: SamplingParams) -> None:
        """Complete every sample up to its budget; a generation interrupted by a swap continues
        under the new weights from where it stopped (prompt + tokens so far). The rows of all
        slots waiting at once are generated together (workers/batching.py); in a deterministic
        run one request per version the samples name, each generated under that version."""
        while unfinished := [s for s in samples if s.finish_reason is None and not self._abandoned(s.group)]:
            self._admit.wait()
            wanted = sorted({s.version for s in unfinished}, key=lambda v: -1 if v is None else v)
            requests = [
                self._batcher.submit([s for s in unfinished if s.version == v], sampling, v) for v in wanted
            ]
            for request in requests:
                while self._batcher.lead(request):  # this slot generates the queued rows of every slot
                    with self._lock:
                        if (needed := self._batcher.next_version()) is not None:
                            try:
                                self._load(needed)
                            except UnloadableVersion as exc:  # its rows' slots hand their leases back
                                self._batcher.fail_next(exc)
                                continue
                        version = self.backend.version
                        assert version is not None
                        self.first_generation_at.setdefault(version, time.time())
                        self._batcher.generate_next(self.backend, version, self._pause_due)
            for request in requests:
                request.raise_error()

    def _load(self, version: int) -> None:
        """Deterministic runs (under `_lock`): make `version` the loaded one, pulling it first;
        a failing store is retried with backoff (the lease is renewed by nobody meanwhile: if it
        expires, it is leased again under the same version, so the run stays the same)."""
        if self.backend.version == version:
            return
        if version in self.refused:
            raise UnloadableVersion(version, self.refused[version])
        started, failures = time.perf_counter(), 0
        while True:
            try:
                path = self.store.pull(version, self.cache_dir)
                break
            except VerificationError as exc:  # not to be trusted: refused, as the swapper does
                self._refuse(version, exc)
                raise UnloadableVersion(version, self.refused[version]) from exc
            except (StoreError, OSError) as exc:
                failures += 1
                delay = backoff(failures, cap_s=10.0)
                log.warning("pulling version %d failed (%s); retrying in %.1fs", version, exc, delay)
                time.sleep(delay)
        pulled = time.perf_counter()
        try:
            self.backend.load(path, version)
        # As in the swapper: the backends check before they copy, so the old weights are whole.
        except Exception as exc:  # noqa: BLE001 - CheckpointError, a backend's own
            self._refuse(version, exc)
            raise UnloadableVersion(version, self.refused[version]) from exc
        now = time.time()
        self.swaps.append(SwapRecord(version, now, pulled - started, time.perf_counter() - pulled, now))

    # -- hedging: copies that lost (deterministic runs) -----------------------------------------

    def _hold(self, leases: list[Lease]) -> None:
        with self._told:
            self._held.update(lease.lease_id for lease in leases)

    def _note_lost(self, lease_ids: list[str]) -> None:
        """A lease answer told of copies that lost: those this worker holds are abandoned (an id
        it does not hold, finished or never its own, is ignored)."""
        with self._told:
            news = self._held.intersection(lease_ids)
            if news:
                self._lost = self._lost | news
                self._told.notify_all()  # a slot in its simulated delay may stop

    def _let_go(self, leases: list[Lease]) -> None:
        """The slot is done with `leases` (posted, abandoned or handed back)."""
        ids = {lease.lease_id for lease in leases}
        with self._told:
            self._held -= ids
            if not self._lost.isdisjoint(ids):
                self._lost = self._lost - ids

    def _abandoned(self, lease_id: str | None) -> bool:
        return lease_id in self._lost

    def _all_lost(self, leases: list[Lease]) -> bool:
        return all(lease.lease_id in self._lost for lease in leases)

    @property
    def copies_abandoned(self) -> int:
        """Leases this worker did not post because another copy of their place filled it first."""
        return self.progress.abandoned

    def _hand_back(self, leases: list[Lease]) -> None:
        for lease in leases:
            if self._abandoned(lease.lease_id):
                continue  # closed already: nothing to give back
            try:
                self.client.release_lease(lease.lease_id, self.worker_id)
            except ConnectionError:
                log.info("could not hand back lease %s; it expires at its deadline", lease.lease_id)
            except OrchestratorError as exc:  # closed meanwhile: expired, or a copy that lost, not told yet
                log.info("lease %s needs no handing back: %s", lease.lease_id, exc.message)

    # -- posting --------------------------------------------------------------------------

    def _post(self, leases: list[Lease], samples: list[Sample], sampling: SamplingParams) -> None:
        """Spool and send the samples of `leases`, less those of copies that lost (abandoned,
        finished or not: their post would be a duplicate)."""
        lost = self._lost
        if abandoned := sum(lease.lease_id in lost for lease in leases):
            with self._stats_lock:
                self.progress.abandoned += abandoned
        owners = [lease for lease in leases for _ in range(lease.group_size)]
        rollouts = [
            to_rollout(self.info.run_name, self.worker_id, lease, sample, sampling, keep_routing=self.info.keep_routing)
            for lease, sample in zip(owners, samples, strict=True)
            if lease.lease_id not in lost
        ]
        if not rollouts:
            return
        batch = RolloutBatch(rollouts=rollouts)
        self._send(self.spool.add(batch), batch)

    def _send(self, path: str, batch: RolloutBatch) -> bool:
        try:
            result = self.client.post_rollouts(batch)
        except ConnectionError as exc:
            log.warning("orchestrator unreachable (%s); %d rollouts stay spooled", exc, len(batch.rollouts))
            self._unsent = True
            return False
        self.spool.remove(path)  # acknowledged: accepted, duplicate or rejected, never to be sent again
        with self._stats_lock:  # slots post at once: the counts are shared
            self.rollouts_posted += result.accepted
            self.progress.posted(batch, result)  # a line every 10 s (workers/progress.py)
        if result.rejected:
            reasons: dict[str, int] = {}
            for rejection in result.rejected:
                reasons[rejection.reason] = reasons.get(rejection.reason, 0) + 1
            log.info("orchestrator rejected %d rollouts: %s", len(result.rejected), reasons)
        return True

    def _resend_spooled(self) -> None:
        self._unsent = False
        for path in self.spool.pending():
            try:
                batch = Spool.load(path)
            except FileNotFoundError:  # another slot sent it meanwhile
                continue
            if not self._send(path, batch):
                return  # still unreachable: try again later


class UnloadableVersion(Exception):
    """A deterministic run's lease names a version this worker refused (it failed verification or
    loading): the slot hands such leases back instead of generating under another version."""

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
    """A keep_routing run needs every rollout's MoE routes: refuse a backend that cannot record them."""
    if info.keep_routing and not backend.records_routes:
        raise ValueError(
            f"run {info.run_name!r} keeps MoE routing (its trainer replays each token's experts) but the "
            f"{type(backend).__name__} backend cannot record routes; use [worker] backend = \"hf\" "
            "(docs/routing.md), or set [model] keep_routing = false in the run's config"
        )


def backoff(failures: int, base_s: float = 0.5, cap_s: float = 30.0) -> float:
    """Exponential backoff with full jitter: uniform in [0, min(cap, base * 2^failures)]."""
    return random.uniform(0.0, min(cap_s, base_s * 2.0 ** min(failures, 16)))


def load_codec(checkpoint_dir: str) -> TextCodec:
    """The model's tokenizer, from a pulled version (a LoRA adapter's from its base model)."""
    from transformers import AutoTokenizer

    from decentrl.store.weights import model_dir
    from decentrl.tasks.episodes import tokenizer_codec

    return tokenizer_codec(AutoTokenizer.from_pretrained(model_dir(checkpoint_dir)))


def default_worker_id() -> str:
    return f"{os.uname().nodename}-{os.getpid()}"
