"""The training loop: one visible loop per rank, launched by torchrun (gloo on CPU, NCCL on GPU).

    receive batch -> forward -> loss -> backward -> step -> publish (in the background)

Rank 0 talks to the orchestrator and broadcasts each batch; every rank trains on its own
equal slice and FSDP2 (`fully_shard`) averages gradients. Version N is published after step N.
Called by `decentrl trainer`.
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.fsdp import fully_shard
from transformers import AutoModelForCausalLM, PreTrainedModel

from decentrl.client import OrchestratorClient
from decentrl.config import RunConfig
from decentrl.losses import grpo_tis_loss
from decentrl.model import build_model, load_tokenizer
from decentrl.store import CheckpointStore, StoreError
from decentrl.trainer.publisher import Publisher, write_hf_dir
from decentrl.wire import TrainBatch, TrainSample

log = logging.getLogger("decentrl.trainer")


@dataclass(frozen=True)
class TrainerOptions:
    orchestrator_url: str
    token: str
    metrics_path: str
    cache_dir: str


@dataclass
class Tensors:
    input_ids: torch.Tensor  # (B, L) prompt + completion, right-padded
    attention_mask: torch.Tensor  # (B, L)
    completion_mask: torch.Tensor  # (B, L-1) 1 where target position t+1 is a completion token
    sampler_logprobs: torch.Tensor  # (B, L-1) aligned with the targets
    advantages: torch.Tensor  # (B,)


def collate(samples: list[TrainSample], pad_id: int) -> Tensors:
    """Right-pad prompt+completion; targets are shifted by one, as in next-token prediction."""
    width = max(len(s.prompt_token_ids) + len(s.completion_token_ids) for s in samples)
    ids = torch.full((len(samples), width), pad_id, dtype=torch.long)
    attention = torch.zeros((len(samples), width), dtype=torch.long)
    mask = torch.zeros((len(samples), width - 1))
    sampler = torch.zeros((len(samples), width - 1))
    for row, sample in enumerate(samples):
        p, c = len(sample.prompt_token_ids), len(sample.completion_token_ids)
        ids[row, : p + c] = torch.tensor(sample.prompt_token_ids + sample.completion_token_ids)
        attention[row, : p + c] = 1
        # Completion token j sits at position p + j and is predicted from position p + j - 1.
        mask[row, p - 1 : p - 1 + c] = 1.0
        sampler[row, p - 1 : p - 1 + c] = torch.tensor(sample.logprobs)
    advantages = torch.tensor([s.advantage for s in samples], dtype=torch.float32)
    return Tensors(ids, attention, mask, sampler, advantages)


def token_logprobs(model: torch.nn.Module, batch: Tensors, temperature: float) -> torch.Tensor:
    """Logprob of each next token under the tempered policy the workers sample from.  # (B, L-1)"""
    logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits[:, :-1]
    logprobs = torch.log_softmax(logits.float() / temperature, dim=-1)  # (B, L-1, V)
    return logprobs.gather(-1, batch.input_ids[:, 1:].unsqueeze(-1)).squeeze(-1)


def init_distributed() -> tuple[int, int, torch.device]:
    """Join the torchrun group (or make a group of one); gloo on CPU, NCCL on CUDA."""
    if "RANK" not in os.environ:
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(29500 + os.getpid() % 1000))
    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        torch.cuda.set_device(device)
        dist.init_process_group("nccl")
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo")
    return dist.get_rank(), dist.get_world_size(), device


def publish_initial(config: RunConfig, store: CheckpointStore, client: OrchestratorClient) -> None:
    """Rank 0: version 0 is the initial model; publish it unless the store already has it."""
    versions = store.versions()
    if versions and versions != [0]:
        raise StoreError(
            f"{store.url} already holds versions up to {versions[-1]}; start a new run "
            "(another --run-dir or store.url) - resuming a trainer is not supported yet"
        )
    if not versions:
        model, tokenizer = build_model(config.model), load_tokenizer(config.model)
        with tempfile.TemporaryDirectory(prefix="decentrl-v0-") as directory:
            tokenizer.save_pretrained(directory)
            model.generation_config.save_pretrained(directory)
            write_hf_dir(directory, model.state_dict(), model.config, extras_from=directory)
            store.publish(0, directory, parent=None)
    client.announce(0)


