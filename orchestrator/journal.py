"""The orchestrator's durable journal: SQLite in WAL mode under the run dir; this module is its
schema, writer and reader (a rollout's body: orchestrator/codec.py; the tables: docs/api.md).

RunState's parts `record` events; `await commit()` returns only once everything recorded before it
is on disk (one writer thread, group commit), so no answer precedes the change it depends on. A
full disk is not fatal: the commit raises JournalFull (the caller answers 503), what it held is
kept, in order, ahead of everything recorded later, and is written by the first commit after space
returns (the lease upkeep commits twice a second, so without a request too). Any other failed
write is fatal: every later commit raises JournalError until a restart recovers (`load`,
orchestrator/recovery.py). `NullJournal` (journaling off) records nothing.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import logging
import sqlite3
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import msgpack
from pydantic import TypeAdapter

from decentrl.api.encoding import unpack_msgpack
from decentrl.api.wire import Lease, Unit
from orchestrator import events
from orchestrator.codec import encode_rollout, pack_ints

log = logging.getLogger("decentrl.orchestrator.journal")

SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS leases (
    lease_id TEXT PRIMARY KEY,
    prompt_id INTEGER NOT NULL,
    holder TEXT NOT NULL,
    deadline REAL NOT NULL,
    prompt_token_ids BLOB NOT NULL,
    group_size INTEGER NOT NULL,
    status TEXT NOT NULL,
    ready_seq INTEGER,
    closed_at REAL,
    rewards TEXT,
    oldest_version INTEGER,
    unit TEXT
);
CREATE TABLE IF NOT EXISTS rollouts (
    rollout_id TEXT NOT NULL,
    lease_id TEXT NOT NULL,
    data BLOB
);
CREATE INDEX IF NOT EXISTS rollouts_by_lease ON rollouts(lease_id);
CREATE INDEX IF NOT EXISTS rollouts_by_id ON rollouts(rollout_id);
CREATE TABLE IF NOT EXISTS batches (
    request_id TEXT PRIMARY KEY,
    served_at REAL NOT NULL,
    body TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS workers (name TEXT PRIMARY KEY, record TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS content (
    digest BLOB PRIMARY KEY,
    lease_id TEXT NOT NULL,
    version INTEGER NOT NULL
);
CREATE INDEX IF NOT EXISTS content_by_lease ON content(lease_id);
CREATE TABLE IF NOT EXISTS scores (rollout_id TEXT PRIMARY KEY, lease_id TEXT NOT NULL, result TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS steps (
    rollout_id TEXT NOT NULL,
    step INTEGER NOT NULL,
    lease_id TEXT NOT NULL,
    data BLOB NOT NULL,
    score REAL,
    seq INTEGER,
    PRIMARY KEY (rollout_id, step)
);
CREATE INDEX IF NOT EXISTS steps_by_lease ON steps(lease_id);
CREATE INDEX IF NOT EXISTS scores_by_lease ON scores(lease_id);
"""

SQL_META = "INSERT OR REPLACE INTO meta(key, value) VALUES (?, ?)"
SQL_LEASE = (
    "INSERT OR REPLACE INTO leases(lease_id, prompt_id, holder, deadline, prompt_token_ids, group_size, status, unit) "
    "VALUES (?, ?, ?, ?, ?, ?, 'open', ?)"
)
SQL_ROLLOUT = "INSERT INTO rollouts(rollout_id, lease_id, data) VALUES (?, ?, ?)"
SQL_COMPLETE = (
    "UPDATE leases SET status = 'complete', ready_seq = ?, closed_at = ?, rewards = ?, oldest_version = ? WHERE lease_id = ?"
)
SQL_CLOSE = "UPDATE leases SET status = ?, closed_at = ? WHERE lease_id = ?"
SQL_DROP_DATA = "UPDATE rollouts SET data = NULL WHERE lease_id = ?"
SQL_RENEW = "UPDATE leases SET deadline = ? WHERE lease_id = ?"
SQL_BATCH = "INSERT OR REPLACE INTO batches(request_id, served_at, body) VALUES (?, ?, ?)"
SQL_FORGET_BATCH = "DELETE FROM batches WHERE request_id = ?"
SQL_FORGET_ROLLOUTS = "DELETE FROM rollouts WHERE lease_id = ?"
SQL_FORGET_LEASE = "DELETE FROM leases WHERE lease_id = ?"
SQL_WORKER = "INSERT OR REPLACE INTO workers(name, record) VALUES (?, ?)"
SQL_CONTENT = "INSERT OR IGNORE INTO content(digest, lease_id, version) VALUES (?, ?, ?)"
SQL_FORGET_CONTENT = "DELETE FROM content WHERE lease_id = ?"
SQL_SCORE = "INSERT OR IGNORE INTO scores(rollout_id, lease_id, result) VALUES (?, ?, ?)"
SQL_FORGET_SCORES = "DELETE FROM scores WHERE lease_id = ?"
SQL_STEP = "INSERT OR IGNORE INTO steps(rollout_id, step, lease_id, data) VALUES (?, ?, ?, ?)"
SQL_VERDICT = "UPDATE steps SET score = ?, seq = ? WHERE rollout_id = ? AND step = ?"
SQL_FORGET_STEPS = "DELETE FROM steps WHERE lease_id = ?"


