"""Gathers each new version's full weights to rank 0 without holding up the training loop.

`submit(version)` copies this rank's FSDP shards into one flat buffer (a local memcpy) and
returns. A thread on every rank then gathers the buffers to rank 0 in one collective over a
dedicated gloo group, so it never interleaves with the loop's own collectives, and rank 0 hands
the reassembled state dict to `deliver` (the background Publisher's `submit`). Every rank
processes versions in the same order; when gathers fall behind, `submit` blocks, and the loop
reports that time as publish wait. Called by the training loop.
"""

from __future__ import annotations

import datetime
import logging
import queue
import threading
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

log = logging.getLogger("decentrl.trainer.gather")

_STOP = None


class WeightGather:
    def __init__(
        self,
        model: torch.nn.Module,
        deliver: Callable[[int, dict[str, torch.Tensor]], None] | None,
        select: Callable[[str], bool] = lambda name: True,
        timeout_s: float | None = None,
    ) -> None:
        """Collective (every rank constructs it); `deliver` is called on rank 0 only, with the
        weights whose names `select` accepts (LoRA: only the adapter's). `timeout_s`: its group's
        collective time-out ([trainer] peer_timeout_s; None: torch's default)."""
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.deliver = deliver
        self.group = dist.new_group(backend="gloo", timeout=None if timeout_s is None else datetime.timedelta(seconds=timeout_s))
        state = {name: value for name, value in model.state_dict().items() if select(name)}
        # Sharded parameters are gathered; anything else (buffers) is whole on every rank.
        self.sharded = [name for name, value in state.items() if isinstance(value, DTensor)]
        self.whole = [name for name, value in state.items() if not isinstance(value, DTensor)]
        self.full_shapes = {name: tuple(state[name].shape) for name in self.sharded}
        local_shapes = [tuple(state[name].to_local().shape) for name in self.sharded]
        every: list[list[tuple[int, ...]]] = [[] for _ in range(self.world)]
        dist.all_gather_object(every, local_shapes, group=self.group)
        self.local_shapes = every  # [rank][parameter] -> shape of that rank's shard
        self.capacity = max(sum(torch.Size(s).numel() for s in shapes) for shapes in every)
        self.model = model
        self._queue: queue.Queue[tuple[int, torch.Tensor, dict[str, torch.Tensor]] | None] = queue.Queue(maxsize=1)
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="weight-gather", daemon=True)
        self._thread.start()

    def submit(self, version: int) -> None:
        """Snapshot this rank's shards of the current weights for `version`; blocks only while the
        previous gather is still waiting to start."""
        self._raise_if_failed()
        state = self.model.state_dict()
        pieces = [state[name].to_local().detach().reshape(-1).float() for name in self.sharded]
        used = sum(piece.numel() for piece in pieces)
        # One copy of the shards, written straight into the padded buffer the gather sends (a cat
        # and then a pad copied every byte twice, on the step's critical path).
        flat = torch.empty(self.capacity)
        if pieces and pieces[0].device.type == "cpu":
            torch.cat(pieces, out=flat[:used])
        else:  # cat on the device, then one transfer
            flat[:used].copy_(torch.cat(pieces))
        flat[used:].zero_()
        whole = {name: state[name].detach().cpu().clone() for name in self.whole} if self.rank == 0 else {}
        self._queue.put((version, flat, whole))

    def wait_idle(self) -> None:
        """Until every submitted version is delivered (rank 0) or sent (other ranks)."""
        self._queue.join()
        self._raise_if_failed()

    def close(self) -> None:
        self.wait_idle()
        self._queue.put(_STOP)
        self._thread.join()

    def _raise_if_failed(self) -> None:
        if self._error is not None:
            raise RuntimeError(f"gathering weights for publishing failed: {self._error}") from self._error

    def _run(self) -> None:
        while (item := self._queue.get()) is not _STOP:
            try:
                version, flat, whole = item
                buffers = [torch.empty_like(flat) for _ in range(self.world)] if self.rank == 0 else None
                dist.gather(flat, buffers, dst=0, group=self.group)
                if buffers is not None and self.deliver is not None:
                    self.deliver(version, {**self._assemble(buffers), **whole})
            except BaseException as exc:  # surfaced to the loop on its next submit
                log.exception("gathering weights failed")
                self._error = exc
            finally:
                self._queue.task_done()
        self._queue.task_done()

    def _assemble(self, buffers: list[torch.Tensor]) -> dict[str, torch.Tensor]:
        """Full tensors from every rank's flat shards: FSDP2 shards dim 0, in rank order."""
        offsets = [0] * self.world
        state = {}
        for index, name in enumerate(self.sharded):
            pieces = []
            for rank in range(self.world):
                shape = torch.Size(self.local_shapes[rank][index])
                pieces.append(buffers[rank][offsets[rank] : offsets[rank] + shape.numel()].view(shape))
                offsets[rank] += shape.numel()
            state[name] = torch.cat(pieces, dim=0)
            assert tuple(state[name].shape) == self.full_shapes[name], name  # the FSDP2 layout this relies on
        return state
