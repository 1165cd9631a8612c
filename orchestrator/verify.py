"""Logprob spot-checks: recompute a rollout's per-token sampling logprobs under its claimed version.

Runs on the verification scheduler's one worker thread (orchestrator/verification.py), off the
event loop. A version is loaded once into one of `models_cached` models, computing in the dtype it
was published in where this CPU computes it natively, else in fp32 (`compute_dtype`); weights that
cannot be loaded leave its rollouts `unverifiable` (nobody struck) and never end the thread. The
rule, its calibration and its cost: docs/security.md and docs/store.md.
"""

from __future__ import annotations

import logging
import math
import time
from collections import OrderedDict, defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from decentrl.api.wire import Rollout, SamplingParams
from decentrl.config import VerificationConfig
from decentrl.rl.determinism import sample_seed
from decentrl.store.checkpoints import CheckpointStore, StoreError

if TYPE_CHECKING:
    import torch


log = logging.getLogger("decentrl.orchestrator.verify")

MEAN_TOKENS = 16  # the mean bound holds for a completion of at least this many tokens (Judged.mean)


def _token_versions(rollout: Rollout) -> list[int | None]:
    """Per completion token, the version that sampled it (`token_versions` when the completion
    spanned a weight swap); None for an environment token (loss_mask 0), which nobody sampled."""
    count = len(rollout.completion_token_ids)
    versions = rollout.token_versions or [rollout.policy_version] * count
    return [v if m else None for v, m in zip(versions, rollout.loss_mask or [1] * count, strict=True)]


def _judged_at_the_boundary(
    logits: torch.Tensor, targets: torch.Tensor, chosen: torch.Tensor, sampling: SamplingParams, slack: float
) -> torch.Tensor:
    """`chosen` (N,), where a target lies outside the kept set (-inf) but is kept once its own
    tempered logit is `slack` higher, replaced by its logprob in the kept set widened by it: the
    worker's rounding kept a token at the top-k/top-p boundary that the verifier's dropped.
    `logits` (N, V) and `targets` (N, 1) of the same positions."""
    import torch

    from decentrl.model.sampling import sampling_distribution

    outside = chosen == -math.inf  # (N,)
    if not outside.any():
        return chosen
    rows, ids = logits[outside].float(), targets[outside]  # (M, V), (M, 1)
    raised = rows.scatter_add(-1, ids, torch.full(ids.shape, slack * sampling.temperature))
    near = sampling_distribution(raised, sampling).gather(-1, ids).squeeze(-1).isfinite()  # (M,)
    kept = sampling_distribution(rows, sampling).isfinite().scatter(-1, ids, True)  # (M, V)
    widened = torch.log_softmax((rows / sampling.temperature).masked_fill(~kept, -math.inf), dim=-1)
    judged = torch.where(near, widened.gather(-1, ids).squeeze(-1), -math.inf)  # (M,)
    return chosen.masked_scatter(outside, judged)


@dataclass
class Judged:
    """One rollout's |claimed - recomputed| logprobs over the tokens it sampled, of every version."""

    worst: float = 0.0  # inf: a token outside the kept set, or a claimed logprob that is not a number
    total: float = 0.0
    tokens: int = 0
    reproduced: bool = True  # every token is its seed's draw (deterministic runs)
    unverifiable: bool = False  # a version it needs cannot be loaded

    @property
    def mean(self) -> float:
        """Over at least MEAN_TOKENS tokens (those a short completion lacks count as 0): a mean of a
        few tokens is one token's noise, which the per-token bound judges already."""
        return self.total / max(self.tokens, MEAN_TOKENS)


