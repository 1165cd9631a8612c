"""`decentrl status URL`: a run's state for any token holder (a volunteer sees their own
contribution, by token name), from GET /v1/status. Called by decentrl/cli/main.py."""

from __future__ import annotations

import json

from rich.console import Console
from rich.table import Table

from decentrl.api.client import OrchestratorClient, OrchestratorError


def print_status(url: str, token: str, *, as_json: bool = False) -> int:
    console = Console(highlight=False)
    try:
        found = OrchestratorClient(url, token, max_wait_s=5.0).status()
    except (OrchestratorError, ConnectionError) as exc:
        console.print(f"error: {exc}", markup=False)
        return 1
    if as_json:
        print(json.dumps(found.model_dump(), indent=2))
        return 0
    reward = "-" if found.reward_mean_recent is None else f"{found.reward_mean_recent:.3f}"
    lines = [
        f"run {found.run_name}  published v{found.policy_version}  trainer v{found.trainer_version}  "
        f"up {found.uptime_s:.0f}s",
        f"rollouts accepted {found.rollouts_accepted}  duplicates {found.rollouts_duplicate}  "
        f"stale dropped {found.stale_dropped}  groups ready {found.groups_ready}/{found.buffer_limit}  "
        f"served {found.groups_served}  leases open {found.leases_active}  reward (recent) {reward}",
        "rejected: " + (", ".join(f"{k} {v}" for k, v in sorted(found.rollouts_rejected.items())) or "none"),
        "dropped later: " + (", ".join(f"{k} {v}" for k, v in sorted(found.dropped.items())) or "none"),
    ]
    for line in lines:
        console.print(line, markup=False)
    if found.workers:
        table = Table("worker (token name)", "served", "strikes", "rejections", "banned")
        for name, record in sorted(found.workers.items()):
            rejections = ", ".join(f"{k} {v}" for k, v in sorted(dict(record.get("rejections") or {}).items())) or "-"
            table.add_row(name, str(record.get("served", 0)), str(record.get("strikes", 0)), rejections,
                          "yes" if record.get("banned") else "")
        console.print(table)
    return 0
