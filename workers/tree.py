"""A tree lease generated step by step on the hf or vllm backend (issue 47, docs/rewards.md "Pivots").

`generate_tree` plays one lease whose unit is a tree: the root's `group_size` chains are decoded
together, token by token; each finished step (the unit's `boundary`: its marker's text, or a
token count) is posted at once (POST /v1/steps, on a thread: decoding never waits for HTTP), and
the verdicts come back on the worker's one outstanding long-poll (`VerdictFeed`, GET
/v1/verdicts), read without waiting between tokens. A chain whose step is judged under
`stop_below` stops there, whenever the verdict arrives: its completion ends with that step
(`finish_reason = "wrong_step"`). With the unit's `verdict_lag_tokens` N, a step's verdict acts
exactly N of its chain's tokens after the step ended instead (waited for then if it is not in,
held until then if it is), so where chains stop depends on the seed alone, not on the load.
So that the tokens saved are an exact count, a stopped row keeps decoding in the batch, unposted
and uncounted, until it would have ended (an hf batch computes every row anyway). Then `pivots`
pivots are chosen (decentrl/rl/pivots.py, the unit's `rule`) and `k` continuations of each are
decoded from its prefix with the same weights. The samples go back
as `Rollout`s of the unit, root first, each naming its node and its step ends.

A unit with pivots needs its roots' last verdicts before it branches; `play_trees` plays leases
overlapped (`TreePlay`: roots, then pivots and branches), decoding the next lease's roots while
those verdicts come, so that generation does not wait on them.

`keep_cache = False` rebuilds the KV cache from the tokens at every step boundary instead of
keeping it (the measure the issue asks for: benchmarks/pivots.py).

The vllm backend decodes the same way through its engine (`stream_chains`: one request a chain,
stepped one engine step at a time, a branch's prefix found in vLLM's prefix cache); what each
token does, and everything above it, is shared (`Rows`, `TreePlay`, `play_trees`).
"""

from __future__ import annotations

import itertools
import logging
import random
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field

import torch
from transformers import DynamicCache

from decentrl.api.client import OrchestratorClient
from decentrl.api.wire import MAX_STEPS_A_POST, Lease, PartialStep, Rollout, SamplingParams, StepPost, TreeUnit
from decentrl.model.sampling import sampling_distribution
from decentrl.model.stopping import stop_cut
from decentrl.rl.determinism import node_seed, sample_seed
from decentrl.rl.pivots import Candidate, RecoveryEstimate, choose_pivots
from workers.backends import truncates
from workers.backends.hf import HFBackend
from workers.backends.vllm_engine import VLLMBackend

log = logging.getLogger("decentrl.worker.tree")


class VerdictFeed:
    """The verdicts on this worker's posted steps, kept as they come: a thread keeps one
    GET /v1/verdicts outstanding; generation reads `score` and never waits."""

    def __init__(self, client: OrchestratorClient, worker_id: str, wait_s: float = 5.0) -> None:
        self.client = client
        self.worker_id = worker_id
        self.wait_s = wait_s
        self.scores: dict[tuple[str, int], float] = {}
        self.after = 0
        self._came = threading.Condition()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="verdicts", daemon=True)

    def start(self) -> VerdictFeed:
        self._thread.start()
        return self

    def close(self, wait: bool = True) -> None:
        self._stop.set()
        if wait:
            self._thread.join(timeout=self.client.timeout_s + self.wait_s + 1)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                answer = self.client.verdicts(self.worker_id, self.after, wait_s=self.wait_s)
            except Exception as exc:  # noqa: BLE001 - the client retried; verdicts are an optimization, never waited for
                if self._stop.is_set():
                    return
                log.warning("verdicts unreachable (%s); asking again in 1 s", exc)
                self._stop.wait(1.0)
                continue
            with self._came:
                for verdict in answer.verdicts:
                    self.scores[(verdict.rollout_id, verdict.step)] = verdict.score
                self.after = answer.last
                self._came.notify_all()

    def score(self, rollout_id: str, step: int) -> float | None:
        return self.scores.get((rollout_id, step))

    def wait_for(self, keys: set[tuple[str, int]], timeout_s: float) -> float:
        """Waits until every `(rollout_id, step)` of `keys` has its verdict, or `timeout_s`;
        returns the seconds waited. For choosing pivots only: decoding never calls it."""
        started = time.perf_counter()
        with self._came:
            self._came.wait_for(lambda: keys <= self.scores.keys() or self._stop.is_set(), timeout=timeout_s)
        return time.perf_counter() - started


