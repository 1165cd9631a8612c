"""Leases lost to long generations: workers whose requests take several lease timeouts (issue 45's
scenario: 5 s leases, 20 s generations), with and without renewal.

    .venv/bin/python benchmarks/lease_renewal.py                  # --lease-s 5 --generation-s 20
    .venv/bin/python benchmarks/lease_renewal.py --workers 4 --slots 2 --groups 4

The real orchestrator app on loopback (no shaped link) and a file:// store with a tiny model; each
worker (hf backend) runs `--slots` slots, each making one request of `--groups` groups whose
samples are held back `--generation-s` by the simulated latency the other benchmarks use
([simulation] latency_median_s, sigma 0). Counted from the orchestrator's /v1/status and the
leases the workers were granted: leases expired (lost), prompts leased more than once, rollouts
accepted and rejected, renewals made. `without_renewal` runs the same with the workers' renewals
switched off (as before they renewed). The last line of stdout is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

SHAPE = {"hidden_size": 32, "num_layers": 1, "num_heads": 2, "intermediate_size": 64}


def measure(args: argparse.Namespace, *, renew: bool, tmp: str) -> dict[str, Any]:
    from decentrl.api.client import OrchestratorClient
    from decentrl.api.wire import Lease, LeaseRequest, LeaseResponse
    from decentrl.config import SimulationConfig, TinyModelConfig, WorkerConfig, parse_config
    from decentrl.model.build import build_model, build_tiny_tokenizer
    from decentrl.store.checkpoints import CheckpointStore
    from decentrl.store.weights import write_hf_dir
    from decentrl.tasks import build_task
    from orchestrator.app import create_app
    from orchestrator.auth import TokenRegistry
    from orchestrator.state import RunState
    from tests.openai_server import Loopback
    from workers.backends.hf import HFBackend
    from workers.worker import Worker

    groups = args.workers * args.slots * args.groups
    config = parse_config({
        "run_name": "renewal-bench", "group_size": 2, "max_staleness": 1, "num_workers": args.workers,
        "trainer_ranks": 1, "model": {"type": "tiny", **SHAPE}, "task": {"type": "sorting", "num_prompts": 256},
        "sampling": {"temperature": 1.0, "max_tokens": 8},
        "orchestrator": {"host": "127.0.0.1", "port": 0, "journal": False, "lease_timeout_s": args.lease_s},
        "trainer": {"groups_per_step": groups, "steps": 10},  # a budget of 2 x groups: no request waits
    })
    tokens = [{"name": "vol", "role": "worker", "token": "w"}, {"name": "trainer", "role": "trainer", "token": "t"}]
    store_url = f"file://{tmp}/store"
    state = RunState(config=config, task=build_task(config.task), tokenizer=build_tiny_tokenizer())
    server = Loopback(create_app(state=state, tokens=TokenRegistry(tokens), store_url=store_url))
    try:
        model = build_model(TinyModelConfig(**SHAPE, seed=0))
        directory = os.path.join(tmp, "publish-0")
        os.makedirs(directory)
        build_tiny_tokenizer().save_pretrained(directory)
        model.generation_config.save_pretrained(directory)
        write_hf_dir(directory, model.state_dict(), model.config, extras_from=directory)
        CheckpointStore(store_url).publish(0, directory)
        OrchestratorClient(server.url, "t").announce(0)

        granted: list[Lease] = []
        renewals = Counter[str]()

        class Client(OrchestratorClient):
            def lease(self, request: LeaseRequest) -> LeaseResponse:
                response = super().lease(request)
                granted.extend(response.leases)
                return response

            def renew_lease(self, lease_id: str, worker_id: str) -> Lease:
                renewals["made"] += 1
                return super().renew_lease(lease_id, worker_id)

        workers = []
        for i in range(args.workers):
            worker = Worker(
                WorkerConfig(groups_per_request=args.groups, concurrency=args.slots), worker_id=f"w{i}",
                cache_dir=os.path.join(tmp, f"cache-{i}"), client=Client(server.url, "w", max_wait_s=5.0),
                backend=HFBackend(seed=i), simulation=SimulationConfig(latency_median_s=args.generation_s, latency_sigma=0.0),
            )
            if not renew:
                worker._renewals.hold = lambda lease_id, deadline: None  # type: ignore[method-assign]
            workers.append(worker)
        started = time.perf_counter()
        threads = [threading.Thread(target=worker.run, args=(1,)) for worker in workers]  # one request a slot
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        wall_s = time.perf_counter() - started
        status = OrchestratorClient(server.url, "w").status()
    finally:
        server.close()
    prompts = Counter(lease.prompt_id for lease in granted)
    return {
        "leases_granted": len(granted),
        "leases_lost": status.leases_expired,
        "prompts_leased_twice": sum(count > 1 for count in prompts.values()),
        "rollouts_accepted": status.rollouts_accepted,
        "rollouts_rejected": dict(status.rollouts_rejected),
        "renewals": renewals["made"],
        "wall_s": round(wall_s, 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lease-s", type=float, default=5.0)
    parser.add_argument("--generation-s", type=float, default=20.0)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--slots", type=int, default=2)
    parser.add_argument("--groups", type=int, default=4)
    parser.add_argument("--no-baseline", action="store_true", help="skip the run without renewal")
    args = parser.parse_args()

    import torch

    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        result: dict[str, Any] = {"lease_s": args.lease_s, "generation_s": args.generation_s, "workers": args.workers,
                                  "slots": args.slots, "groups_per_request": args.groups}
        renewed = measure(args, renew=True, tmp=os.path.join(tmp, "renew"))
        result |= {"leases_lost_long_generation": renewed["leases_lost"], "with_renewal": renewed}
        if not args.no_baseline:
            result["without_renewal"] = measure(args, renew=False, tmp=os.path.join(tmp, "none"))
    print(json.dumps(result))


if __name__ == "__main__":
    main()