class Verifier:
    def __init__(
        self, config: VerificationConfig, *, store: CheckpointStore, cache_dir: str,
        build: Callable[[], torch.nn.Module], run_seed: int | None = None,
    ) -> None:
        """`build` makes a model of the run's architecture; versions are copied into one in place.
        `cache_dir` receives the versions that are pulled (a LoRA adapter and its base, a delta).
        `run_seed`: a deterministic run's seed; its samples' tokens are re-drawn too."""
        self.config = config
        self.run_seed = run_seed
        self.store = store
        self.cache_dir = cache_dir
        self.build = build
        self._models: OrderedDict[int, torch.nn.Module] = OrderedDict()  # version -> model, most recent last
        self._spare: list[torch.nn.Module] = []  # built, no version loaded yet
        self.compute_s = 0.0  # wall time of checks, loads included
        self.cpu_s = 0.0  # checking thread's CPU time + pulls' wall time (they hash on the store's threads)
        self.load_s = 0.0  # part of compute_s: reading, verifying and copying in weights
        self.load_cpu_s = 0.0  # part of cpu_s
        self.forward_s = 0.0  # part of compute_s: forwards and distributions
        self.forward_cpu_s = 0.0  # part of cpu_s
        self.draw_s = 0.0  # part of forward_s: the seeded re-draws (deterministic runs)
        self.startup_s = 0.0  # warm_up's imports and model builds: not in compute_s
        self.checks = 0  # batches checked (one forward per version in each)
        self.loads = 0  # versions loaded
        self.rollouts_checked = 0
        # The honest noise seen so far, to watch against the bounds in force.
        self.largest_passing_diff = 0.0
        self.largest_passing_mean_diff = 0.0
        # (per-token, mean) bounds of the run's publish dtype, known once a version is loaded.
        self.tolerances = (config.tolerance, config.tolerance)
        self.dtype: torch.dtype | None = None  # the models compute in it, known once a version is loaded

    def warm_up(self) -> None:
        """Import torch and the model code and build the models now, not in the first check. Errors
        propagate: the caller logs them, and the first check builds what it needs itself."""
        started = time.perf_counter()
        import torch

        import decentrl.model.sampling  # noqa: F401
        import decentrl.store.weights  # noqa: F401

        torch.set_num_threads(self.config.torch_threads)
        while len(self._spare) + len(self._models) < self.config.models_cached:
            self._spare.append(self._build())
        self.startup_s += time.perf_counter() - started

    def _build(self) -> torch.nn.Module:
        import torch

        with torch.no_grad():
            return self.build().eval()

    def _model(self, version: int) -> torch.nn.Module:
        found = self._models.pop(version, None)
        if found is None:
            started, cpu_started = time.perf_counter(), time.thread_time()
            found = self._load(version)
            self.loads += 1
            self.load_s += time.perf_counter() - started
            self.load_cpu_s += time.thread_time() - cpu_started
        self._models[version] = found
        return found

    def _load(self, version: int) -> torch.nn.Module:
        """A model holding `version`'s weights: a spare, a new build or the least recently used one,
        overwritten in place, all or nothing (weights that cannot be read change no model)."""
        import torch

        from decentrl.model.devices import compute_dtype, machine
        from decentrl.store.weights import copy_into, published_dtype

        torch.set_num_threads(self.config.torch_threads)
        weights = self._weights(version)
        if self._spare:
            model = self._spare.pop()
        elif len(self._models) >= self.config.models_cached:
            model = self._models.popitem(last=False)[1]
        else:
            model = self._build()
        try:
            published = published_dtype(weights)
            dtype = compute_dtype(self.config.compute_dtype, torch.device("cpu"), published)
            if dtype != self.dtype:
                log.info("verifier: %s (versions published in %s)", machine().line(str(dtype)[6:]), str(published)[6:])
            self.dtype = dtype
            # The bounds are the published dtype's: honest workers may compute in it or in fp32.
            half = published in (torch.bfloat16, torch.float16)
            config = self.config
            self.tolerances = (config.half_tolerance, config.half_mean_tolerance) if half else (config.tolerance, config.tolerance)
            model.to(dtype)
            copy_into(model, weights, published=published)
        except BaseException:
            self._spare.append(model)  # no longer counted as holding its version: as good as a fresh build
            raise
        return model

    def _weights(self, version: int) -> dict[str, torch.Tensor]:
        """`version`'s full weights, checked against the (signed) manifest's digests. Any failure is
        a StoreError or a CheckpointError: the verifier's thread never dies of a version."""
        from decentrl.store.weights import INDEX_NAME, CheckpointError, read_weights, weights_from_files

        try:
            manifest = self.store.manifest(version)
            if (manifest.delta_base is not None and not manifest.whole) or manifest.base_version is not None:
                return read_weights(self._pull(version))
            _, files = self.store.read_verified(version, lambda name: name.endswith(".safetensors") or name == INDEX_NAME)
            return weights_from_files(files)
        except (StoreError, CheckpointError):
            raise
        # Anything else a version's bytes provoke (a dtype torch cannot copy) is still the
        # version's fault, never the verifier's.
        except Exception as exc:  # noqa: BLE001 - see above
            raise CheckpointError(f"version {version} cannot be loaded ({type(exc).__name__}: {exc})") from exc

    def _pull(self, version: int) -> str:
        started = time.perf_counter()
        try:
            return self.store.pull(version, self.cache_dir)
        finally:
            self.cpu_s += time.perf_counter() - started  # hashed on the store's threads: counted at wall time

    def recompute(self, rollouts: list[Rollout], version: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The logprobs (N,) of every completion token of `rollouts`, concatenated, under `version`'s
        sampling distribution (the rollouts share the run's sampling parameters), in one forward;
        in a deterministic run whether each token is its sample's seeded draw (N,), else None."""
        import torch

        from decentrl.model.routers import batch_routes, replaying
        from decentrl.model.sampling import sampling_distribution

        model = self._model(version)
        started, cpu_started = time.perf_counter(), time.thread_time()
        sequences = [r.prompt_token_ids + r.completion_token_ids for r in rollouts]
        width = max(len(s) for s in sequences)
        # Right padding needs no attention mask: under the causal mask no real token sees the tail.
        ids = torch.tensor([s + [0] * (width - len(s)) for s in sequences])  # (B, L)
        # The logits predicting each completion token: row b, positions P-1 .. P+T-2.
        rows = torch.tensor([b for b, r in enumerate(rollouts) for _ in r.completion_token_ids])  # (N,)
        columns = torch.tensor([
            len(r.prompt_token_ids) - 1 + i for r in rollouts for i in range(len(r.completion_token_ids))
        ])  # (N,)
        targets = torch.tensor([t for r in rollouts for t in r.completion_token_ids]).unsqueeze(-1)  # (N, 1)
        sampling = rollouts[0].sampling
        with torch.inference_mode():
            # MoE: the worker's recorded experts, replayed as the trainer does (decentrl/model/routers.py).
            with replaying(model, batch_routes([r.expert_routing for r in rollouts], width)):
                logits = model(input_ids=ids, use_cache=False).logits[rows, columns]  # (N, V)
            distribution = sampling_distribution(logits, sampling)  # (N, V)
            chosen = distribution.gather(-1, targets).squeeze(-1)  # (N,)
            chosen = _judged_at_the_boundary(logits, targets, chosen, sampling, self.tolerances[0])
            drawn = None if self.run_seed is None else self._redrawn(rollouts, distribution, version, targets.squeeze(-1))
        self.forward_s += time.perf_counter() - started
        self.forward_cpu_s += time.thread_time() - cpu_started
        return chosen, drawn  # (N,), (N,) or None

    def _redrawn(self, rollouts: list[Rollout], distribution: torch.Tensor, version: int, tokens: torch.Tensor) -> torch.Tensor:
        """Per completion token (N,), whether it is its sample's seeded draw from `distribution`
        (N, V), drawn as workers/backends/hf.py draws (one multinomial per position, in order); a
        rollout without a `sample_index` is not re-drawn."""
        import torch

        assert self.run_seed is not None
        started = time.perf_counter()
        probs = distribution.exp()  # (N, V), as the worker samples from
        same = torch.ones(len(tokens), dtype=torch.bool)  # (N,)
        offset = 0
        for rollout in rollouts:
            count = len(rollout.completion_token_ids)
            if rollout.sample_index is not None:
                seed = sample_seed(self.run_seed, rollout.prompt_id, rollout.sample_index, version)
                generator = torch.Generator().manual_seed(seed)
                draws = [torch.multinomial(probs[i : i + 1], 1, generator=generator) for i in range(offset, offset + count)]
                same[offset : offset + count] = torch.cat(draws).squeeze(-1) == tokens[offset : offset + count]
            offset += count
        self.draw_s += time.perf_counter() - started
        return same

    def judge(self, rollouts: list[Rollout]) -> list[Judged]:
        """Per rollout, |claimed - recomputed| over its sampled tokens; one forward per version."""
        import torch

        from decentrl.store.weights import CheckpointError

        judged = [Judged() for _ in rollouts]
        by_version: dict[int, list[int]] = defaultdict(list)  # version -> indices of rollouts with tokens of it
        for index, rollout in enumerate(rollouts):
            for version in {v for v in _token_versions(rollout) if v is not None}:
                by_version[version].append(index)
        for version, indices in sorted(by_version.items()):
            batch = [rollouts[index] for index in indices]
            try:
                recomputed, drawn = self.recompute(batch, version)  # (N,), (N,) or None
            except (StoreError, CheckpointError) as exc:
                log.error("version %d cannot be loaded (%s): %d rollouts left unjudged", version, exc, len(batch))
                for index in indices:
                    judged[index].unverifiable = True
                continue
            lengths = [len(r.completion_token_ids) for r in batch]
            claimed = torch.tensor([lp for r in batch for lp in r.logprobs], dtype=torch.float64)  # (N,)
            # A token outside the kept set (inf) and a NaN count as far as can be.
            differences = (claimed - recomputed.double()).abs().nan_to_num(nan=math.inf, posinf=math.inf)
            draws_of = drawn.split(lengths) if drawn is not None else [None] * len(batch)
            for index, rollout, difference, draws in zip(indices, batch, differences.split(lengths), draws_of, strict=True):
                counted = torch.tensor([v == version for v in _token_versions(rollout)], dtype=torch.bool)  # (T,)
                found = judged[index]
                found.worst = max(found.worst, float(difference[counted].max()))
                found.total += float(difference[counted].sum())
                found.tokens += int(counted.sum())
                found.reproduced = found.reproduced and (draws is None or bool(draws[counted].all()))
        return judged

    def within(self, judged: Judged) -> bool:
        return judged.worst <= self.tolerances[0] and judged.mean <= self.tolerances[1]

    def check(self, rollouts: list[Rollout]) -> dict[str, str]:
        """Rollout id -> rejection reason for each rollout that fails: `logprob_mismatch`,
        `not_reproduced` (deterministic runs: a token is not its seeded draw), or `unverifiable`
        when a version it needs can no longer be read (no strike for that)."""
        started, cpu_started = time.perf_counter(), time.thread_time()
        failed: dict[str, str] = {}
        for rollout, judged in zip(rollouts, self.judge(rollouts), strict=True):
            if judged.unverifiable:
                failed[rollout.rollout_id] = "unverifiable"
            elif not judged.reproduced:
                failed[rollout.rollout_id] = "not_reproduced"
                log.warning(
                    "rollout %s of %s: its tokens are not the draws of its seed (sample %s, version %d)",
                    rollout.rollout_id, rollout.worker_id, rollout.sample_index, rollout.policy_version,
                )
            elif not self.within(judged):
                failed[rollout.rollout_id] = "logprob_mismatch"
                log.warning(
                    "rollout %s of %s: logprobs differ from version %d's by up to %.3g, %.3g on average "
                    "(tolerance %g, mean %g)", rollout.rollout_id, rollout.worker_id, rollout.policy_version,
                    judged.worst, judged.mean, *self.tolerances,
                )
            else:
                self.largest_passing_diff = max(self.largest_passing_diff, judged.worst)
                self.largest_passing_mean_diff = max(self.largest_passing_mean_diff, judged.mean)
        self.checks += 1
        self.rollouts_checked += len(rollouts)
        self.compute_s += time.perf_counter() - started
        self.cpu_s += time.thread_time() - cpu_started
        return failed

    def summary(self) -> dict[str, float]:
        counters = (
            "rollouts_checked", "checks", "loads", "compute_s", "cpu_s", "load_s", "load_cpu_s", "forward_s",
            "forward_cpu_s", "draw_s", "startup_s", "largest_passing_diff", "largest_passing_mean_diff",
        )
        summary = {name: getattr(self, name) for name in counters}
        return {**summary, "tolerance": self.tolerances[0], "mean_tolerance": self.tolerances[1]}
