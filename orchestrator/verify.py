"""Logprob spot-checks: recompute a rollout's per-token sampling logprobs under its claimed version.

Runs inside the orchestrator, on one worker thread of the verification scheduler
(orchestrator/verification.py), so ingest latency does not depend on it; the orchestrator holds back a
group containing a sampled rollout until its check is done (orchestrator/buffer.py), so an
unverified sample never reaches the trainer. `warm_up`, which the app runs on that thread at
startup, imports torch and transformers and builds the models (an orchestrator with
verification off never loads them).

The recomputation is the worker's own math (decentrl/model/sampling.py `sampling_distribution`, the
distribution the HF worker backend samples from: temperature, then top-k, then top-p,
renormalized over the kept set) on one full forward of prompt + completion under the version's
weights. A version is loaded once: its weight files are read from the store into memory,
checked against the (signed) manifest's sha256, and copied into a model built at startup, in
place and all or nothing (decentrl/store/weights.py, which the worker's weight swap uses too); the
last `models_cached` versions stay loaded. One load path: weights that cannot be read or do not
fit the model, whatever the version holds, are an error the check reports (the rollouts are left
`unverifiable`, nobody struck) and never end the verifier's thread. A completion that spanned a weight swap
(`token_versions`) is checked token by token against the version of each token. A rollout
fails when any token's |claimed - recomputed| exceeds `tolerance` (a claimed token outside the
recomputed kept set differs by infinity). docs/security.md: the calibration and the costs.

Deterministic runs (`run_seed`, docs/reproducibility.md): every honest sample is recomputable, so
the same forward also re-draws each token from the sample's own generator (seeded with
decentrl/rl/determinism.py `sample_seed` from its `sample_index`), one draw per position as the HF
worker backend draws: a token that is not the seeded draw fails as `not_reproduced`. This checks
what the logprob comparison cannot - which token was picked: a completion chosen rather than
sampled (a forged answer, the best of several tries) passes with honest logprobs and fails here.
A draw depends on the distribution only through comparisons (torch.multinomial consumes the
generator the same way whatever the probabilities), so the float noise of a full forward against
the worker's cached decoding changes it only at a near-tie.

Cost accounting (`summary()`, /v1/status `verification`): `compute_s` is the wall time of the
checks, loads included; `cpu_s` the checking thread's CPU time (plus, for a version pulled into
the cache - a LoRA adapter and its base - the pull at its wall time: it hashes on the
store's own threads, which the thread clock does not see). The one-time imports and model builds
at startup are `startup_s`, apart, as the trainer's compute time leaves out its own start-up.
"""

from __future__ import annotations

import logging
import math
import time
from collections import OrderedDict, defaultdict
from collections.abc import Callable
from typing import TYPE_CHECKING

from decentrl.api.wire import Rollout
from decentrl.config import VerificationConfig
from decentrl.rl.determinism import sample_seed
from decentrl.store.checkpoints import CheckpointStore, StoreError

if TYPE_CHECKING:
    import torch


log = logging.getLogger("decentrl.orchestrator.verify")


def _sampled(rollout: Rollout, version: int) -> list[bool]:
    """Per completion token, whether `version` sampled it: a completion spanning a weight swap has
    `token_versions`; an environment token (loss_mask 0) was not sampled at all."""
    count = len(rollout.completion_token_ids)
    versions = rollout.token_versions or [rollout.policy_version] * count
    return [v == version and m != 0 for v, m in zip(versions, rollout.loss_mask or [1] * count, strict=True)]


def _versions(rollout: Rollout) -> set[int]:
    """The versions that sampled some token of the rollout."""
    versions = rollout.token_versions or [rollout.policy_version] * len(rollout.completion_token_ids)
    return {v for v, m in zip(versions, rollout.loss_mask or [1] * len(versions), strict=True) if m}


