"""Honest and adversarial workers against one real pipeline, with orchestrator.verification on.

Starts `decentrl orchestrator`, the torchrun trainer and honest `decentrl worker` processes (as
`decentrl run` does, configs/local.toml with verification on and a small prompt pool so prompts
come back and replays are possible), plus adversarial workers in this process speaking the real
HTTP API with their own tokens:
  foreign   samples from a differently seeded tiny model, claims its logprobs and reward 1.0
  uniform   random tokens, each claimed with logprob log(1/V)
  replay    samples honestly with the real policy (pulled from the store), then replays them
            under new rollout ids whenever a prompt comes back
  future    random tokens claimed under a version not yet published
  flood     asks for status far over its rate limit (counts the 429s)
Last line: one JSON object. detection_rate = adversarial rollouts that never reached the trainer
/ adversarial rollouts posted (the orchestrator's per-token `served` counts); false_positive_rate
= honest rollouts rejected by a verification check / honest rollouts accepted; verification_
overhead = verifier seconds (one thread) / trainer compute seconds (rank 0's forward, backward,
step). Usage: python benchmarks/adversarial.py [--steps 40]
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
import tempfile
import threading
import time
import urllib.error
import uuid
from pathlib import Path
from typing import Any

from decentrl.cli.launch import _free_port, _get_json, _start, _stop, _worker_flags
from decentrl.client import OrchestratorClient, OrchestratorError
from decentrl.config import TinyModelConfig, load_config
from decentrl.store import CheckpointStore
from decentrl.wire import LeaseRequest, Rollout, RolloutBatch
from orchestrator.auth import add_token

CHECK_REASONS = ("logprob_mismatch", "replay", "bad_finish_reason", "banned")
KINDS = ("foreign", "uniform", "replay", "future")


class Adversary(threading.Thread):
    def __init__(self, kind: str, url: str, token: str, store: CheckpointStore, cache: str, model: TinyModelConfig) -> None:
        super().__init__(daemon=True)
        self.kind, self.store, self.cache, self.model_config = kind, store, cache, model
        self.client = OrchestratorClient(url, token, timeout_s=30.0, max_wait_s=2.0)
        self.posted = 0
        self.revoked = False
        self.stop = threading.Event()
        self.seen: dict[int, list[Rollout]] = {}  # replay: prompt id -> rollouts posted for it

    def backend(self, version: int) -> Any:
        from workers.backends.hf import HFBackend

        backend = HFBackend(seed=1)
        if self.kind == "foreign":
            import os

            from decentrl.model import build_model, build_tiny_tokenizer
            from decentrl.trainer.publisher import write_hf_dir

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
                batch = [r for lease in answer.leases for r in self.rollouts(lease, version, answer.sampling, backend)]
                if batch:
                    self.posted += len(batch)
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
    parser.add_argument("--config", default="configs/local.toml")
    parser.add_argument("--steps", type=int, default=40)
    args = parser.parse_args()
    config = load_config(args.config)
    run_dir = Path(tempfile.mkdtemp(prefix="adversarial-"))
    (run_dir / "logs").mkdir()
    port = _free_port()
    orchestrator = config.orchestrator.model_copy(update={
        "port": port, "rate_limit_per_s": 50.0, "rate_limit_burst": 100,
        "verification": config.orchestrator.verification.model_copy(
            update={"enabled": True, "spot_check_fraction": 0.05, "new_worker_checks": 64, "max_strikes": 3}),
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
    url, py = f"http://127.0.0.1:{port}", [sys.executable, "-m"]
    roles, adversaries, stop, flooded = [], [], threading.Event(), {"ok": 0}
    started = time.monotonic()
    try:
        roles.append(_start("orchestrator", py + ["decentrl", "orchestrator", str(config_path), "--run-dir", str(run_dir)], run_dir, {}))
        while _get_json(f"{url}/v1/status", trainer_token) is None:
            if roles[0].process.poll() is not None:
                raise RuntimeError(f"orchestrator died; see {roles[0].log_path}")
            time.sleep(0.3)
        roles.append(_start("trainer", py + ["torch.distributed.run", "--standalone", f"--nproc-per-node={config.trainer_ranks}",
                                             "-m", "decentrl", "trainer", str(config_path), "--orchestrator", url, "--run-dir", str(run_dir)],
                            run_dir, {"DECENTRL_TOKEN": trainer_token, "OMP_NUM_THREADS": "1"}))
        for i, (name, token) in enumerate(honest.items()):
            roles.append(_start(name, py + ["decentrl", "worker", "--orchestrator", url, *_worker_flags(config, i, run_dir)],
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
    workers = status["workers"]
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    trainer_compute = sum(record["compute_s"] for record in metrics)
    posted = sum(a.posted for a in adversaries)
    served = sum(workers.get(f"adv-{kind}", {}).get("served", 0) for kind in KINDS)
    honest_rollouts = sum(workers.get(name, {}).get("rollouts", 0) for name in honest)
    honest_flagged = sum(workers.get(name, {}).get("rejections", {}).get(r, 0) for name in honest for r in CHECK_REASONS)
    verification = status["verification"]
    result = {
        "steps": len(metrics),
        "adversarial_rollouts_posted": posted,
        "adversarial_rollouts_served": served,
        "detection_rate": 1 - served / posted if posted else None,
        "per_adversary": {f"adv-{k}": {"posted": a.posted, **{f: workers.get(f"adv-{k}", {}).get(f) for f in ("served", "strikes", "banned", "rejections")}}
                          for k, a in zip(KINDS, adversaries)},
        "honest_rollouts": honest_rollouts,
        "false_positive_rate": honest_flagged / honest_rollouts if honest_rollouts else None,
        "honest_rejections": {name: workers.get(name, {}).get("rejections") for name in honest},
        "honest_banned": [name for name in honest if workers.get(name, {}).get("banned")],
        "banned_workers": sorted(name for name, w in workers.items() if w.get("banned")),
        "flood_answers": flooded,
        "rollouts_checked": verification["rollouts_checked"],
        "verifier_s": verification["compute_s"],
        "verifier_cpu_s": verification["cpu_s"],
        "verification_overhead_cpu": verification["cpu_s"] / trainer_compute if trainer_compute else None,
        "trainer_compute_s": trainer_compute,
        "verification_overhead": verification["compute_s"] / trainer_compute if trainer_compute else None,
        "largest_honest_diff": verification["largest_passing_diff"],
        "tolerance": verification["tolerance"],
        "reward_last10": sum(r["reward_mean"] for r in metrics[-10:]) / max(1, len(metrics[-10:])),
        "wall_s": time.monotonic() - started,
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
