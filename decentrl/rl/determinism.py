"""Deterministic runs (`deterministic = true`, docs/reproducibility.md): the pure rules every role
shares, so the orchestrator, the workers and the trainer agree on them by construction.

- `required_version`: the policy version a group is sampled under is fixed by its place in the
  consumption order (group k of the run, trained at step k // groups_per_step), not by timing;
  the orchestrator puts it in each lease (orchestrator/leases.py) and refuses rollouts sampled
  under another (orchestrator/checks.py); a worker loads it before generating (workers/worker.py).
- `sample_seed`: one sample's randomness is a function of (run seed, prompt id, sample index,
  policy version) only; the hf backend seeds one generator per row with it (workers/backends/hf.py).
- `node_seed`: the same for a tree unit's other draws (workers/tree.py): a pivot's continuation
  i derives from (run seed, prompt id, version, the pivot's node path `"{root}@{at}"`, i).
- `use_deterministic_torch`: the kernel settings the worker and the trainer apply at startup.
"""

from __future__ import annotations

import hashlib
import os


def required_version(index: int, *, groups_per_step: int, max_staleness: int) -> int:
    """The version group `index` (0-based place in the consumption order) is sampled under: the
    group trains at step s = index // groups_per_step, from version s, so it is sampled under
    max(0, s - max_staleness) - the deepest pipeline the staleness bound allows."""
    return max(0, index // groups_per_step - max_staleness)


def sample_seed(run_seed: int, prompt_id: int, sample_index: int, version: int) -> int:
    """A 63-bit seed for one sample. A hash (not a sum), so that neighbouring prompts, samples and
    versions get unrelated streams; blake2b, so it is the same in every process and on every
    machine (Python's `hash` is salted per process)."""
    key = f"{run_seed}/{prompt_id}/{sample_index}/{version}".encode()
    return int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little") >> 1


def node_seed(run_seed: int, prompt_id: int, version: int, node: str, index: int) -> int:
    """A 63-bit seed for draw `index` of a tree unit's `node` (a pivot's path `"{root}@{at}"`: root
    sample `root` branched at its token `at`; `"pivots"`: the pivots' choice), hashed as
    `sample_seed` is; its key is `sample_seed`'s with a node path, so none equals a sample's."""
    key = f"{run_seed}/{prompt_id}/{version}/{node}/{index}".encode()
    return int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little") >> 1


def use_deterministic_torch(threads: int) -> None:
    """Deterministic kernels for this process: a fixed intra-op thread count (CPU reductions split
    by thread count sum in a different order), `torch.use_deterministic_algorithms` (an op with no
    deterministic kernel raises instead of running a nondeterministic one), attention without the
    fused flash kernel, and, for CUDA, the cuBLAS workspace setting and cuDNN flags PyTorch
    documents for reproducibility. Call it before the first CUDA op (CUBLAS_WORKSPACE_CONFIG is
    read when cuBLAS initializes).

    The flash kernel is run-to-run deterministic, but on the CPU with more than one thread a row's
    attention depends on its place in the call (torch 2.13 on an AVX-512 EPYC, 2 threads: decode
    steps over 8 or more cached positions differ in the last bits), which breaks the fixed-shape
    calls' promise that the groups beside a group do not change it (workers/batching.py). The
    other SDPA kernels keep every row's result its own at any place (tests/workers/test_worker_batching.py)."""
    import torch

    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.set_num_threads(threads)
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.benchmark = False
    torch.backends.cudnn.deterministic = True
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.backends.cuda.enable_flash_sdp(False)  # the flag also governs the CPU's flash kernel