class Verifier:
    def __init__(
        self, config: VerificationConfig, *, store: CheckpointStore, cache_dir: str,
        build: Callable[[], torch.nn.Module], run_seed: int | None = None,
    ) -> None:
        """`build` makes a model of the run's architecture (decentrl.model.build.build_model): `warm_up`
        builds `models_cached` of them, and every version is then copied into one in place.
        `cache_dir` receives the pulled versions of LoRA runs (an adapter and its base).
        `run_seed`: a deterministic run's seed; its samples' tokens are re-drawn too."""
        self.config = config
        self.run_seed = run_seed
        self.store = store
        self.cache_dir = cache_dir
        self.build = build
        self._models: OrderedDict[int, torch.nn.Module] = OrderedDict()  # version -> model, most recent last
        self._spare: list[torch.nn.Module] = []  # built, no version loaded yet
        self.compute_s = 0.0  # wall time of checks, loads included
        self.cpu_s = 0.0  # checking thread's CPU time + pulls' wall time (see the module docstring)
        self.load_s = 0.0  # wall time of reading, verifying and copying in weights (part of compute_s)
        self.load_cpu_s = 0.0  # the same in CPU time of this thread (part of cpu_s)
        self.forward_s = 0.0  # wall time of forwards and distributions (part of compute_s)
        self.forward_cpu_s = 0.0  # the same in CPU time (part of cpu_s)
        self.draw_s = 0.0  # wall time of the seeded re-draws (deterministic runs; part of forward_s)
        self.startup_s = 0.0  # wall time of the one-time imports and model builds (warm_up): not in compute_s
        self.checks = 0  # batches checked (one forward per version in each)
        self.loads = 0  # versions loaded
        self.rollouts_checked = 0
        self.largest_passing_diff = 0.0  # the honest noise seen so far: watch it against the tolerance

    def warm_up(self) -> None:
        """Import torch, transformers and the model code, and build the models, now rather than in
        the first checks (seconds of CPU, once per process: the trainer's compute time does not
        count its own start-up either). Errors propagate: the caller logs them, and the first
        check then builds what it needs itself, the same way."""
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
        """A model holding `version`'s weights: a spare, a new build (warm_up did not build them
        all) or the least recently used one, overwritten in place, all or nothing
        (decentrl/store/weights.py `copy_into`). Weights that cannot be read leave every loaded model
        as it was."""
        import torch

        from decentrl.store.weights import adopt_dtype, copy_into

        torch.set_num_threads(self.config.torch_threads)
        weights = self._weights(version)
        if self._spare:
            model = self._spare.pop()
        elif len(self._models) >= self.config.models_cached:
            model = self._models.popitem(last=False)[1]
        else:
            model = self._build()
        try:
            adopt_dtype(model, weights)  # sample as the workers do: in the dtype the version was published in
            copy_into(model, weights)
        except BaseException:
            self._spare.append(model)  # no longer counted as holding its version: as good as a fresh build
            raise
        return model

    def _weights(self, version: int) -> dict[str, torch.Tensor]:
        """`version`'s full weights. A full version's files are read from the store into memory,
        each checked against the (signed) manifest's digest: no cache directory. A LoRA adapter
        version is pulled with its base into the cache (verified once) and merged onto it, as the
        HF worker does; a delta version is pulled into the cache, rebuilt from its base there. Only the manifest's
        files are read, and whatever they hold, a failure is
        a StoreError (the store, the manifest, a file's bytes) or a CheckpointError (weights that
        do not read): the verifier's thread never dies of a version."""
        from decentrl.store.weights import INDEX_NAME, CheckpointError, read_weights, weights_from_files

        try:
            # A delta version's files are rebuilt from its base: pulled into the cache like an adapter's.
            if self.store.manifest(version).delta_base is None:
                manifest, files = self.store.read_verified(version, lambda name: name.endswith(".safetensors") or name == INDEX_NAME)
                if manifest.base_version is None:
                    return weights_from_files(files)
            return read_weights(self._pull(version))
        except (StoreError, CheckpointError):
            raise
        # decentrl/store/weights.py turns the failures it knows of into CheckpointError; anything else
        # a version's bytes provoke (a dtype safetensors reads but torch cannot copy, an oddity of
        # a future format) is still the version's fault, never the verifier's.
        except Exception as exc:  # noqa: BLE001 - see above
            raise CheckpointError(f"version {version} cannot be loaded ({type(exc).__name__}: {exc})") from exc

    def _pull(self, version: int) -> str:
        started = time.perf_counter()
        try:
            return self.store.pull(version, self.cache_dir)
        finally:
            self.cpu_s += time.perf_counter() - started  # hashed on the store's threads: counted at wall time

    def recompute(self, rollouts: list[Rollout], version: int) -> list[torch.Tensor]:
        """Per rollout, the logprob (T,) of each completion token under `version`'s sampling
        distribution. The rollouts share their sampling parameters (the run's)."""
        lengths = [len(r.completion_token_ids) for r in rollouts]
        return list(self._recompute(rollouts, version)[0].split(lengths))

    def _recompute(self, rollouts: list[Rollout], version: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The logprobs (N,) of every completion token of `rollouts`, concatenated, and in a
        deterministic run whether each token is its sample's seeded draw (N,), else None."""
        import torch

        from decentrl.model.routers import batch_routes, replaying
        from decentrl.model.sampling import sampling_distribution

        model = self._model(version)
        started, cpu_started = time.perf_counter(), time.thread_time()
        sequences = [r.prompt_token_ids + r.completion_token_ids for r in rollouts]
        width = max(len(s) for s in sequences)
        # Right padding: under the causal mask no real token attends to the padded tail (and the
        # positions are 0.. either way), so no attention mask is needed - a quarter less compute.
        ids = torch.tensor([s + [0] * (width - len(s)) for s in sequences])  # (B, L)
        # The logits predicting each completion token: row b, positions P-1 .. P+T-2.
        rows = torch.tensor([b for b, r in enumerate(rollouts) for _ in r.completion_token_ids])  # (N,)
        columns = torch.tensor([
            len(r.prompt_token_ids) - 1 + i for r in rollouts for i in range(len(r.completion_token_ids))
        ])  # (N,)
        targets = torch.tensor([t for r in rollouts for t in r.completion_token_ids]).unsqueeze(-1)  # (N, 1)
        with torch.inference_mode():
            # MoE: the worker's recorded experts, replayed as the trainer does (decentrl/model/routers.py).
            with replaying(model, batch_routes([r.expert_routing for r in rollouts], width)):
                logits = model(input_ids=ids).logits  # (B, L, V)
            # Every completion position of every rollout in one (N, V) block: one distribution call.
            distribution = sampling_distribution(logits[rows, columns], rollouts[0].sampling)  # (N, V)
            chosen = distribution.gather(-1, targets).squeeze(-1)
            drawn = None if self.run_seed is None else self._redrawn(rollouts, distribution, version, targets.squeeze(-1))
        self.forward_s += time.perf_counter() - started
        self.forward_cpu_s += time.thread_time() - cpu_started
        return chosen, drawn  # (N,), (N,) or None

    def _redrawn(self, rollouts: list[Rollout], distribution: torch.Tensor, version: int, tokens: torch.Tensor) -> torch.Tensor:
        """Per completion token (N,), whether it is the draw of its sample's seeded generator from
        `distribution` (N, V): one torch.multinomial of one row per position, in order, as the
        HF worker backend draws for a seeded row (workers/backends/hf.py). A rollout without a
        `sample_index` (none in a deterministic run: ingest refuses it) is not re-drawn."""
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

    def differences(self, rollouts: list[Rollout]) -> list[float]:
        """Per rollout, the largest |claimed - recomputed| logprob over the tokens it sampled
        (infinite where a claimed token lies outside the recomputed kept set; NaN where a version
        it needs cannot be loaded: deleted by retention, failing verification, or weights that do
        not fit the model)."""
        return self._judge(rollouts)[0]

    def _judge(self, rollouts: list[Rollout]) -> tuple[list[float], list[bool]]:
        """`differences`, and per rollout whether every token it sampled is its seeded draw
        (deterministic runs; True elsewhere)."""
        import torch

        from decentrl.store.weights import CheckpointError

        worst = torch.zeros(len(rollouts), dtype=torch.float64)
        reproduced = torch.ones(len(rollouts), dtype=torch.float64)  # 1.0: every drawn token is its seed's
        by_version: dict[int, list[int]] = defaultdict(list)  # version -> indices of rollouts with tokens of it
        for index, rollout in enumerate(rollouts):
            for version in _versions(rollout):
                by_version[version].append(index)
        for version, indices in sorted(by_version.items()):
            batch = [rollouts[index] for index in indices]
            try:
                recomputed, drawn = self._recompute(batch, version)  # (N,), (N,) or None
            except (StoreError, CheckpointError) as exc:
                log.error("version %d cannot be loaded (%s): %d rollouts left unjudged", version, exc, len(batch))
                worst[indices] = math.nan
                continue
            claimed = torch.tensor([lp for r in batch for lp in r.logprobs], dtype=torch.float32)  # (N,)
            # Compared: the tokens this version sampled.
            counted = torch.tensor([sampled for r in batch for sampled in _sampled(r, version)])  # (N,)
            diff = torch.nan_to_num((claimed - recomputed).abs().double(), nan=math.inf).masked_fill(~counted, 0.0)
            owner = torch.tensor([indices[b] for b, r in enumerate(batch) for _ in r.completion_token_ids])  # (N,)
            worst.scatter_reduce_(0, owner, diff, reduce="amax")
            if drawn is not None:
                reproduced.scatter_reduce_(0, owner, (drawn | ~counted).double(), reduce="amin")
        return worst.tolist(), [value == 1.0 for value in reproduced.tolist()]

    def check(self, rollouts: list[Rollout]) -> dict[str, str]:
        """Rollout id -> rejection reason for each rollout that fails: `logprob_mismatch`,
        `not_reproduced` (deterministic runs: a token is not its seeded draw), or `unverifiable`
        when a version it needs can no longer be read (no strike for that)."""
        started, cpu_started = time.perf_counter(), time.thread_time()
        failed: dict[str, str] = {}
        for rollout, diff, reproduced in zip(rollouts, *self._judge(rollouts), strict=True):
            if math.isnan(diff):
                failed[rollout.rollout_id] = "unverifiable"
            elif not reproduced:
                failed[rollout.rollout_id] = "not_reproduced"
                log.warning(
                    "rollout %s of %s: its tokens are not the draws of its seed (sample %s, version %d)",
                    rollout.rollout_id, rollout.worker_id, rollout.sample_index, rollout.policy_version,
                )
            elif diff > self.config.tolerance:
                failed[rollout.rollout_id] = "logprob_mismatch"
                log.warning(
                    "rollout %s of %s: logprobs differ by up to %.3g from version %d's (tolerance %g)",
                    rollout.rollout_id, rollout.worker_id, diff, rollout.policy_version, self.config.tolerance,
                )
            else:
                self.largest_passing_diff = max(self.largest_passing_diff, diff)
        self.checks += 1
        self.rollouts_checked += len(rollouts)
        self.compute_s += time.perf_counter() - started
        self.cpu_s += time.thread_time() - cpu_started
        return failed

    def summary(self) -> dict[str, float]:
        return {
            "rollouts_checked": self.rollouts_checked,
            "checks": self.checks,
            "loads": self.loads,
            "compute_s": self.compute_s,
            "cpu_s": self.cpu_s,
            "load_s": self.load_s,
            "load_cpu_s": self.load_cpu_s,
            "forward_s": self.forward_s,
            "forward_cpu_s": self.forward_cpu_s,
            "draw_s": self.draw_s,
            "startup_s": self.startup_s,
            "largest_passing_diff": self.largest_passing_diff,
            "tolerance": self.config.tolerance,
        }
