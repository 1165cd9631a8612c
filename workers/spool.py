"""Local spool of finished rollouts: written before the first send, removed once acknowledged.

A worker that cannot reach the orchestrator, or is killed while posting, keeps its finished
work here and resends it later (also after a restart with the same spool directory). Resending
is safe: the orchestrator treats rollout ids it already acknowledged as duplicates.
"""

from __future__ import annotations

import glob
import os
import time
import uuid

from decentrl.api.wire import RolloutBatch


class Spool:
    def __init__(self, directory: str) -> None:
        self.directory = directory
        os.makedirs(directory, exist_ok=True)

    def add(self, batch: RolloutBatch) -> str:
        """Durably write `batch`; returns its file. Write-then-rename: never a half file."""
        # Named by creation time, so the oldest work is resent first.
        path = os.path.join(self.directory, f"{time.time_ns():020d}-{uuid.uuid4().hex[:8]}.json")
        partial = path + ".partial"
        with open(partial, "w", encoding="utf-8") as file:
            file.write(batch.model_dump_json())
            file.flush()
            os.fsync(file.fileno())
        os.replace(partial, path)
        return path

    def pending(self) -> list[str]:
        return sorted(glob.glob(os.path.join(self.directory, "*.json")))

    @staticmethod
    def load(path: str) -> RolloutBatch:
        with open(path, encoding="utf-8") as file:
            return RolloutBatch.model_validate_json(file.read())

    @staticmethod
    def remove(path: str) -> None:
        # Two slots may resend the same file at once (harmless: duplicates); one removes it.
        try:
            os.remove(path)
        except FileNotFoundError:
            pass