@dataclass
class Chain:
    """One sample being generated: its prompt, tokens, and where its steps end."""

    rollout_id: str
    prompt: list[int]
    budget: int  # most completion tokens
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    masks: list[list[int]] = field(default_factory=list)  # each token's kept ids, with top-k/top-p (else empty)
    ends: list[int] = field(default_factory=list)  # token counts at each step's end
    finish: str | None = None
    cut: int | None = None  # a stopped chain: its length at the wrong step's end
    shadow: int = 0  # tokens a stopped chain decoded after its stop, unposted: the tokens saved
    node: dict[str, object] | None = None
    wrong_from: int | None = None  # the first step judged wrong (0-based)
    seed: int | None = None  # its own generator's seed (a seeded unit: `generate_tree`'s `seed`)


@dataclass
class TreeCounts:
    generated: int = 0  # completion tokens posted (kept in samples)
    saved: int = 0  # tokens stopped chains would still have generated
    discarded: int = 0  # tokens decoded after a wrong step before its verdict came (not posted)
    steps_posted: int = 0
    step_post_wait_s: float = 0.0  # time decoding waited for a step post (0: it never does)
    verdicts_used: int = 0
    verdict_wait_s: float = 0.0  # time waited for verdicts: the roots' last before the pivots; with verdict_lag_tokens, each at its lag
    verdict_timeouts: int = 0  # waits that ended with a verdict still missing (units whose pivots were chosen so, verdicts past their lag)
    # Without verdict_lag_tokens, the lag the machine gives: for each verdict read while its batch
    # decoded, the tokens its row was fed after its step ended (decoding steps); `verdict_lags_unseen`,
    # for each step whose verdict came only after its batch ended, those fed by then (its lag was longer).
    verdict_lags: list[int] = field(default_factory=list)
    verdict_lags_unseen: list[int] = field(default_factory=list)
    decode_s: float = 0.0
    decode_steps: int = 0  # batched decoding steps (one token for every row of a batch): the work, apart from the machine's speed
    cache_rebuild_s: float = 0.0
    branch_prompt_tokens: int = 0  # prompt tokens of the branches decoded (their root's prompt and prefix)
    branch_cached_tokens: int = 0  # of them, found in the engine's prefix cache, not prefilled (vllm; hf: 0)
    short: int = 0  # units sent with fewer pivots than their lease's: their roots had fewer step boundaries (none: roots alone)
    unbranched: int = 0  # units that branch `all_failed` sent as their roots alone: a root was known right


def _ends_step(text_of: Callable[[list[int]], str], chain: Chain, unit: TreeUnit) -> bool:
    start = chain.ends[-1] if chain.ends else 0
    if unit.boundary.type == "tokens":
        return len(chain.tokens) - start >= unit.boundary.tokens
    return text_of(chain.tokens[start:]).endswith(unit.boundary.marker)