class JournalError(RuntimeError):
    """The journal could not commit; the orchestrator must be restarted (it recovers)."""


class JournalFull(Exception):
    """The journal's disk is full: nothing recorded since the last commit is on disk yet (nor
    acknowledged); it is written, in order, by the first commit after space returns."""


# SQLite's code for a full disk (sqlite3.SQLITE_FULL); a write past the end of the disk gives it.
SQLITE_FULL = 13


class JournalMismatch(RuntimeError):
    """The journal file belongs to another run."""


@dataclass
class Snapshot:
    """What recovery needs of what was committed (it grows with the buffer, not the run)."""

    meta: dict[str, Any]
    leases: list[sqlite3.Row]  # open and complete leases, and the leases of the batches kept
    rollouts: dict[str, list[tuple[str, bytes | None]]]  # of open leases: lease_id -> [(rollout_id, body)] in acceptance order
    batches: list[tuple[str, dict[str, Any]]]  # (request_id, body) oldest first
    remembered: list[tuple[float, str]] = field(default_factory=list)  # (closed_at, lease_id) of the other closed leases
    workers: dict[str, dict[str, Any]] = field(default_factory=dict)  # token name -> integrity record
    content: list[tuple[bytes, str, int]] = field(default_factory=list)  # (digest, lease_id, version)
    scores: dict[str, str] = field(default_factory=dict)  # rollout id -> its ScoreResult as JSON
    # Partial steps of open and complete leases (and those of kept batches), per lease in posting
    # order: (rollout id, step, body, score, seq).
    steps: dict[str, list[tuple[str, int, bytes, float | None, int | None]]] = field(default_factory=dict)


UNIT: TypeAdapter[Any] = TypeAdapter(Unit)


def lease_of(row: sqlite3.Row) -> Lease:
    """A journaled lease, built without validating it again (it was validated when it was made)."""
    return Lease.model_construct(
        prompt_token_ids=unpack_msgpack(row["prompt_token_ids"]),
        unit=UNIT.validate_json(row["unit"]) if row["unit"] is not None else None,
        **{name: row[name] for name in ("lease_id", "prompt_id", "group_size", "deadline")},
    )