def fetch_batch(client: OrchestratorClient, trainer_version: int) -> TrainBatch:
    while (batch := client.batch(trainer_version)) is None:
        log.info("waiting for a batch for version %d", trainer_version)
    return batch


def broadcast_batch(batch: TrainBatch | None, rank: int) -> TrainBatch:
    box = [batch.model_dump() if rank == 0 and batch is not None else None]
    dist.broadcast_object_list(box, src=0)
    return TrainBatch.model_validate(box[0])


def shard_model(model: PreTrainedModel) -> PreTrainedModel:
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    return model


def train(config: RunConfig, options: TrainerOptions) -> None:
    rank, world, device = init_distributed()
    torch.set_num_threads(config.trainer.torch_threads)
    torch.manual_seed(config.trainer.seed + rank)
    store = CheckpointStore.from_config(config.store)
    client = OrchestratorClient(options.orchestrator_url, options.token)
    if rank == 0:
        publish_initial(config, store, client)
    dist.barrier()
    initial_dir = store.pull(0, os.path.join(options.cache_dir, f"rank{rank}"))
    model = AutoModelForCausalLM.from_pretrained(initial_dir, dtype=torch.float32).to(device)
    model = shard_model(model)
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=config.trainer.lr, weight_decay=config.trainer.weight_decay)
    publisher = None
    if rank == 0:
        publisher = Publisher(
            store=store,
            model_config=model.config,
            extras_from=initial_dir,
            keep_last=max(config.store.keep_last, config.max_staleness + 2),
            on_published=client.announce,
            max_shard_bytes=config.store.shard_size_mb * 2**20,
        )
    pad_id = model.config.pad_token_id or 0
    metrics_file = open(options.metrics_path, "a") if rank == 0 else None
    busy_total = wall_total = 0.0
    for step in range(1, config.trainer.steps + 1):
        trainer_version = step - 1  # the weights this step starts from
        step_start = time.perf_counter()
        batch = broadcast_batch(fetch_batch(client, trainer_version) if rank == 0 else None, rank)
        compute_start = time.perf_counter()

        local = collate(batch.samples[rank::world], pad_id)
        local = Tensors(*(t.to(device) for t in vars(local).values()))
        logprobs = token_logprobs(model, local, config.sampling.temperature)
        loss, stats = grpo_tis_loss(logprobs, local.sampler_logprobs, local.advantages, local.completion_mask, config.trainer.is_cap)
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), config.trainer.max_grad_norm)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

        # Collective: every rank takes part, rank 0 receives the full weights on CPU.
        state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        publish_start = time.perf_counter()
        if publisher is not None:
            publisher.submit(step, {k: v.detach().clone() for k, v in state.items()})
        step_end = time.perf_counter()

        loss_mean = loss.detach().clone()
        dist.all_reduce(loss_mean)  # SUM: gloo has no AVG
        loss_mean /= world
        busy, wall = step_end - compute_start, step_end - step_start
        busy_total, wall_total = busy_total + busy, wall_total + wall
        if metrics_file is not None:
            record = {
                "step": step,
                "policy_version": step,
                "trainer_version": trainer_version,
                "reward_mean": sum(s.reward for s in batch.samples) / len(batch.samples),
                "loss": loss_mean.item(),
                "grad_norm": float(grad_norm),
                "trainer_busy_fraction": busy / wall,
                "trainer_busy_fraction_total": busy_total / wall_total,
                "wait_for_batch_s": compute_start - step_start,
                "step_s": wall,
                "publish_submit_s": step_end - publish_start,
                "rollouts_accepted": batch.rollouts_accepted,
                "stale_dropped": batch.stale_dropped,
                "staleness_histogram": batch.staleness_histogram,
                "samples": len(batch.samples),
                "completion_tokens": sum(len(s.completion_token_ids) for s in batch.samples),
                "time": time.time(),
                **stats,
            }
            metrics_file.write(json.dumps(record) + "\n")
            metrics_file.flush()
            log.info("step %d reward %.3f loss %.4f", step, record["reward_mean"], record["loss"])
    if publisher is not None:
        publisher.close()
        log.info("skipped publishing versions %s (uploads fell behind)", publisher.skipped or "none")
    if metrics_file is not None:
        metrics_file.close()
    dist.barrier()
    dist.destroy_process_group()
