"""Inference backends. Each loads a pulled checkpoint directory, swaps weights in place, and
samples completions with the per-token logprobs of the distribution actually sampled."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Protocol

from decentrl.wire import SamplingParams


@dataclass(frozen=True)
class Completion:
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: Literal["stop", "length"]


class Backend(Protocol):
    version: int | None

    def load(self, checkpoint_dir: str, version: int) -> None:
        """Make `version` (a verified local checkpoint directory) the weights used from now on."""
        ...

    def generate(self, prompts: list[list[int]], sampling: SamplingParams) -> list[Completion]: ...