class Journal:
    durable = True  # what is recorded survives a restart

    def __init__(self, path: str, *, run_name: str, sync: str = "full") -> None:
        self.path = path
        self._conn = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
        self._conn.row_factory = sqlite3.Row
        mode = self._conn.execute("PRAGMA journal_mode=WAL").fetchone()[0]
        if mode.lower() != "wal":
            raise JournalError(f"{path}: SQLite refused WAL mode (got {mode!r}); put the run dir on a local disk")
        self._conn.execute(f"PRAGMA synchronous={'FULL' if sync == 'full' else 'NORMAL'}")
        self._conn.execute("PRAGMA journal_size_limit=67108864")  # keep the WAL file near 64 MiB
        self._conn.executescript(SCHEMA)
        columns = {row[1] for row in self._conn.execute("PRAGMA table_info(leases)")}
        if "oldest_version" not in columns:
            self._add_oldest_version()
        if "unit" not in columns:  # a journal of an older version: its leases are plain groups
            self._conn.execute("ALTER TABLE leases ADD COLUMN unit TEXT")
        row = self._conn.execute("SELECT value FROM meta WHERE key = 'run'").fetchone()
        if row is None:
            self._conn.execute(SQL_META, ("run", json.dumps({"run_name": run_name, "created_at": time.time()})))
        elif (other := json.loads(row[0])["run_name"]) != run_name:
            self._conn.close()
            raise JournalMismatch(
                f"{path} holds the journal of run {other!r}, not {run_name!r}; use another --run-dir "
                "(or delete the file to start this run from scratch)"
            )
        self._pending: list[tuple[str, tuple[Any, ...]]] = []
        # Asked at every commit (RunState sets both): the meta row, written when it differs from the
        # row last written, and the integrity changes since the last call, so no part has to
        # remember that it changed a counter, and a strike or a ban is on disk before the answer.
        self.meta_source: Callable[[], dict[str, Any]] | None = None
        self.integrity_source: Callable[[], events.IntegrityChanges] | None = None
        self._meta_written: str | None = None  # the meta row as last handed to the writer
        self._cond = threading.Condition()
        self._queue: list[tuple[list[tuple[str, tuple[Any, ...]]], asyncio.Future[None]]] = []
        self._inflight = 0  # commits handed to the writer and not yet resolved (loop thread only)
        # What a commit could not write for a full disk, written first by the next one (writer thread).
        self._held: list[tuple[str, tuple[Any, ...]]] = []
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._closing = False
        self.failed: BaseException | None = None
        self.on_commit: Callable[[float, int], None] | None = None  # (seconds, statements), loop thread
        # Lookups from the event loop's thread, beside the writer: what is recorded and not yet
        # committed is still in memory (RunState holds every change it makes).
        self._reader = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
        self._reader.execute("PRAGMA query_only=1")

    def _add_oldest_version(self) -> None:
        """A journal of an older version: add leases.oldest_version, filled in for the complete
        groups from their bodies, once (recovery reads the buffer from the lease rows alone)."""
        conn = self._conn
        oldest: dict[str, int] = {}
        for lease_id, data in conn.execute(
            "SELECT lease_id, data FROM rollouts WHERE lease_id IN (SELECT lease_id FROM leases WHERE status = 'complete')"
        ):
            version = msgpack.unpackb(data)["policy_version"]
            oldest[lease_id] = min(version, oldest.get(lease_id, version))
        conn.execute("BEGIN")
        conn.execute("ALTER TABLE leases ADD COLUMN oldest_version INTEGER")
        conn.executemany("UPDATE leases SET oldest_version = ? WHERE lease_id = ?", [(v, k) for k, v in oldest.items()])
        conn.execute("COMMIT")

    # -- recording (event loop thread) ---------------------------------------------------

    def record(self, event: events.Event) -> None:
        """Queue `event`'s statements for the next commit, in the order the state changed."""
        pending = self._pending
        match event:
            case events.LeaseGranted(lease, holder):
                prompt = msgpack.packb(pack_ints(lease.prompt_token_ids))
                unit = lease.unit.model_dump_json() if lease.unit is not None else None
                pending.append((SQL_LEASE, (lease.lease_id, lease.prompt_id, holder, lease.deadline, prompt, lease.group_size, unit)))
            case events.RolloutAccepted(rollout):
                pending.append((SQL_ROLLOUT, (rollout.rollout_id, rollout.lease_id, encode_rollout(rollout))))
            case events.GroupCompleted(lease_id, ready_seq, rewards, oldest_version, at):
                pending.append((SQL_COMPLETE, (ready_seq, at, json.dumps(rewards), oldest_version, lease_id)))
            case events.LeaseClosedAs(lease_id, status, at, drop_samples):
                pending.append((SQL_CLOSE, (status, at, lease_id)))
                if drop_samples:
                    pending.append((SQL_DROP_DATA, (lease_id,)))
            case events.LeaseRenewed(lease_id, deadline):
                pending.append((SQL_RENEW, (deadline, lease_id)))
            case events.BatchServed(request_id, at, body):
                pending.append((SQL_BATCH, (request_id, at, json.dumps(body))))
            case events.BatchForgotten(request_id, lease_ids):
                pending.append((SQL_FORGET_BATCH, (request_id,)))
                pending.extend((SQL_DROP_DATA, (lease_id,)) for lease_id in lease_ids)
            case events.LeaseForgotten(lease_id):
                pending += [(SQL_FORGET_ROLLOUTS, (lease_id,)), (SQL_FORGET_SCORES, (lease_id,)), (SQL_FORGET_LEASE, (lease_id,)),
                            (SQL_FORGET_STEPS, (lease_id,))]
            case events.ScoreTaken(rollout_id, lease_id, result):
                pending.append((SQL_SCORE, (rollout_id, lease_id, result)))
            case events.StepTaken(lease_id, rollout_id, step, data):
                pending.append((SQL_STEP, (rollout_id, step, lease_id, data)))
            case events.VerdictTaken(rollout_id, step, score, seq):
                pending.append((SQL_VERDICT, (score, seq, rollout_id, step)))

    def _take_pending(self) -> list[tuple[str, tuple[Any, ...]]]:
        if self.integrity_source is not None:
            changes = self.integrity_source()
            self._pending.extend((SQL_FORGET_CONTENT, (lease_id,)) for lease_id in changes.forgotten)
            self._pending.extend((SQL_CONTENT, row) for row in changes.kept)
            self._pending.extend((SQL_WORKER, row) for row in changes.workers)
        if self.meta_source is not None:
            meta = json.dumps(self.meta_source())
            if meta != self._meta_written:
                self._pending.append((SQL_META, ("state", meta)))
                self._meta_written = meta
        ops, self._pending = self._pending, []
        return ops

    # -- committing -----------------------------------------------------------------------

    def flush(self) -> None:
        """Commit what is recorded, in this thread (no writer running)."""
        if self._thread is not None:
            raise RuntimeError("the writer thread is running: use `await commit()`")
        ops = self._take_pending()
        if ops and (error := self._write(ops)) is not None:
            raise error

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        """Start the writer thread; from now on commit with `await commit()`."""
        self.flush()
        self._loop = loop
        self._closing = False
        self._thread = threading.Thread(target=self._writer, name="journal-writer", daemon=True)
        self._thread.start()

    async def commit(self) -> None:
        """Return once everything recorded so far (by anyone) is committed to disk."""
        if self.failed is not None:
            raise JournalError(f"journal {self.path} failed earlier: {self.failed}")
        ops = self._take_pending()
        if not ops and self._inflight == 0 and not self._held:
            return  # nothing recorded, nothing on its way or held: all is on disk already
        if self._thread is None:  # not started (tests driving the app without a loop thread)
            if (error := self._write(ops)) is not None:
                raise error
            return
        future = asyncio.get_running_loop().create_future()
        future.add_done_callback(_seen)
        self._inflight += 1
        with self._cond:
            self._queue.append((ops, future))
            self._cond.notify()
        await asyncio.shield(future)  # a client hanging up does not unqueue what it wrote

    async def stop(self) -> None:
        if self._thread is None:
            return
        if self.failed is None:
            try:
                await self.commit()
            except JournalFull:
                log.error("journal %s: stopped with the disk full; %d statements never acknowledged are not written",
                          self.path, len(self._held))
            except JournalError:
                pass
        with self._cond:
            self._closing = True
            self._cond.notify()
        await asyncio.to_thread(self._thread.join)
        self._thread = None

    def close(self) -> None:
        self._reader.close()
        self._conn.close()

    def _writer(self) -> None:
        while True:
            with self._cond:
                while not self._queue and not self._closing:
                    self._cond.wait()
                if not self._queue:
                    return
                work, self._queue = self._queue, []
            ops = [op for batch, _ in work for op in batch]
            started = time.perf_counter()
            error = self.failed or self._write(ops)
            elapsed = time.perf_counter() - started
            assert self._loop is not None
            futures = [future for _, future in work]
            try:
                self._loop.call_soon_threadsafe(self._resolve, futures, error, elapsed, len(ops))
            except RuntimeError:  # the loop is closed: nobody is waiting any more
                return

    def _resolve(
        self, futures: list[asyncio.Future[None]], error: BaseException | None, elapsed: float, statements: int
    ) -> None:
        self._inflight -= len(futures)
        for future in futures:
            if future.done():
                continue
            if error is None:
                future.set_result(None)
            elif isinstance(error, JournalFull):
                future.set_exception(error)
            else:
                future.set_exception(JournalError(f"journal {self.path}: commit failed: {error}"))
        if self.on_commit is not None and error is None:
            self.on_commit(elapsed, statements)

    def _write(self, ops: list[tuple[str, tuple[Any, ...]]]) -> BaseException | None:
        """Commit what a full disk held back, then `ops`, in one transaction: None when written, a
        JournalFull when the disk is full (all of it held for the next commit), else the failure,
        which is fatal (`failed`)."""
        if self._held:
            # The WAL grows until a checkpoint, which follows a commit: on a full disk none comes.
            # Copied into the database and truncated, it gives back its space (a file deleted by
            # the operator gives back the rest).
            with contextlib.suppress(sqlite3.Error):
                self._conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        ops = self._held + ops
        try:
            self._execute(ops)
        except sqlite3.Error as exc:
            if getattr(exc, "sqlite_errorcode", None) != SQLITE_FULL:
                log.critical("journal %s: commit failed: %s", self.path, exc)
                self.failed = exc
                return exc
            if not self._held:
                log.error("journal %s: the disk is full; requests that change the run get 503 until space returns", self.path)
            self._held = ops
            return self.full_error()
        except BaseException as exc:  # noqa: BLE001 - any other failure is fatal, reported to every waiter
            log.critical("journal %s: commit failed: %s", self.path, exc)
            self.failed = exc
            return exc
        if self._held:
            log.warning("journal %s: space returned; %d statements held for it are written", self.path, len(ops))
            self._held = []
        return None

    @property
    def full(self) -> bool:
        """The disk was full at the last commit: what it held is not written yet."""
        return bool(self._held)

    def full_error(self) -> JournalFull:
        return JournalFull(
            f"the orchestrator's journal disk is full ({self.path}); this request is not acknowledged: retry "
            "it later (the operator must free space; the orchestrator goes on by itself then)"
        )

    def _execute(self, ops: list[tuple[str, tuple[Any, ...]]]) -> None:
        conn = self._conn
        conn.execute("BEGIN")
        try:
            for sql, group in itertools.groupby(ops, key=lambda op: op[0]):
                conn.executemany(sql, [params for _, params in group])
            conn.execute("COMMIT")
        except BaseException:
            if conn.in_transaction:
                conn.execute("ROLLBACK")
            raise

    # -- recovery -------------------------------------------------------------------------

    def load(self) -> Snapshot:
        conn = self._conn
        row = conn.execute("SELECT value FROM meta WHERE key = 'state'").fetchone()
        meta = json.loads(row[0]) if row is not None else {}
        batches = [
            (request_id, json.loads(body))
            for request_id, body in conn.execute("SELECT request_id, body FROM batches ORDER BY served_at, rowid")
        ]
        leases = conn.execute("SELECT * FROM leases WHERE status IN ('open', 'complete')").fetchall()
        in_batches = list({lease_id for _, body in batches for lease_id in body["lease_ids"]})
        leases += _rows_of(conn, "SELECT * FROM leases WHERE status NOT IN ('open', 'complete') AND lease_id IN ({})",
                           in_batches)
        # Plain tuples (the reader has no row factory): one per closed lease remembered.
        remembered = self._reader.execute(
            "SELECT closed_at, lease_id FROM leases WHERE status NOT IN ('open', 'complete') ORDER BY closed_at"
        ).fetchall()
        wanted = [row["lease_id"] for row in leases if row["status"] == "open"]
        rollouts: dict[str, list[tuple[str, bytes | None]]] = {}
        for _, rollout_id, lease_id, data in sorted(
            _rows_of(conn, "SELECT rowid, rollout_id, lease_id, data FROM rollouts WHERE lease_id IN ({})", wanted),
            key=lambda row: row[0],
        ):
            rollouts.setdefault(lease_id, []).append((rollout_id, data))
        workers = {name: json.loads(record) for name, record in conn.execute("SELECT name, record FROM workers")}
        content = [tuple(row) for row in conn.execute("SELECT digest, lease_id, version FROM content")]
        scores = dict(conn.execute("SELECT rollout_id, result FROM scores").fetchall())
        steps: dict[str, list[tuple[str, int, bytes, float | None, int | None]]] = {}
        for _, lease_id, *step in sorted(_rows_of(
            conn, "SELECT rowid, lease_id, rollout_id, step, data, score, seq FROM steps WHERE lease_id IN ({})",
            [row["lease_id"] for row in leases],  # a recovered group's verdicts are its process rewards
        ), key=lambda row: row[0]):
            steps.setdefault(lease_id, []).append(tuple(step))  # type: ignore[arg-type]
        return Snapshot(
            meta=meta, leases=leases, rollouts=rollouts, batches=batches, remembered=remembered, workers=workers,
            content=content, scores=scores, steps=steps,
        )

    # -- lookups (event loop thread; what is committed) -------------------------------------

    def acknowledged(self, rollout_ids: list[str]) -> set[str]:
        """Those of `rollout_ids` the journal holds (acknowledged and not yet forgotten)."""
        return {row[0] for row in _rows_of(self._reader, "SELECT rollout_id FROM rollouts WHERE rollout_id IN ({})", rollout_ids)}

    def closed_lease(self, lease_id: str) -> events.ClosedLease | None:
        """A closed lease and its rollout ids, if the journal still holds it."""
        cursor = self._reader.cursor()
        cursor.row_factory = sqlite3.Row
        row = cursor.execute("SELECT * FROM leases WHERE lease_id = ?", (lease_id,)).fetchone()
        if row is None or row["status"] == "open":
            return None
        ids = [rollout_id for (rollout_id,) in self._reader.execute(
            "SELECT rollout_id FROM rollouts WHERE lease_id = ? ORDER BY rowid", (lease_id,)
        )]
        return events.ClosedLease(lease_of(row), row["holder"], row["status"], row["closed_at"], len(ids), ids)

    def samples(self, lease_id: str) -> list[tuple[str, bytes | None]]:
        """A lease's (rollout id, body) in acceptance order."""
        return self._reader.execute(
            "SELECT rollout_id, data FROM rollouts WHERE lease_id = ? ORDER BY rowid", (lease_id,)
        ).fetchall()


