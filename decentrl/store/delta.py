"""Delta versions: a weight file stored as the XOR of its bytes with the previous version's, zstd-compressed.

At RL learning rates most weights of a bf16 (or fp32) checkpoint keep their exact bits from one
version to the next, and a changed one mostly keeps its sign, exponent and high mantissa bits: the
XOR of two consecutive safetensors files of the same layout is mostly zero bytes, which zstd
shrinks to a small fraction of the file (figures: docs/store.md). The trainer's store writes one
(`encode`, called by decentrl/store/checkpoints.py `publish`); a pull rebuilds the file from the cached,
verified base version (`apply`) and verifies the result against the manifest's digest of the full
file before the version directory appears in the cache. The format is one zstd frame holding
`new XOR base`, byte for byte, of exactly the full file's size; the base is the same file name in
the version the manifest names as `delta_base`, which has the same size (else the file is
published whole).
"""

from __future__ import annotations

import io
import os
from typing import TYPE_CHECKING

import zstandard

from decentrl.store.cache import NotRegularFile, open_regular
from decentrl.store.manifest import ManifestFile, VerificationError, new_hasher

if TYPE_CHECKING:
    import numpy as np

DELTA_SUFFIX = ".delta"
# Level 3 with zstd's own worker threads: compresses a mostly-zero XOR at several hundred MB/s per
# core; higher levels buy a few percent of bytes for several times the trainer's time.
_LEVEL = 3


def _xor(new: bytes, base: bytes) -> np.ndarray:
    import numpy as np  # here: the orchestrator imports this module but never encodes (it starts without numpy)

    return np.bitwise_xor(np.frombuffer(new, dtype=np.uint8), np.frombuffer(base, dtype=np.uint8))


def encode(new_path: str, base_path: str, out_path: str, algorithm: str) -> tuple[int, str] | None:
    """Write the delta of `new_path` against `base_path` to `out_path`: (its size, its digest), or
    None when the files differ in size (another layout: publish the file whole)."""
    if os.path.getsize(new_path) != os.path.getsize(base_path):
        return None
    with open(new_path, "rb") as f:
        new = f.read()
    with open(base_path, "rb") as f:
        base = f.read()
    packed = zstandard.ZstdCompressor(level=_LEVEL, threads=-1, write_content_size=True).compress(_xor(new, base).data)
    with open(out_path, "wb") as f:
        f.write(packed)
    digest = new_hasher(algorithm)
    digest.update(packed)
    return len(packed), digest.hexdigest()


def apply(base_path: str, delta: bytes, entry: ManifestFile, out_path: str, where: str) -> os.stat_result:
    """Rebuild the file `entry` describes from its verified base file and its delta's bytes (their
    size and digest already checked against the manifest), write it to `out_path` and verify it
    against `entry`'s size and digest; every failure is a VerificationError naming `where`, and a
    file that fails is removed. Returns the stat of the file written."""
    try:
        with open_regular(base_path) as f:
            base = f.read(entry.size + 1)
    except (FileNotFoundError, NotRegularFile):
        raise VerificationError(f"{where}: the delta's base file {base_path} is missing") from None
    if len(base) != entry.size:
        raise VerificationError(f"{where}: the delta's base file is {len(base)} bytes, the file {entry.size}")
    try:
        # Read at most one byte past the file's size, whatever size the frame declares: a delta
        # that would decompress to more is refused, never expanded.
        with zstandard.ZstdDecompressor().stream_reader(io.BytesIO(delta)) as reader:
            xored = reader.read(entry.size + 1)
    except zstandard.ZstdError as exc:
        raise VerificationError(f"{where}: the delta does not decompress ({exc})") from None
    if len(xored) != entry.size:
        got = f"more than {entry.size}" if len(xored) > entry.size else str(len(xored))
        raise VerificationError(f"{where}: the delta decompresses to {got} bytes, not {entry.size}")
    rebuilt = _xor(xored, base)
    digest = new_hasher(entry.algorithm)
    digest.update(rebuilt.data)
    if digest.hexdigest() != entry.digest:
        raise VerificationError(
            f"{where}: rebuilt from its delta, the file does not match the manifest "
            f"({entry.algorithm} expected {entry.digest[:12]}.., got {digest.hexdigest()[:12]}..)"
        )
    with open_regular(out_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC) as f:  # never through a planted symlink
        f.write(rebuilt.data)
        return os.fstat(f.fileno())
