"""Rank 0's per-step metrics: one JSON object per line in `<run_dir>/metrics.jsonl`.

`decentrl run`'s display, the summary and the tests read it. Keys: step, policy_version
(published after the step), trainer_version (the weights it started from), reward_mean, loss,
grad_norm, the loss statistics (entropy, kl (to the reference model), sampler_kl (k3 estimate of
KL(sampler || trainer) on the sampled tokens), is_ratio_mean/max, is_truncated_fraction,
masked_fraction, clipped_fraction), samples / samples_trained / tokens, tokens_per_s, the timing
split (wait_for_batch_s, compute_s, publish_wait_s, publish_wait_fraction, checkpoint_s, step_s),
trainer_busy_fraction (this step) and trainer_busy_fraction_total, the orchestrator's
rollouts_accepted, stale_dropped and staleness_histogram, and the length bias of the staleness
rule: completion_length_mean of this batch against stale_report_samples /
stale_report_length_mean / stale_report_reward_mean, what went stale since the previous batch. compute_s is rank 0's wall time of
forward, backward and optimizer step; decentrl/trainer/train.py adds compute_cpu_s (rank 0's
CPU time of the thread that computes: meaningful on CPU, launch overhead only on GPU) and
compute_s_all_ranks / compute_cpu_s_all_ranks (the same, summed over every rank: the trainer's
compute in core-seconds).
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass

from decentrl.api.wire import TrainBatch, TrainSample
from decentrl.trainer.checkpoint import Progress


@dataclass(frozen=True)
class StepTimes:
    """Seconds spent in each phase of one step, in loop order."""

    wait_for_batch: float  # long-polling the orchestrator (or reading the journal) and the broadcast
    compute: float  # forward, backward, optimizer step
    publish_wait: float  # gathering the full weights and handing them to the background publisher
    checkpoint: float

    @property
    def total(self) -> float:
        return self.wait_for_batch + self.compute + self.publish_wait + self.checkpoint


class MetricsLog:
    """Appends records; on resume first drops the records of steps after the checkpoint, which
    the trainer trains again, so the file keeps exactly one record per step."""

    def __init__(self, path: str, keep_through: int) -> None:
        if os.path.exists(path):
            with open(path, encoding="utf-8") as file:
                # A line without its newline is a record cut short by a kill: it never happened.
                kept = [line for line in file if line.endswith("\n") and json.loads(line)["step"] <= keep_through]
            with open(path + ".tmp", "w", encoding="utf-8") as file:
                file.writelines(kept)
            os.replace(path + ".tmp", path)
        self._file = open(path, "a", encoding="utf-8")

    def write(self, record: dict[str, object]) -> None:
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()


def step_record(
    *,
    step: int,
    batch: TrainBatch,
    trained: list[TrainSample],
    loss: float,
    grad_norm: float,
    stats: dict[str, float],
    times: StepTimes,
    progress: Progress,
    replayed: bool,
) -> dict[str, object]:
    tokens = sum(len(s.prompt_token_ids) + len(s.completion_token_ids) for s in trained)
    busy = times.total - times.wait_for_batch
    return {
        "step": step,
        "policy_version": step,
        "trainer_version": step - 1,
        "reward_mean": sum(s.reward for s in batch.samples) / len(batch.samples),
        "loss": loss,
        "grad_norm": grad_norm,
        **stats,
        "samples": len(batch.samples),
        "samples_trained": len(trained),
        "tokens": tokens,
        "completion_tokens": sum(len(s.completion_token_ids) for s in trained),
        "tokens_per_s": tokens / busy if busy > 0 else 0.0,
        "wait_for_batch_s": times.wait_for_batch,
        "compute_s": times.compute,
        "publish_wait_s": times.publish_wait,
        "publish_wait_fraction": times.publish_wait / times.total,
        "checkpoint_s": times.checkpoint,
        "step_s": times.total,
        "trainer_busy_fraction": busy / times.total,
        "trainer_busy_fraction_total": progress.busy_s / progress.wall_s,
        "rollouts_accepted": batch.rollouts_accepted,
        "stale_dropped": batch.stale_dropped,
        # The length bias of dropping late groups: what went stale since the previous batch vs this batch.
        "completion_length_mean": sum(len(s.completion_token_ids) for s in batch.samples) / len(batch.samples),
        "stale_report_samples": report.samples if (report := batch.stale_report) is not None else 0,
        "stale_report_length_mean": report.mean_length if report is not None else None,
        "stale_report_reward_mean": report.mean_reward if report is not None else None,
        "staleness_histogram": batch.staleness_histogram,
        "replayed": replayed,
        "time": time.time(),
    }
