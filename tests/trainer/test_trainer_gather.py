"""WeightGather.submit snapshots the weights at the call (one copy of each rank's shards, written
into the buffer the gather sends): an optimizer step taken right after it, while the gather may
still be in flight, never reaches the version it delivers. On 1 and 2 gloo ranks (2: uneven shards,
so the buffers carry padding)."""

from __future__ import annotations

import os
import socket
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from decentrl.config import TinyModelConfig
from decentrl.model.build import build_model
from decentrl.trainer.distributed import full_state_dict, init_distributed, shard_model
from decentrl.trainer.gather import WeightGather

pytestmark = pytest.mark.integration

TINY = TinyModelConfig(hidden_size=36, num_layers=1, num_heads=2, intermediate_size=50)  # 36 / 2 ranks, 50 odd rows


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def snapshot_then_change(rank: int, world: int, port: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    _, _, device = init_distributed()
    model = shard_model(build_model(TINY).to(device).train())
    delivered: dict[int, dict[str, torch.Tensor]] = {}
    gather = WeightGather(model, deliver=lambda version, state: delivered.update({version: state}))
    at_submit = full_state_dict(model)  # collective
    gather.submit(1)
    with torch.no_grad():  # what the next optimizer step does to the same storage, in place
        for parameter in model.parameters():
            parameter.add_(1.0)
    gather.close()
    after = full_state_dict(model)  # collective
    if rank == 0:
        torch.save({"at_submit": at_submit, "delivered": delivered[1], "after": after}, out)
    dist.destroy_process_group()


@pytest.mark.parametrize("world", [1, 2])
def test_submit_delivers_the_weights_as_they_were_at_the_call(world: int, tmp_path: Path) -> None:
    out = str(tmp_path / "gathered.pt")
    mp.spawn(snapshot_then_change, args=(world, free_port(), out), nprocs=world, join=True)
    saved = torch.load(out, weights_only=False)
    assert set(saved["delivered"]) == set(saved["at_submit"])
    for name, tensor in saved["at_submit"].items():
        assert torch.equal(saved["delivered"][name], tensor), name
    changed = [name for name, tensor in saved["after"].items() if not torch.equal(tensor, saved["at_submit"][name])]
    assert changed  # the step after submit did change the weights the delivered version kept
