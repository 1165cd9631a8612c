"""Honest and adversarial workers against one real pipeline, with orchestrator.verification on.

Starts `decentrl orchestrator`, the torchrun trainer and honest `decentrl worker` processes (as
`decentrl run` does, configs/public.toml - its [orchestrator.verification] settings as they are -
with a small prompt pool so prompts come back and replays are possible), plus adversarial workers in this process speaking the real
HTTP API with their own tokens:
  foreign   samples from a differently seeded tiny model, claims its logprobs and reward 1.0
  uniform   random tokens, each claimed with logprob log(1/V)
  replay    samples honestly with the real policy (pulled from the store), then replays them
            under new rollout ids whenever a prompt comes back
  future    random tokens claimed under a version not yet published
  flood     asks for status far over its rate limit (counts the 429s)
Last line: one JSON object.
  detection_rate       1 - forged rollouts that reached the trainer / forged rollouts posted.
                       Forged: every rollout of foreign, uniform and future, and replay's replays;
                       replay's first, honestly sampled answer to a prompt (the content it replays
                       later) is genuine and counted apart (replay_honest_posted/_served). What
                       reached the trainer is read per lease from the orchestrator's journal
                       (status "served"), and must agree with the per-token `served` counts.
  false_positive_rate  honest rollouts rejected by a verification check / honest rollouts accepted.
  verification_overhead       verifier CPU-seconds / trainer compute CPU-seconds, all ranks summed
                              (forward, backward and optimizer step of every rank: the trainer's
                              compute in core-seconds; the verifier runs on one thread).
  verification_overhead_wall  the same with wall times: verifier check seconds / the sum over ranks
                              of each rank's compute-phase seconds.
  Neither side counts its one-time start-up (imports, model build): verifier_startup_s reports the
  verifier's. docs/security.md discusses the figures.
Usage: python benchmarks/adversarial.py [--steps 40]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import sqlite3
import tempfile
import threading
import time
import urllib.error
import uuid
from pathlib import Path
from typing import Any

from decentrl.api.client import OrchestratorClient, OrchestratorError
from decentrl.api.wire import LeaseRequest, Rollout, RolloutBatch
from decentrl.cli.launch import _get_json, _start, _stop, free_port, orchestrator_command, trainer_command, worker_command
from decentrl.config import TinyModelConfig, load_config
from decentrl.store.checkpoints import CheckpointStore
from orchestrator.auth import add_token

CHECK_REASONS = ("logprob_mismatch", "replay", "bad_finish_reason", "banned")
KINDS = ("foreign", "uniform", "replay", "future")


class Adversary(threading.Thread):
    def __init__(self, kind: str, url: str, token: str, store: CheckpointStore, cache: str, model: TinyModelConfig) -> None:
        super().__init__(daemon=True)
        self.kind, self.store, self.cache, self.model_config = kind, store, cache, model
        self.client = OrchestratorClient(url, token, timeout_s=30.0, max_wait_s=2.0)
        self.posted = 0
        self.posted_by_lease: dict[str, int] = {}  # forged rollouts posted, per lease
        self.honest_by_lease: dict[str, int] = {}  # replay: the honest samples it needs to replay later
        self.revoked = False
        self.stop = threading.Event()
        self.seen: dict[int, list[Rollout]] = {}  # replay: prompt id -> rollouts posted for it

    def backend(self, version: int) -> Any:
        from workers.backends.hf import HFBackend

        backend = HFBackend(seed=1)
        if self.kind == "foreign":
            import os

            from decentrl.model.build import build_model, build_tiny_tokenizer
            from decentrl.store.weights import write_hf_dir

            model = build_model(self.model_config.model_copy(update={"seed": self.model_config.seed + 1}))
            directory = os.path.join(self.cache, "foreign")
            os.makedirs(directory, exist_ok=True)
            build_tiny_tokenizer().save_pretrained(directory)
            write_hf_dir(directory, model.state_dict(), model.config, extras_from=directory)
            backend.load(directory, 0)
        else:
            backend.load(self.store.pull(version, self.cache), version)
        return backend

    def rollouts(self, lease: Any, version: int, sampling: Any, backend: Any) -> list[Rollout]:
        base = {"run_name": self.run_name, "lease_id": lease.lease_id, "prompt_id": lease.prompt_id, "worker_id": "w0",
                "prompt_token_ids": lease.prompt_token_ids, "sampling": sampling, "claimed_reward": 1.0}
        if self.kind in ("uniform", "future"):
            vocab = 14
            return [Rollout(rollout_id=uuid.uuid4().hex, policy_version=version + (5 if self.kind == "future" else 0),
                            completion_token_ids=[random.randrange(3, vocab) for _ in range(sampling.max_tokens)],
                            logprobs=[-math.log(vocab)] * sampling.max_tokens, finish_reason="length", **base)
                    for _ in range(lease.group_size)]
        if self.kind == "replay" and lease.prompt_id in self.seen:
            return [r.model_copy(update={"rollout_id": uuid.uuid4().hex, "lease_id": lease.lease_id, "policy_version": version})
                    for r in self.seen[lease.prompt_id]]
        made = [Rollout(rollout_id=uuid.uuid4().hex, policy_version=version, completion_token_ids=c.token_ids,
                        logprobs=c.logprobs, finish_reason=c.finish_reason, **base)
                for c in backend.generate([lease.prompt_token_ids] * lease.group_size, sampling)
                if c.finish_reason != "interrupted"]
        self.seen[lease.prompt_id] = made
        return made

    def run(self) -> None:
        self.run_name = self.client.info().run_name
        backend, loaded = None, None
        while not self.stop.is_set():
            try:
                answer = self.client.lease(LeaseRequest(worker_id="w0", max_groups=2))
                if not answer.leases or answer.policy_version is None:
                    time.sleep(answer.retry_after_s or 0.2)
                    continue
                version = answer.policy_version
                if self.kind in ("foreign", "replay") and (loaded != version if self.kind == "replay" else backend is None):
                    backend, loaded = self.backend(version), version
                batch = []
                for lease in answer.leases:
                    replays = self.kind == "replay" and lease.prompt_id in self.seen
                    made = self.rollouts(lease, version, answer.sampling, backend)
                    forged = self.kind != "replay" or replays
                    (self.posted_by_lease if forged else self.honest_by_lease)[lease.lease_id] = len(made)
                    batch += made
                if batch:
                    self.posted = sum(self.posted_by_lease.values())
                    self.client.post_rollouts(RolloutBatch(rollouts=batch))
            except OrchestratorError as exc:
                if "401" in str(exc) or getattr(exc, "status", None) == 401:
                    self.revoked = True
                    return
                time.sleep(0.5)
            except (urllib.error.URLError, ConnectionError):
                time.sleep(0.5)


def flood(url: str, token: str, stop: threading.Event, counts: dict[str, int]) -> None:
    import urllib.request

    while not stop.is_set():
        request = urllib.request.Request(f"{url}/v1/status", headers={"Authorization": f"Bearer {token}"})
        try:
            urllib.request.urlopen(request, timeout=5).read()
            counts["ok"] += 1
        except urllib.error.HTTPError as exc:
            counts[str(exc.code)] = counts.get(str(exc.code), 0) + 1
        time.sleep(0.002)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", default="configs/public.toml")
    parser.add_argument("--steps", type=int, default=40)
    args = parser.parse_args()
    config = load_config(args.config)
    run_dir = Path(tempfile.mkdtemp(prefix="adversarial-"))
    (run_dir / "logs").mkdir()
    port = free_port()
    if not config.orchestrator.verification.enabled:
        raise SystemExit(f"{args.config}: [orchestrator.verification] enabled = false; this benchmark measures it")
    # The config's verification settings as they are; a low rate limit for the flood.
    orchestrator = config.orchestrator.model_copy(update={
        "port": port, "rate_limit_per_s": 50.0, "rate_limit_burst": 100, "dedupe_window_s": 7200.0,
    })
    config = config.with_store_url(str(run_dir / "checkpoints")).model_copy(update={
        "orchestrator": orchestrator,
        "trainer": config.trainer.model_copy(update={"steps": args.steps}),
        "task": config.task.model_copy(update={"num_prompts": 64}),
    })
    config_path = run_dir / "config.json"
    config_path.write_text(config.model_dump_json(indent=2))
    tokens = str(run_dir / "tokens.json")
    trainer_token = add_token(tokens, name="trainer", role="trainer")
    honest = {f"worker-{i}": add_token(tokens, name=f"worker-{i}", role="worker") for i in range(config.num_workers)}
    cheats = {f"adv-{kind}": add_token(tokens, name=f"adv-{kind}", role="worker") for kind in KINDS}
    flood_token = add_token(tokens, name="adv-flood", role="worker")
    url = f"http://127.0.0.1:{port}"
    roles, adversaries, stop, flooded = [], [], threading.Event(), {"ok": 0}
    started = time.monotonic()
    try:
        roles.append(_start("orchestrator", orchestrator_command(config_path, run_dir), run_dir, {}))
        while _get_json(f"{url}/v1/status", trainer_token) is None:
            if roles[0].process.poll() is not None:
                raise RuntimeError(f"orchestrator died; see {roles[0].log_path}")
            time.sleep(0.3)
        roles.append(_start("trainer", trainer_command(config_path, run_dir, url, config.trainer_ranks),
                            run_dir, {"DECENTRL_TOKEN": trainer_token, "OMP_NUM_THREADS": "1"}))
        for name, token in honest.items():
            roles.append(_start(name, worker_command(config_path, run_dir, url, name),
                                run_dir, {"DECENTRL_TOKEN": token, "OMP_NUM_THREADS": "1"}))
        store = CheckpointStore(config.store.url)
        for kind in KINDS:
            adversary = Adversary(kind, url, cheats[f"adv-{kind}"], store, str(run_dir / "cache" / kind), config.model)
            adversary.start()
            adversaries.append(adversary)
        threading.Thread(target=flood, args=(url, flood_token, stop, flooded), daemon=True).start()
        trainer = roles[1]
        while trainer.process.poll() is None:
            if time.monotonic() - started > 900:
                raise RuntimeError("the run took over 15 minutes")
            time.sleep(1.0)
        if trainer.process.returncode != 0:
            raise RuntimeError(f"trainer exited {trainer.process.returncode}; see {trainer.log_path}")
        status = _get_json(f"{url}/v1/status", trainer_token)
    finally:
        stop.set()
        for adversary in adversaries:
            adversary.stop.set()
        _stop(roles)
    assert status is not None
    load_average = os.getloadavg()
    workers = status["workers"]
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    trainer_cpu = sum(record["compute_cpu_s_all_ranks"] for record in metrics)
    trainer_wall = sum(record["compute_s_all_ranks"] for record in metrics)
    with sqlite3.connect(run_dir / "journal.sqlite") as journal:
        served_leases = {row[0] for row in journal.execute("SELECT lease_id FROM leases WHERE status = 'served'")}
    posted = sum(a.posted for a in adversaries)
    served = sum(n for a in adversaries for lease, n in a.posted_by_lease.items() if lease in served_leases)
    honest_of_adversaries = {lease: n for a in adversaries for lease, n in a.honest_by_lease.items()}
    honest_rollouts = sum(workers.get(name, {}).get("rollouts", 0) for name in honest)
    honest_flagged = sum(workers.get(name, {}).get("rejections", {}).get(r, 0) for name in honest for r in CHECK_REASONS)
    verification = status["verification"]
    per_adversary = {}
    for kind, adversary in zip(KINDS, adversaries):
        record = workers.get(f"adv-{kind}", {})
        per_adversary[f"adv-{kind}"] = {
            "posted": adversary.posted,
            "served": sum(n for lease, n in adversary.posted_by_lease.items() if lease in served_leases),
            **{field: record.get(field) for field in ("checked", "strikes", "banned", "rejections")},
            "served_by_orchestrator": record.get("served"),  # per token, forged and genuine together
        }
    result = {
        "steps": len(metrics),
        "adversarial_rollouts_posted": posted,
        "adversarial_rollouts_served": served,
        "detection_rate": 1 - served / posted if posted else None,
        "per_adversary": per_adversary,
        "replay_honest_posted": sum(honest_of_adversaries.values()),
        "replay_honest_served": sum(n for lease, n in honest_of_adversaries.items() if lease in served_leases),
        # The journal's per-lease view agrees with the orchestrator's per-token counters.
        "served_accounting_ok": served + sum(n for lease, n in honest_of_adversaries.items() if lease in served_leases)
        == sum(workers.get(f"adv-{kind}", {}).get("served", 0) for kind in KINDS),
        "honest_rollouts": honest_rollouts,
        "false_positive_rate": honest_flagged / honest_rollouts if honest_rollouts else None,
        "honest_rejections": {name: workers.get(name, {}).get("rejections") for name in honest},
        "honest_workers": {
            name: {field: workers.get(name, {}).get(field) for field in ("rollouts", "checked", "passed", "strikes", "reward_mismatches")}
            for name in honest
        },
        "verification_config": config.orchestrator.verification.model_dump(),
        "honest_banned": [name for name in honest if workers.get(name, {}).get("banned")],
        "banned_workers": sorted(name for name, w in workers.items() if w.get("banned")),
        "flood_answers": flooded,
        "rollouts_checked": verification["rollouts_checked"],
        "verifier_checks": verification["checks"],
        "verifier_loads": verification["loads"],
        "verifier_s": verification["compute_s"],
        "verifier_cpu_s": verification["cpu_s"],
        "verifier_load_s": verification["load_s"],
        "verifier_load_cpu_s": verification["load_cpu_s"],
        "verifier_forward_s": verification["forward_s"],
        "verifier_forward_cpu_s": verification["forward_cpu_s"],
        "verifier_startup_s": verification["startup_s"],
        "trainer_ranks": config.trainer_ranks,
        "trainer_compute_cpu_s_all_ranks": trainer_cpu,
        "trainer_compute_s_all_ranks": trainer_wall,
        "trainer_compute_s_rank0": sum(record["compute_s"] for record in metrics),
        "verification_overhead": verification["cpu_s"] / trainer_cpu if trainer_cpu else None,
        "verification_overhead_wall": verification["compute_s"] / trainer_wall if trainer_wall else None,
        "largest_honest_diff": verification["largest_passing_diff"],
        "tolerance": verification["tolerance"],
        "reward_last10": sum(r["reward_mean"] for r in metrics[-10:]) / max(1, len(metrics[-10:])),
        # What holding groups back for their checks costs the trainer: waiting, and groups gone stale.
        "trainer_wait_for_batch_s": sum(record["wait_for_batch_s"] for record in metrics),
        "dropped": status["dropped"],
        "wall_s": time.monotonic() - started,
        "cpus": os.cpu_count(),
        "load_average_1_5_15": [round(x, 2) for x in load_average],
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