class Rows:
    """What chains decoded together do with each token, whatever decodes them (the hf loop below,
    vLLM's engine: `stream_chains`): `take` appends a row's token (its logprob, and its kept ids
    with top-k/top-p), ends its step (posted through `on_step(chain, step)`) or the chain
    ("stop": end-of-sequence or a stop string, as the plain hf path ends a row; "length": its
    budget); `judge` reads the verdicts come in meanwhile, never waiting, and stops a chain at the
    first of its steps judged under the unit's `stop_below`. So that the tokens saved are an exact count, a stopped row goes on being
    fed, unposted and uncounted, until it would have ended (its shadow, counted as saved).

    With the unit's `verdict_lag_tokens` N, a step's verdict acts on the token that puts its chain N
    tokens past the step's end: `take` waits for it there (`await_verdict`, which counts the wait),
    and `judge` holds a verdict come in earlier until then; a chain that ends first is not stopped.

    Stop strings are looked for in a row's own tokens (`stop_cut`, as the plain hf path does):
    a root's completion, a branch's continuation - never its prompt, its root's prefix included.
    So a stop string begun in a branch's prefix and completed in its continuation does not end
    the branch, just as a plain completion never ends on a stop string begun in its prompt, and as
    the orchestrator checks a "stop" sample (its completion ids alone: `ends_generation`)."""

    def __init__(
        self, chains: list[Chain], unit: TreeUnit, *, text_of: Callable[[list[int]], str], eos_ids: set[int], stops: list[str],
        on_step: Callable[[Chain, int], None], verdict: Callable[[str, int], float | None], counts: TreeCounts,
        await_verdict: Callable[[str, int], float | None] | None = None,
    ) -> None:
        self.chains, self.unit, self.text_of, self.eos_ids, self.stops = chains, unit, text_of, eos_ids, stops
        self.on_step, self.verdict, self.counts, self.await_verdict = on_step, verdict, counts, await_verdict
        self.lag = unit.verdict_lag_tokens if unit.stop_below is not None else None
        if self.lag is not None and await_verdict is None:
            raise ValueError("a unit with verdict_lag_tokens waits for verdicts at their lag: give await_verdict")
        self.seen: set[tuple[int, int]] = set()  # (row, step) whose verdict was read (verdict_lags)
        self.fed: list[list[int]] = [[] for _ in chains]  # every token a row was fed, its shadow's too
        self.shadow = [0] * len(chains)
        self.shadowing = [False] * len(chains)

    def take(self, row: int, token: int, logprob: float, kept: list[int] | None = None) -> bool:
        """Row `row`'s next token, its sampling logprob and (with top-k/top-p) the vocabulary ids
        it was sampled among; whether it ended a step."""
        chain = self.chains[row]
        self.fed[row].append(token)
        if self.shadowing[row]:
            self.shadow[row] += 1
            self.shadowing[row] = self._ending(row) is None
            return False
        if chain.finish is not None:
            return False
        chain.tokens.append(token)
        chain.logprobs.append(logprob)
        if kept is not None:
            chain.masks.append(kept)
        chain.finish = self._ending(row)
        start = chain.ends[-1] if chain.ends else 0
        ended = _ends_step(self.text_of, chain, self.unit) or (chain.finish is not None and len(chain.tokens) > start)
        if ended:
            chain.ends.append(len(chain.tokens))
            self.on_step(chain, len(chain.ends) - 1)
        if self.lag is not None and chain.finish is None and (due := len(chain.tokens) - self.lag) in chain.ends:
            assert self.await_verdict is not None
            self.await_verdict(chain.rollout_id, chain.ends.index(due))  # in, or verdict_wait_s gone (counted)
            self._judge_row(row)
        return ended

    def _ending(self, row: int) -> str | None:
        """How row `row`'s last token fed ends it: "stop" (end-of-sequence, or it completes a stop
        string), "length" (its budget), or None (it goes on). An open chain's tokens are its fed ones."""
        fed = self.fed[row]
        if fed[-1] in self.eos_ids or stop_cut(self.text_of, fed, self.stops, start=len(fed) - 1) is not None:
            return "stop"
        return "length" if len(fed) >= self.chains[row].budget else None

    def judge(self) -> None:
        """The verdicts come in meanwhile, read without waiting: a chain with a step under
        `stop_below` is cut at that step's end (`finish_reason = "wrong_step"`); with
        `verdict_lag_tokens`, only a step at least that many tokens behind its chain's end."""
        if self.unit.stop_below is None:
            return
        for row, chain in enumerate(self.chains):
            if self.lag is None:
                self._measure(row)
            if chain.finish is None:
                self._judge_row(row)

    def _judge_row(self, row: int) -> None:
        assert self.unit.stop_below is not None
        chain = self.chains[row]
        for step, end in enumerate(chain.ends):
            if self.lag is not None and end + self.lag > len(chain.tokens):
                return  # held: it acts `lag` tokens after its step ended
            score = self.verdict(chain.rollout_id, step)
            if score is not None and score < self.unit.stop_below:
                self.counts.verdicts_used += 1
                chain.wrong_from, chain.cut = step, end
                self.counts.discarded += len(chain.tokens) - end  # decoded before the verdict acted
                del chain.tokens[end:], chain.logprobs[end:], chain.masks[end:], chain.ends[step + 1:]
                chain.finish = "wrong_step"
                self.shadowing[row] = self._ending(row) is None
                return

    def _measure(self, row: int) -> None:
        """`verdict_lags`: each verdict first read, the tokens its row was fed after its step ended."""
        chain = self.chains[row]
        for step, end in enumerate(chain.ends):
            if (row, step) not in self.seen and self.verdict(chain.rollout_id, step) is not None:
                self.seen.add((row, step))
                self.counts.verdict_lags.append(len(self.fed[row]) - end)

    def open(self, row: int) -> bool:
        """Whether row `row` is still fed: its chain goes on, or its shadow does."""
        return self.chains[row].finish is None or self.shadowing[row]

    def done(self) -> bool:
        return not any(self.open(row) for row in range(len(self.chains)))

    def close(self) -> None:
        """Decoding over: a chain still open ends at its budget; the shadows are counted as saved."""
        for chain in self.chains:
            if chain.finish is None:
                chain.finish = "length"
        if self.lag is None and self.unit.stop_below is not None:
            self.counts.verdict_lags_unseen += [len(self.fed[row]) - end for row, chain in enumerate(self.chains)
                                                for step, end in enumerate(chain.ends) if (row, step) not in self.seen]
        self.counts.saved += sum(self.shadow)
        self.counts.branch_prompt_tokens += sum(len(chain.prompt) for chain in self.chains if chain.node is not None)