def _seen(future: asyncio.Future[None]) -> None:
    """Marks a commit's failure as seen: a request cancelled while it waited (its client gone)
    would have asyncio log "exception was never retrieved" for a full disk it was not told of."""
    if not future.cancelled():
        future.exception()


def _rows_of(conn: sqlite3.Connection, sql: str, keys: list[str]) -> list[Any]:
    """`sql` (whose `IN ({})` takes the keys) over `keys`, in chunks within SQLite's parameter limit."""
    rows: list[Any] = []
    for start in range(0, len(keys), 500):
        chunk = keys[start:start + 500]
        rows += conn.execute(sql.format(", ".join("?" * len(chunk))), chunk).fetchall()
    return rows


class NullJournal:
    """The journal when journaling is off: `Journal`'s methods, recording nothing; `load()` finds nothing."""

    durable = False
    full = False
    path = "(no journal)"
    failed: BaseException | None = None
    on_commit: Callable[[float, int], None] | None = None
    meta_source: Callable[[], dict[str, Any]] | None = None
    integrity_source: Callable[[], events.IntegrityChanges] | None = None

    def record(self, event: events.Event) -> None:
        pass

    def load(self) -> Snapshot:
        return Snapshot(meta={}, leases=[], rollouts={}, batches=[])

    def acknowledged(self, rollout_ids: list[str]) -> set[str]:
        return set()

    def closed_lease(self, lease_id: str) -> events.ClosedLease | None:
        return None

    def samples(self, lease_id: str) -> list[tuple[str, bytes | None]]:
        return []

    def flush(self) -> None:
        pass

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        pass

    async def commit(self) -> None:
        pass

    async def stop(self) -> None:
        pass

    def close(self) -> None:
        pass


RunJournal = Journal | NullJournal  # what RunState's parts record to
