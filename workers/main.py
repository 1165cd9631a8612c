"""The `decentrl worker` process (decentrl/cli/main.py): from a run config to a running worker.
torch and the backends are imported inside the functions, so `decentrl --help` stays fast.
"""

from __future__ import annotations

import logging
import sys

from decentrl.api.client import OrchestratorClient
from decentrl.api.wire import WorkerMachine
from decentrl.config import RunConfig, WorkerConfig
from decentrl.model.devices import available_gpus, device_problem, machine
from workers.backends import Backend
from workers.worker import Worker

log = logging.getLogger("decentrl.worker")


def build_backend(config: WorkerConfig, *, router_noise: float = 0.0) -> Backend:
    """The inference backend `config.backend` names; `router_noise` ([simulation]) is hf's only."""
    if config.backend == "vllm":
        from workers.backends.vllm_engine import VLLMBackend

        # vLLM takes its GPU from CUDA_VISIBLE_DEVICES (`decentrl run` sets it from [placement]).
        memory = {} if config.gpu_memory is None else {"gpu_memory_utilization": config.gpu_memory}
        return VLLMBackend(compile=config.vllm_compile, engine_args=memory, compute=config.compute_dtype)
    if config.backend == "openai":
        from workers.backends.openai import OpenAIBackend

        server = config.openai
        assert server is not None  # WorkerConfig requires [worker.openai] with backend "openai"
        return OpenAIBackend(url=server.url, model=server.model, reload=server.reload, reload_route=server.reload_route)
    from workers.backends.hf import HFBackend

    problem = device_problem("worker.device", config.device, available_gpus())
    if problem:  # a GPU this machine lacks: a setting to change, not a crash (one line, no traceback)
        print(f"error: {problem}", file=sys.stderr)
        raise SystemExit(2)
    return HFBackend(
        device=config.device, router_noise=router_noise, gpu_memory=config.gpu_memory, compute=config.compute_dtype
    )


def run_worker(
    config: RunConfig, *, orchestrator_url: str, token: str, worker_id: str, cache_dir: str, spool_dir: str | None
) -> None:
    """Generate for the run at `orchestrator_url` until stopped; reads [worker], [store] and [simulation]."""
    import torch

    torch.set_num_threads(config.worker.torch_threads)
    backend = build_backend(config.worker, router_noise=config.simulation.router_noise)  # checks the device first
    device = {"hf": config.worker.device, "vllm": "cuda" if available_gpus() else "cpu"}.get(config.worker.backend, "cpu")
    here = machine(device)  # an openai backend's server computes elsewhere: this process's own
    log.info("worker %s: %s", worker_id, here.line(f"[worker] compute_dtype {config.worker.compute_dtype!r}, resolved "
                                                   "against the first version's dtype"))
    worker = Worker(
        config.worker,
        worker_id=worker_id,
        cache_dir=cache_dir,
        spool_dir=spool_dir,
        client=OrchestratorClient(orchestrator_url, token, policy=config.worker.policy),
        backend=backend,
        store=config.store,
        simulation=config.simulation,
        machine=lambda: WorkerMachine(
            backend=config.worker.backend, device=here.device[:64], isa=here.isa, threads=here.threads,
            compute_dtype=backend.compute_dtype,  # type: ignore[arg-type] - a backend names a torch dtype
        ),
    )
    if worker.info.deterministic:  # the run decides (RunInfo), whatever this worker's config says
        from decentrl.rl.determinism import use_deterministic_torch

        use_deterministic_torch(config.worker.torch_threads)
    worker.run()