@torch.no_grad()
def decode_chains(
    backend: HFBackend, chains: list[Chain], sampling: SamplingParams, unit: TreeUnit, *,
    on_step: Callable[[Chain, int], None], verdict: Callable[[str, int], float | None], counts: TreeCounts,
    keep_cache: bool = True, await_verdict: Callable[[str, int], float | None] | None = None,
) -> None:
    """Decode `chains` together to their ends on the hf backend, token by token (`Rows` says what
    each token does): every row is fed one token an iteration, finished or not, so that the rows
    stay aligned. With top-k/top-p each token's kept ids are those its row's distribution keeps
    (finite), as the plain path records them (workers/backends/hf.py)."""
    model = backend.model
    assert model is not None, "load() a version before decoding"
    eos_ids, pad = backend._eos_and_pad()
    started = time.perf_counter()
    rows = Rows(chains, unit, text_of=backend._text, eos_ids=eos_ids, stops=sampling.stop, on_step=on_step, verdict=verdict,
                counts=counts, await_verdict=await_verdict)

    def prefill(seqs: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, DynamicCache]:
        width = max(map(len, seqs))
        ids = torch.tensor([[pad] * (width - len(s)) + s for s in seqs], device=backend.device)
        attention = torch.tensor([[0] * (width - len(s)) + [1] * len(s) for s in seqs], device=backend.device)
        positions = (attention.cumsum(-1) - 1).clamp(min=0)
        cache = DynamicCache()
        logits = model(input_ids=ids, attention_mask=attention, position_ids=positions, use_cache=True,
                       **{backend._cache_arg: cache}).logits[:, -1]
        return logits, attention, positions[:, -1:], cache

    # Seeded chains draw from their own generators, one token an iteration each (a stopped row's
    # shadow included): a row's tokens depend on its seed alone, not on when a verdict came.
    seeded = all(c.seed is not None for c in chains)
    generators = [torch.Generator(device=backend.device).manual_seed(c.seed) for c in chains] if seeded else None  # type: ignore[arg-type]
    record_mask = truncates(sampling)
    logits, attention, position, cache = prefill([c.prompt for c in chains])
    for _ in range(max(c.budget for c in chains)):
        counts.decode_steps += 1
        dist = sampling_distribution(logits, sampling)
        chosen = backend._sample(dist, generators)  # (B, 1)
        picked, chosen_lp = torch.cat([chosen.double(), dist.gather(-1, chosen).double()], dim=-1).T.tolist()
        finite = torch.isfinite(dist) if record_mask else None
        boundary = False
        for row, chain in enumerate(chains):
            # Only a chain that takes the token keeps its kept ids (a shadow's are never sent).
            kept = finite[row].nonzero().squeeze(-1).tolist() if finite is not None and chain.finish is None else None
            boundary |= rows.take(row, int(picked[row]), chosen_lp[row], kept)
        rows.judge()
        if rows.done():
            break
        if boundary and not keep_cache:  # the measure: the cache rebuilt from every row's tokens at a step's end
            rebuilt = time.perf_counter()
            logits, attention, position, cache = prefill([chain.prompt + rows.fed[row] for row, chain in enumerate(chains)])
            counts.cache_rebuild_s += time.perf_counter() - rebuilt
            continue
        attention = torch.cat([attention, attention.new_ones(len(chains), 1)], dim=-1)
        position = position + 1
        logits = model(input_ids=chosen, attention_mask=attention, position_ids=position, use_cache=True,
                       **{backend._cache_arg: cache}).logits[:, -1]
    rows.close()
    counts.decode_s += time.perf_counter() - started


