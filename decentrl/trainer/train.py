"""The training loop: one visible loop per rank, launched by torchrun (gloo on CPU, NCCL on GPU).

    receive batch -> micro-batches: forward, loss, backward -> step -> publish (background) -> checkpoint

Rank 0 talks to the orchestrator, journals each batch and broadcasts it (the next step's batch is
fetched and journaled in the background while a step trains); every rank computes the
same micro-batch plan and runs its share; FSDP2 (`fully_shard`) sums the gradients. Version N is
published after step N. A restart of the same command resumes from the last checkpoint and
replays the journaled steps since (decentrl/trainer/checkpoint.py). Called by `decentrl trainer`.
"""

from __future__ import annotations

import logging
import os
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from transformers import AutoTokenizer, PreTrainedModel

from decentrl.api.client import OrchestratorClient
from decentrl.api.wire import TrainBatch
from decentrl.config import RunConfig, TrainerConfig
from decentrl.model.build import build_model, load_tokenizer, publish_dtype
from decentrl.model.devices import compute_dtype, limit_gpu_memory, machine
from decentrl.rl.determinism import use_deterministic_torch
from decentrl.rl.losses import summarize
from decentrl.store.checkpoints import CheckpointStore
from decentrl.store.weights import load_pretrained, read_adapter, read_hf_weights, write_hf_dir
from decentrl.trainer.batching import collate, rank_share
from decentrl.trainer.checkpoint import BatchJournal, Progress, ResumePlan, TrainerCheckpoints, plan_resume
from decentrl.trainer.distributed import (
    broadcast_object,
    broadcast_when_ready,
    full_state_dict,
    init_distributed,
    peer_failure,
    peer_lost,
    shard_model,
)
from decentrl.trainer.gather import WeightGather
from decentrl.trainer.lora import adapter_state, add_adapters, is_adapter_weight
from decentrl.trainer.metrics import MetricsLog, StepTimes, step_record
from decentrl.trainer.prefetch import BatchPrefetcher
from decentrl.trainer.publisher import Publisher, clear_scratch
from decentrl.trainer.step import accumulate_gradients, compile_blocks, reduce_over_ranks, token_logprobs
from decentrl.trainer.trackers import Trackers

__all__ = ["TrainerOptions", "collate", "token_logprobs", "train"]  # collate, token_logprobs: tests/trainer/test_trainer_math.py

log = logging.getLogger("decentrl.trainer")


@dataclass(frozen=True)
class TrainerOptions:
    orchestrator_url: str
    token: str
    metrics_path: str
    cache_dir: str
    state_dir: str  # checkpoints, the batch journal and rank 0's scratch: <run_dir>/trainer


def prepare_store(
    config: RunConfig, store: CheckpointStore, client: OrchestratorClient, checkpoints: TrainerCheckpoints, journal: BatchJournal,
    scratch: str,
) -> ResumePlan:
    """Rank 0: publish version 0 (the initial model, written under `scratch`) into an empty store, then plan the resume."""
    if store.latest() is None:
        model, tokenizer = build_model(config.model), load_tokenizer(config.model)
        with tempfile.TemporaryDirectory(prefix="decentrl-v0-", dir=scratch) as directory:
            tokenizer.save_pretrained(directory)
            model.generation_config.save_pretrained(directory)
            write_hf_dir(
                directory, model.state_dict(), model.config, extras_from=directory,
                max_shard_bytes=config.store.shard_size_mb * 2**20, dtype=publish_dtype(config.store, config.model),
            )
            store.publish(0, directory, parent=None, hand_over=True)
    plan = plan_resume(checkpoints.latest(), journal.steps(), store.versions())
    client.announce(plan.published)  # again after a restart: the crash may have come before it
    return plan


def mixed_precision(config: RunConfig, device: torch.device) -> str:
    """trainer.mixed_precision with "auto" resolved: "bf16" where the run's versions are bf16 and
    `device` computes bf16 natively (decentrl/model/devices.py `compute_dtype`), else "fp32"."""
    dtype = compute_dtype(config.trainer.mixed_precision, device, publish_dtype(config.store, config.model))
    return "bf16" if dtype == torch.bfloat16 else "fp32"


