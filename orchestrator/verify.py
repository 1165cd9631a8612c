"""Logprob spot-checks: recompute a rollout's per-token sampling logprobs under its claimed version.

Runs inside the orchestrator, on one worker thread of the app's verification loop
(orchestrator/app.py), so ingest latency does not depend on it; the orchestrator holds back a
group containing a sampled rollout until its check is done (orchestrator/state.py), so an
unverified sample never reaches the trainer. torch and transformers are imported when the first
check runs: an orchestrator with verification off never loads them.

The recomputation is the worker's own math (decentrl/sampling.py `sampling_distribution`, the
distribution the HF worker backend samples from: temperature, then top-k, then top-p,
renormalized over the kept set) on one full forward of prompt + completion under the version's
weights, pulled from the store (sha256-verified, cached) and kept loaded for the last `models_cached` versions. A completion that spanned a
weight swap (`token_versions`) is checked token by token against the version of each token.
A rollout fails when any token's |claimed - recomputed| exceeds `tolerance` (a claimed token
outside the recomputed kept set differs by infinity). docs/security.md: the calibration.
"""

from __future__ import annotations

import logging
import math
import time
from collections import OrderedDict, defaultdict
from typing import TYPE_CHECKING, Any

from decentrl.config import VerificationConfig
from decentrl.store import CheckpointStore, StoreError
from decentrl.wire import Rollout

if TYPE_CHECKING:
    import torch

log = logging.getLogger("decentrl.orchestrator.verify")


class Verifier:
    def __init__(self, config: VerificationConfig, *, store: CheckpointStore, cache_dir: str) -> None:
        self.config = config
        self.store = store
        self.cache_dir = cache_dir
        self._models: OrderedDict[int, Any] = OrderedDict()  # version -> HFBackend, most recent last
        self.compute_s = 0.0  # wall time of checks (loads included): the verification overhead
        self.cpu_s = 0.0  # CPU time of the checking thread (torch_threads 1: without waiting for a core)
        self.rollouts_checked = 0
        self.largest_passing_diff = 0.0  # the honest noise seen so far: watch it against the tolerance

    def _model(self, version: int) -> Any:
        backend = self._models.pop(version, None)
        if backend is None:
            import torch

            from workers.backends.hf import HFBackend

            torch.set_num_threads(self.config.torch_threads)
            # The least recently used model takes the new weights in place (no rebuild).
            backend = self._models.popitem(last=False)[1] if len(self._models) >= self.config.models_cached else None
            backend = backend or HFBackend(device="cpu", seed=0)
            backend.load(self.store.pull(version, self.cache_dir), version)
        self._models[version] = backend
        return backend.model

    def recompute(self, rollouts: list[Rollout], version: int) -> list[torch.Tensor]:
        """Per rollout, the logprob (T,) of each completion token under `version`'s sampling
        distribution. The rollouts share their sampling parameters (the run's)."""
        import torch

        from decentrl.sampling import sampling_distribution

        model = self._model(version)
        sequences = [r.prompt_token_ids + r.completion_token_ids for r in rollouts]
        width = max(len(s) for s in sequences)
        # Right padding: with a causal mask the padded tail changes nothing before it.
        ids = torch.tensor([s + [0] * (width - len(s)) for s in sequences])  # (B, L)
        attention = torch.tensor([[1] * len(s) + [0] * (width - len(s)) for s in sequences])  # (B, L)
        with torch.no_grad():
            logits = model(input_ids=ids, attention_mask=attention).logits  # (B, L, V)
        # Every completion position of every rollout in one (N, V) block: one distribution call.
        rows = torch.cat([
            logits[row, len(r.prompt_token_ids) - 1 : len(r.prompt_token_ids) - 1 + len(r.completion_token_ids)]
            for row, r in enumerate(rollouts)
        ])  # (N, V)
        targets = torch.tensor([t for r in rollouts for t in r.completion_token_ids]).unsqueeze(-1)  # (N, 1)
        chosen = sampling_distribution(rows, rollouts[0].sampling).gather(-1, targets).squeeze(-1)  # (N,)
        return list(chosen.split([len(r.completion_token_ids) for r in rollouts]))

    def differences(self, rollouts: list[Rollout]) -> list[float]:
        """Per rollout, the largest |claimed - recomputed| logprob over its tokens."""
        import torch

        # (rollout index, token positions) to check under each version.
        by_version: dict[int, list[tuple[int, list[int]]]] = defaultdict(list)
        for index, rollout in enumerate(rollouts):
            versions = rollout.token_versions or [rollout.policy_version] * len(rollout.completion_token_ids)
            model = rollout.loss_mask or [1] * len(versions)  # environment tokens (0) were not sampled
            for version in sorted({v for v, m in zip(versions, model, strict=True) if m}):
                by_version[version].append((index, [i for i, v in enumerate(versions) if v == version and model[i]]))
        worst = [0.0] * len(rollouts)
        for version, parts in sorted(by_version.items()):
            batch = [rollouts[index] for index, _ in parts]
            for (index, positions), recomputed in zip(parts, self.recompute(batch, version), strict=True):
                claimed = torch.tensor(rollouts[index].logprobs, dtype=torch.float32)[positions]
                diff = (claimed - recomputed[positions]).abs().max().item()
                worst[index] = max(worst[index], diff if math.isfinite(diff) else math.inf)
        return worst

    def check(self, rollouts: list[Rollout]) -> dict[str, str]:
        """Rollout id -> rejection reason for each rollout that fails: `logprob_mismatch`, or
        `unverifiable` when its version can no longer be pulled (no strike for that)."""
        started, cpu_started = time.perf_counter(), time.thread_time()
        failed: dict[str, str] = {}
        available = []
        for rollout in rollouts:
            versions = set(rollout.token_versions or [rollout.policy_version])
            if all(self._pullable(v) for v in versions):
                available.append(rollout)
            else:
                failed[rollout.rollout_id] = "unverifiable"
        if available:
            for rollout, diff in zip(available, self.differences(available), strict=True):
                if diff > self.config.tolerance:
                    failed[rollout.rollout_id] = "logprob_mismatch"
                    log.warning(
                        "rollout %s of %s: logprobs differ by up to %.3g from version %d's (tolerance %g)",
                        rollout.rollout_id, rollout.worker_id, diff, rollout.policy_version, self.config.tolerance,
                    )
                else:
                    self.largest_passing_diff = max(self.largest_passing_diff, diff)
        self.rollouts_checked += len(rollouts)
        self.compute_s += time.perf_counter() - started
        self.cpu_s += time.thread_time() - cpu_started
        return failed

    def _pullable(self, version: int) -> bool:
        if version in self._models:
            return True
        try:
            self.store.pull(version, self.cache_dir)
        except StoreError:  # retention deleted it (it was outside the staleness window)
            log.error("version %d is gone from the store: its rollouts cannot be checked", version)
            return False
        return True

    def summary(self) -> dict[str, float]:
        return {
            "rollouts_checked": self.rollouts_checked,
            "compute_s": self.compute_s,
            "cpu_s": self.cpu_s,
            "largest_passing_diff": self.largest_passing_diff,
            "tolerance": self.config.tolerance,
        }