def stream_chains(
    backend: VLLMBackend, chains: list[Chain], sampling: SamplingParams, unit: TreeUnit, *,
    on_step: Callable[[Chain, int], None], verdict: Callable[[str, int], float | None], counts: TreeCounts,
    await_verdict: Callable[[str, int], float | None] | None = None,
) -> None:
    """Decode `chains` together to their ends on the vllm backend: one request a chain, its prompt
    the chain's (a branch's: its root's prompt and prefix, found in the engine's prefix cache),
    streamed one engine step at a time (`VLLMBackend.stream`), each step's new tokens taken as the
    hf loop takes them (`Rows`), the verdicts read between engine steps. A stopped chain's request
    goes on as its shadow; the engine ends a request where `Rows` ends its row at the same
    end-of-sequence ids or its budget, and a row `Rows` ends at a stop string has its request
    aborted (`EngineStream.end`). With top-k/top-p the stream returns each token's kept ids (its
    finite processed logprobs, as the plain vllm path records them)."""
    started = time.perf_counter()
    eos_ids = backend.eos_ids()
    rows = Rows(chains, unit, text_of=backend._text, eos_ids=eos_ids, stops=sampling.stop, on_step=on_step, verdict=verdict,
                counts=counts, await_verdict=await_verdict)
    with backend.stream([c.prompt for c in chains], sampling, budgets=[c.budget for c in chains],
                        seeds=[c.seed for c in chains], stop_ids=eos_ids) as stream:
        while not rows.done() and stream.running():
            counts.decode_steps += 1
            for row, tokens, logprobs, masks in stream.step():
                for token, logprob, kept in zip(tokens, logprobs, masks, strict=True):
                    rows.take(row, token, logprob, kept)
                if not rows.open(row):  # ended by `Rows` at a stop string, which the engine does not look for
                    stream.end(row)
            rows.judge()
        counts.branch_cached_tokens += sum(stream.cached[row] for row, chain in enumerate(chains) if chain.node is not None)
    rows.close()
    counts.decode_s += time.perf_counter() - started