def load_policy(
    directory: str, config: TrainerConfig, device: torch.device, *, precision: str, frozen: bool = False
) -> PreTrainedModel:
    """`precision`: "bf16" or "fp32" (`mixed_precision`)."""
    model = load_pretrained(directory).to(device)
    if frozen:  # the KL reference: version 0, never trained
        model.requires_grad_(False).eval()
    else:
        if config.lora is not None:  # before sharding: FSDP2 shards the adapters with their blocks
            add_adapters(model, config.lora)
        model.train()
    if config.compile:
        compile_blocks(model)
    return shard_model(
        model, mixed_precision=precision, activation_checkpointing=config.activation_checkpointing and not frozen
    )


def build_optimizer(parameters: list[torch.nn.Parameter], config: TrainerConfig) -> torch.optim.AdamW:
    """AdamW with its fused kernel (as torchtitan defaults to): one pass over all parameters instead
    of a dispatch per tensor, which on FSDP2's DTensors is the costly part of the step on the CPU
    (docs/trainer.md has the figures) and on CUDA a launch per tensor."""
    return torch.optim.AdamW(parameters, lr=config.lr, weight_decay=config.weight_decay, fused=True)


def warmup(steps: int):  # noqa: ANN201 - an LR multiplier for LambdaLR
    return lambda done: min(1.0, (done + 1) / (steps + 1))


def receive_batch(
    step: int, plan: ResumePlan, client: OrchestratorClient, journal: BatchJournal, check: Callable[[], None] = lambda: None
) -> TrainBatch:
    """Rank 0: the journaled batch of a step being replayed, else the orchestrator's next one,
    journaled before any training on it. The request id is the step's: a trainer killed after the
    orchestrator served a batch and before journaling it asks again after its restart and gets
    that batch back (kept `orchestrator.batches_kept`), instead of the batch being lost - which
    would shift every later batch of a deterministic run and stall a synchronous one. `check`
    raises, between asks, what stopped the background publishing (the publisher's error): no
    batch comes while no new version is announced, so the wait would otherwise never end."""
    if step <= plan.replay_through:
        return journal.read(step)
    while (batch := client.batch(trainer_version=step - 1, request_id=f"step-{step}")) is None:
        check()
        log.info("waiting for a batch for version %d", step - 1)
    journal.write(step, batch)
    return batch


def replay_difference(
    weights: dict[str, torch.Tensor], store: CheckpointStore, version: int, cache_dir: str, *, lora: bool
) -> float:
    """Rank 0: largest |difference| between replayed weights and those published before the crash
    (in LoRA runs the adapter's tensors, as stored)."""
    directory = store.pull(version, cache_dir)
    published = read_adapter(directory).tensors if lora else read_hf_weights(directory)
    # Published in store.publish_dtype: compare in it (the replayed float32 weights rounded as they were).
    # Over the tensors the store holds: a tied head (SmolLM2's lm_head.weight) is stored once, under
    # the embeddings' name (write_hf_dir), while the gathered state holds it as a tensor of its own.
    return max((weights[k].to(t.dtype).float() - t.float()).abs().max().item() for k, t in published.items())


def open_trackers(config: RunConfig, *, run_dir: str, model_dir: str) -> Trackers | None:
    """Rank 0: the experiment trackers `[logging]` lists (decentrl/trainer/trackers.py), if any."""
    if not config.logging.trackers:
        return None
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    return Trackers(
        config.logging, run_name=config.run_name, run_config=config.model_dump(mode="json"),
        directory=os.path.join(run_dir, "trackers"), decode=lambda ids: tokenizer.decode(ids, skip_special_tokens=True),
    )


def train(config: RunConfig, options: TrainerOptions) -> None:
    rank, world, device = init_distributed(config.trainer.peer_timeout_s)
    try:
        _train(config, options, rank, world, device)
    except RuntimeError as exc:
        if world > 1 and peer_failure(exc):
            resume = TrainerCheckpoints(os.path.join(options.state_dir, "checkpoints"), keep=config.trainer.checkpoint_keep).latest()
            raise peer_lost(exc, timeout_s=config.trainer.peer_timeout_s, rank=rank, world=world, resume_step=resume or 0) from None
        raise


