"""How far apart two float computations of one value may land when only their rounding differs:
the tolerance for tests that compare results of different kernels (another batch shape, a
compiled kernel, chunks against the whole) and so must hold on any CPU, not only on the one they
were written on (an AVX2 CPU's kernels round otherwise than an AVX-512 one's; docs/reproducibility.md,
"Other CPUs").

Where the shapes and kernels are the same (the same call again, a deterministic run's fixed-shape
calls), tests compare bitwise instead: rounding is then the same too.
"""

from __future__ import annotations

import math

import torch


def rounding_atol(dtype: torch.dtype, magnitude: float, terms: int = 1) -> float:
    """The absolute tolerance between two evaluations in `dtype` of one value whose computation
    rounds `terms` terms of size up to `magnitude` in an order, or with kernels, that differ.

    Each evaluation is within about u * sqrt(terms) * magnitude of the exact value (u = eps / 2:
    independent roundings add as a random walk - Higham and Mary, "A new approach to probabilistic
    rounding error analysis", SIAM J. Sci. Comput. 41(5), 2019), so the two are within
    eps * sqrt(terms) * magnitude; twice that leaves room for the walk's tail. An error shared by
    every term (one rounded normalizer that all of them carry) does not average out: pass it as
    `magnitude` with `terms` = 1."""
    return 2 * torch.finfo(dtype).eps * math.sqrt(terms) * magnitude