class TreePlay:
    """One tree lease in play: `start` decodes its roots (their steps posted as they end, their
    verdicts still coming), `finish` chooses its pivots on the verdicts in by then and decodes
    their branches. Between the two the worker is free to decode another unit's roots
    (`play_trees`): the verdicts come meanwhile, and act when `finish` reads them."""

    def __init__(
        self, backend: HFBackend | VLLMBackend, client: OrchestratorClient, lease: Lease, sampling: SamplingParams, *, run_name: str,
        worker_id: str, feed: VerdictFeed, counts: TreeCounts, keep_cache: bool = True, seed: int | None = None,
        verdict_wait_s: float = 5.0,
    ) -> None:
        if not isinstance(lease.unit, TreeUnit):
            raise ValueError(f"lease {lease.lease_id} is not a tree unit")
        self.backend, self.client, self.lease, self.sampling, self.unit = backend, client, lease, sampling, lease.unit
        self.run_name, self.worker_id, self.feed, self.counts = run_name, worker_id, feed, counts
        self.keep_cache, self.seed, self.verdict_wait_s = keep_cache, seed, verdict_wait_s
        self.version = lease.policy_version if lease.policy_version is not None else backend.version or 0
        self.posting = ThreadPoolExecutor(1, thread_name_prefix="steps")
        self.posts: list[Future[object]] = []
        # Steps that ended while a post was on its way go together in the next one (a batch's
        # rows end steps at once: one HTTP round trip for all, not one each).
        self._unsent: list[PartialStep] = []
        self._flushing = False
        self._lock = threading.Lock()
        self.roots = [Chain(uuid.uuid4().hex, list(lease.prompt_token_ids), sampling.max_tokens,
                            seed=None if seed is None else sample_seed(seed, lease.prompt_id, j, self.version))
                      for j in range(lease.group_size)]

    def _on_step(self, chain: Chain, step: int) -> None:
        start = chain.ends[step - 1] if step else 0
        posted = PartialStep(
            rollout_id=chain.rollout_id, step=step, token_ids=chain.tokens[start : chain.ends[step]],
            logprobs=chain.logprobs[start : chain.ends[step]], prompt_token_ids=chain.prompt if step == 0 else None,
        )
        self.counts.steps_posted += 1
        with self._lock:
            self._unsent.append(posted)
            if self._flushing:  # a post not yet started takes it along
                return
            self._flushing = True
        self.posts.append(self.posting.submit(self._flush))

    def _flush(self) -> None:
        with self._lock:
            steps, self._unsent, self._flushing = self._unsent, [], False
        for start in range(0, len(steps), MAX_STEPS_A_POST):
            post = StepPost(lease_id=self.lease.lease_id, worker_id=self.worker_id, steps=steps[start : start + MAX_STEPS_A_POST])
            self.client.post_steps(post)

    def _decode(self, chains: list[Chain], on_step: Callable[[Chain, int], None] | None = None) -> None:
        """Decode `chains` (this unit's, or with other units' of the same sampling and unit:
        `start_together`, each step posted by `on_step`, else by this play)."""
        on_step = on_step or self._on_step
        if isinstance(self.backend, VLLMBackend):
            stream_chains(self.backend, chains, self.sampling, self.unit, on_step=on_step, verdict=self.feed.score,
                          counts=self.counts, await_verdict=self._await_verdict)
            return
        decode_chains(self.backend, chains, self.sampling, self.unit, on_step=on_step, verdict=self.feed.score,
                      counts=self.counts, keep_cache=self.keep_cache, await_verdict=self._await_verdict)

    def _await_verdict(self, rollout_id: str, step: int) -> float | None:
        """A step's verdict at its lag (`verdict_lag_tokens`): at once if in, else waited for up to
        `verdict_wait_s` (counted; a timeout too)."""
        if (score := self.feed.score(rollout_id, step)) is not None:
            return score
        self.counts.verdict_wait_s += self.feed.wait_for({(rollout_id, step)}, self.verdict_wait_s)
        score = self.feed.score(rollout_id, step)
        self.counts.verdict_timeouts += score is None
        return score

    def _seeded(self, node: str, index: int) -> int | None:
        return None if self.seed is None else node_seed(self.seed, self.lease.prompt_id, self.version, node, index)

    def start(self) -> TreePlay:
        self._decode(self.roots)
        return self

    def finish(self, *, rng: random.Random, estimate: RecoveryEstimate, rule: str | None = None) -> list[Rollout]:
        unit, roots, feed, lagged = self.unit, self.roots, self.feed, self.unit.verdict_lag_tokens is not None
        try:
            # A run whose steps no scorer has judged yet never waits, unless its verdicts act at a
            # fixed lag (its chains waited for them already): then the pick never depends on timing,
            # and the unit is sent with every verdict in (pivots or not), so that its process rewards
            # (the reward stage's `step_verdicts`, read as the unit completes) do not either.
            if (unit.pivots and feed.scores) or lagged:
                _await_verdicts(roots, self.posts, feed, self.counts, self.verdict_wait_s)
            picker = rng if self.seed is None else random.Random(self._seeded("pivots", 0))
            if unit.pivots and unit.branch == "all_failed" and any(unit.known_right(_verdicts(chain, feed)) for chain in roots):
                pivots = []  # its group has a right sample: no branches (orchestrator/leases.py `tree_pivots`)
                self.counts.unbranched += 1
            else:
                pivots = _pivots(roots, unit, feed, picker, estimate, rule or unit.rule)
                self.counts.short += len(pivots) < unit.pivots
            branches = []
            for n, pivot in enumerate(pivots):
                j, parent = next((j, chain) for j, chain in enumerate(roots) if chain.rollout_id == pivot.rollout_id)
                node = {"node_id": f"b{n}", "parent": {"rollout_id": parent.rollout_id, "at": pivot.at}}
                branches += [
                    Chain(uuid.uuid4().hex, parent.prompt + parent.tokens[: pivot.at], self.sampling.max_tokens - pivot.at,
                          node=node, seed=self._seeded(f"{j}@{pivot.at}", i))
                    for i in range(unit.k)
                ]
            if branches:
                self._decode(branches)
                if lagged:  # the estimate learns from every branch verdict, whenever it comes
                    _await_verdicts(branches, self.posts, feed, self.counts, self.verdict_wait_s)
            for pivot, start in zip(pivots, range(0, len(branches), unit.k), strict=True):
                for chain in branches[start : start + unit.k]:  # the online estimate learns how often a depth recovers
                    right = chain.finish == "stop" and chain.wrong_from is None and not _judged_wrong(chain, unit, feed)
                    estimate.update(pivot.ratio, right)
            waited = time.perf_counter()
            for future in self.posts:
                future.result()  # a step post that failed fails the lease (it expires and goes to another worker)
            self.counts.step_post_wait_s += time.perf_counter() - waited
        finally:
            self.posting.shutdown(wait=False)
        samples = []
        for chain in roots + branches:
            self.counts.generated += len(chain.tokens)
            samples.append(Rollout(
                rollout_id=chain.rollout_id, run_name=self.run_name, lease_id=self.lease.lease_id, prompt_id=self.lease.prompt_id,
                worker_id=self.worker_id, policy_version=self.backend.version or 0, prompt_token_ids=chain.prompt,
                completion_token_ids=chain.tokens, logprobs=chain.logprobs, finish_reason=chain.finish,  # type: ignore[arg-type]
                sampling=self.sampling, sampling_mask=chain.masks if truncates(self.sampling) else None, node=chain.node,
                step_ends=chain.ends,
            ))
        return samples

    def drop(self) -> None:
        """A play never finished (its caller stopped): its step posts sent, nothing more."""
        self.posting.shutdown(wait=False)