def _train(config: RunConfig, options: TrainerOptions, rank: int, world: int, device: torch.device) -> None:
    cfg = config.trainer
    limit_gpu_memory(device, cfg.gpu_memory)  # before the first allocation on the rank's GPU
    torch.set_num_threads(cfg.torch_threads)
    if config.deterministic:
        use_deterministic_torch(cfg.torch_threads)
    torch.manual_seed(cfg.seed + rank)
    store = CheckpointStore.from_config(config.store, run_name=config.run_name)  # manifests name the run
    if cfg.policy is not None:  # a run of two policies: this trainer's stream, under <store>/<policy>/
        store = store.of_policy(cfg.policy)
    client = OrchestratorClient(options.orchestrator_url, options.token, policy=cfg.policy)
    checkpoints = TrainerCheckpoints(os.path.join(options.state_dir, "checkpoints"), keep=cfg.checkpoint_keep)
    journal = BatchJournal(os.path.join(options.state_dir, "batches")) if rank == 0 else None
    # Rank 0's files being published; what a killed trainer left there goes now (tempfile never removes it).
    scratch = clear_scratch(os.path.join(options.state_dir, "scratch")) if rank == 0 else None
    plan = broadcast_object(prepare_store(config, store, client, checkpoints, journal, scratch) if journal else None, rank)
    cache_dir = os.path.join(options.cache_dir, f"rank{rank}")
    initial_dir = store.pull(0, cache_dir)
    precision = mixed_precision(config, device)
    if rank == 0:
        log.info("trainer: %s (mixed_precision %s; fp32 master weights)", machine(str(device)).line(precision), cfg.mixed_precision)
    model = load_policy(initial_dir, cfg, device, precision=precision)
    reference = load_policy(initial_dir, cfg, device, precision=precision, frozen=True) if cfg.kl_coef > 0 else None
    trainable = [parameter for parameter in model.parameters() if parameter.requires_grad]  # LoRA: the adapters
    optimizer = build_optimizer(trainable, cfg)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, warmup(cfg.lr_warmup_steps))
    progress = checkpoints.load(plan.checkpoint, model, optimizer, scheduler) if plan.checkpoint else Progress()
    if plan.replay_through > plan.checkpoint or plan.checkpoint:
        log.info("resuming from checkpoint step %d; replaying steps %d..%d from the journal; store holds up to v%d",
                 plan.checkpoint, plan.checkpoint + 1, plan.replay_through, plan.published)
    publisher = metrics = trackers = None
    if rank == 0:
        publisher = Publisher(
            store=store,
            model_config=model.config,
            extras_from=initial_dir,
            keep_last=max(config.store.keep_last, config.train_staleness + 2),
            on_published=client.announce,
            max_shard_bytes=config.store.shard_size_mb * 2**20,
            lora=cfg.lora,
            dtype=publish_dtype(config.store, config.model),
            full_every=config.store.full_every,
            retry_s=config.store.publish_retry_s,
            scratch_dir=scratch,
        )
        metrics = MetricsLog(options.metrics_path, keep_through=plan.checkpoint)
        trackers = open_trackers(config, run_dir=os.path.dirname(options.metrics_path), model_dir=initial_dir)
    gather = WeightGather(
        model, deliver=publisher.submit if publisher else None, select=is_adapter_weight if cfg.lora else lambda name: True,
        timeout_s=cfg.peer_timeout_s,
    )
    beat_s = cfg.peer_timeout_s / 4  # rank 0's waits between collectives, cut into heartbeats
    pad_id = model.config.pad_token_id or 0
    # Rank 0 fetches step s+1's batch while step s trains (decentrl/trainer/prefetch.py).
    check = publisher.check if publisher else lambda: None
    batches = BatchPrefetcher(lambda step: receive_batch(step, plan, client, journal, check), last_step=cfg.steps) if journal else None

    for step in range(progress.step + 1, cfg.steps + 1):
        started = time.perf_counter()
        batch = broadcast_when_ready((lambda wait_s: batches.take(step, wait_s)) if batches else None, rank, beat_s)
        received = time.perf_counter()
        compute_cpu = time.thread_time()  # this thread runs the forward, backward and step (torch_threads 1)

        samples, totals, micro_batches = rank_share(
            batch, rank=rank, world=world, config=cfg, max_tokens=config.sampling.max_tokens, pad_id=pad_id, device=device
        )
        loss, sums = accumulate_gradients(
            model, reference, micro_batches, totals=totals, config=cfg, temperature=config.sampling.temperature
        )
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.max_grad_norm)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        progress.step = step
        computed = time.perf_counter()
        compute_cpu = time.thread_time() - compute_cpu

        # Version `step` goes to rank 0 and the store in the background; versions the store
        # already holds (published before a crash, replayed now) are not published again.
        replay_diff = None
        if step > plan.published:
            gather.submit(step)
        elif step == plan.published > plan.checkpoint:
            weights = full_state_dict(model)  # collective
            if cfg.lora is not None:  # what the store holds of this version
                weights = adapter_state(weights)
            if rank == 0:
                replay_diff = replay_difference(weights, store, step, cache_dir, lora=cfg.lora is not None)
                log.info("replayed up to v%d: largest |weight - published| = %.3g", step, replay_diff)
        published = time.perf_counter()

        if step % cfg.checkpoint_every == 0 or step == cfg.steps:
            # Committed only once the store holds this version, so a restart never leaves a gap.
            gather.wait_idle()
            # Rank 0 waits for the publish (a failing store: retried for minutes) in heartbeats.
            broadcast_when_ready((lambda wait_s: publisher.wait_idle(wait_s) or None) if publisher else None, rank, beat_s)
            checkpoints.save(model, optimizer, scheduler, progress, before_commit=publisher.wait_idle if publisher else None)
            if journal is not None:
                journal.prune(step)
        ended = time.perf_counter()

        loss_total, token_sums = reduce_over_ranks(loss, sums, device)  # collective
        # Every rank's compute phase, summed: the trainer's compute in core-seconds (wall, and CPU of
        # the computing thread), the denominator of overheads such as the verifier's (docs/security.md).
        all_ranks = torch.tensor([computed - received, compute_cpu], dtype=torch.float64, device=device)
        dist.all_reduce(all_ranks)  # collective, SUM
        times = StepTimes(received - started, computed - received, published - computed, ended - published)
        progress.busy_s += times.total - times.wait_for_batch
        progress.wall_s += times.total
        if metrics is not None:
            record = step_record(
                step=step, batch=batch, trained=samples, loss=loss_total, grad_norm=float(grad_norm),
                stats=summarize(token_sums), times=times, progress=progress, replayed=step <= plan.replay_through,
            )
            record["compute_cpu_s"] = compute_cpu
            record["compute_s_all_ranks"], record["compute_cpu_s_all_ranks"] = all_ranks.tolist()
            if replay_diff is not None:
                record["replay_max_abs_diff"] = replay_diff
            if publisher is not None and publisher.publish_seconds:
                record["publish_s"] = publisher.publish_seconds[-1]  # the newest publish finished, retention included
                record["announce_s"] = publisher.announce_seconds[-1]  # ... until workers could pull it
            metrics.write(record)
            client.report_step(record)  # the orchestrator's dashboard (orchestrator/dashboard.py)
            if trackers is not None:
                trackers.step(step, record, batch)
            log.info("step %d reward %.3f loss %.4f", step, record["reward_mean"], loss_total)

    gather.close()
    if publisher is not None:
        broadcast_when_ready(lambda wait_s: publisher.wait_idle(wait_s) or None, rank, beat_s)
        publisher.close()
        log.info("skipped publishing versions %s (uploads fell behind)", publisher.skipped or "none")
    else:
        broadcast_when_ready(None, rank, beat_s)
    if metrics is not None:
        metrics.close()
    if trackers is not None:
        trackers.close()
    dist.barrier()
    dist.destroy_process_group()