def start_together(plays: list[TreePlay]) -> None:
    """`TreePlay.start` of every play, their roots decoded in one batch (one engine batch on vllm,
    one padded batch on hf) where they share their sampling and unit, each step posted by its own
    play; else one play after the other. Seeded rows draw the same tokens either way on vllm (a
    request's generator is its own; tests/workers/test_worker_vllm.py)."""
    first = plays[0]
    if len(plays) == 1 or any(play.sampling != first.sampling or play.unit != first.unit for play in plays):
        for play in plays:
            play.start()
        return
    owner = {chain.rollout_id: play for play in plays for chain in play.roots}
    first._decode([chain for play in plays for chain in play.roots],
                  on_step=lambda chain, step: owner[chain.rollout_id]._on_step(chain, step))


def generate_tree(
    backend: HFBackend | VLLMBackend, client: OrchestratorClient, lease: Lease, sampling: SamplingParams, *, run_name: str,
    worker_id: str, feed: VerdictFeed, rng: random.Random, estimate: RecoveryEstimate, counts: TreeCounts,
    keep_cache: bool = True, rule: str | None = None, verdict_wait_s: float = 5.0, seed: int | None = None,
) -> list[Rollout]:
    """One tree lease's samples (module docstring): its root's chains, then `k` continuations of
    each of `pivots` pivots; `rule` overrides the unit's (a benchmark's arms). Before choosing
    pivots, it waits up to `verdict_wait_s` for the verdicts of every root step posted (once this
    worker has had a verdict at all: a run without step scorers never waits): a chain
    goes wrong most often at its last steps, whose verdicts cannot be in when it ends, and a
    failed chain not known as failed is no candidate (or, for `last_right`, is branched past its
    wrong step, where no branch can recover). `play_trees` decodes another unit's roots during
    that wait instead.

    With `seed` (the run's), the unit is seeded (decentrl/rl/determinism.py): root j draws from
    `sample_seed(seed, prompt_id, j, version)` (the sample a plain group's j draws), the pivots are
    chosen with a `Random` seeded from the unit (`node_seed(..., "pivots", 0)`; `rng` unused), and
    continuation i of the pivot at token `at` of root j from `node_seed(..., f"{j}@{at}", i)`: the
    same unit at the same version gives the same samples, whenever its verdicts come (as long as
    the roots' last verdicts are in within `verdict_wait_s`: `counts.verdict_timeouts` says when not)."""
    play = TreePlay(backend, client, lease, sampling, run_name=run_name, worker_id=worker_id, feed=feed, counts=counts,
                    keep_cache=keep_cache, seed=seed, verdict_wait_s=verdict_wait_s)
    return play.start().finish(rng=rng, estimate=estimate, rule=rule)


def play_trees(
    backend: HFBackend | VLLMBackend, client: OrchestratorClient, leases: Iterable[tuple[Lease, SamplingParams]], *, run_name: str,
    worker_id: str, feed: VerdictFeed, rng: random.Random, estimate: RecoveryEstimate, counts: TreeCounts,
    keep_cache: bool = True, rule: str | None = None, verdict_wait_s: float = 5.0, seed: int | None = None, ahead: int = 1,
    width: int = 1,
) -> Iterator[tuple[Lease, list[Rollout]]]:
    """Tree leases played in order, each as `generate_tree` plays it, but overlapped: the roots of
    the next `ahead` leases are decoded before a lease's pivots are chosen, so the worker decodes
    while that lease's last verdicts come, instead of waiting for them (0: one lease at a time).
    `leases` is pulled lazily, `width` leases at a time whose roots are decoded together
    (`start_together`; 1: each lease's alone), ahead of the one finishing: a caller that leases on
    demand holds at most `ahead + width - 1` unfinished units. Pivots are chosen, and the estimate
    learns, in the leases' order, so a seeded lease gives the same samples played either way; all
    must be played at one version (a swap between a lease's roots and its branches would split its tree)."""
    pending: deque[TreePlay] = deque()
    source = iter(leases)
    try:
        while batch := list(itertools.islice(source, width)):
            plays = [TreePlay(backend, client, lease, sampling, run_name=run_name, worker_id=worker_id, feed=feed,
                              counts=counts, keep_cache=keep_cache, seed=seed, verdict_wait_s=verdict_wait_s)
                     for lease, sampling in batch]
            pending.extend(plays)
            start_together(plays)
            while len(pending) > ahead:
                play = pending.popleft()
                yield play.lease, play.finish(rng=rng, estimate=estimate, rule=rule)
        while pending:
            play = pending.popleft()
            yield play.lease, play.finish(rng=rng, estimate=estimate, rule=rule)
    finally:
        for play in pending:
            play.drop()


def _await_verdicts(
    chains: list[Chain], posts: list[Future[object]], feed: VerdictFeed, counts: TreeCounts, timeout_s: float
) -> None:
    """The chains' step posts sent, then their verdicts in (or `timeout_s` gone): counted."""
    started = time.perf_counter()
    wait(list(posts), timeout=timeout_s)  # a post that failed fails the lease at the unit's end
    keys = {(chain.rollout_id, step) for chain in chains for step in range(len(chain.ends))}
    feed.wait_for(keys, max(0.0, timeout_s - (time.perf_counter() - started)))
    counts.verdict_wait_s += time.perf_counter() - started
    counts.verdict_timeouts += not keys <= feed.scores.keys()


def _verdicts(chain: Chain, feed: VerdictFeed) -> list[float | None]:
    """The verdict known now on each of `chain`'s steps (None: not in)."""
    return [feed.score(chain.rollout_id, step) for step in range(len(chain.ends))]


def _judged_wrong(chain: Chain, unit: TreeUnit, feed: VerdictFeed) -> bool:
    """Whether a verdict known now judges one of `chain`'s steps wrong."""
    return any(score is not None and score < unit.wrong_below for score in _verdicts(chain, feed))


def _pivots(
    roots: list[Chain], unit: TreeUnit, feed: VerdictFeed, rng: random.Random, estimate: RecoveryEstimate, rule: str
) -> list[Candidate]:
    """The unit's `pivots` step boundaries to branch from: among the chains known to have failed
    (a step judged wrong: DEEP-GRPO branches failed trajectories) when there are enough, else
    among all; never a chain's end. As many as the unit's pivots, or every boundary if they are
    fewer: the unit the orchestrator completes (orchestrator/leases.py `tree_pivots`)."""
    threshold = unit.wrong_below
    candidates, failed = [], []
    for chain in roots:
        wrong = chain.wrong_from
        if wrong is None:
            wrong = next((s for s in range(len(chain.ends)) if (v := feed.score(chain.rollout_id, s)) is not None and v < threshold), None)
        for step, at in enumerate(chain.ends[:-1]):
            candidate = Candidate(chain.rollout_id, step + 1, len(chain.ends), at, None if wrong is None else wrong + 1)
            candidates.append(candidate)
            if wrong is not None:
                failed.append(candidate)
    wanted = min(unit.pivots, len(candidates))
    chosen = choose_pivots(failed, wanted, rule, rng, estimate=estimate, gamma=unit.gamma)  # type: ignore[arg-type]
    # Topped up from the rest by the rule, then at random where the rule picks no more (`last_right`
    # takes one boundary a chain, none past a wrong step).
    for pick in (rule, "random"):
        if len(chosen) < wanted:
            rest = [c for c in candidates if c not in chosen]
            chosen += choose_pivots(rest, wanted - len(chosen), pick, rng, estimate=estimate, gamma=unit.gamma)  # type: ignore[arg-type]
    return chosen
