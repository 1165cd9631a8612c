"""`[worker]`: how an inference worker generates (workers/ reads it; docs/workers.md).

The one declaration of a worker's settings: `decentrl worker` reads them from a run config
(`--config`, the run's TOML or the resolved config.json `decentrl run` writes) or takes these
defaults, then applies `--set worker.KEY=VALUE`. What the run decides (its name, group size,
staleness bound, sampling, store URL, a multi-turn task) the worker learns from the
orchestrator's GET /v1/info and every lease instead, so a worker with no config file still
samples as the run wants.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from decentrl.api.wire import MAX_VERSION_WAIT_S
from decentrl.config.base import Section, reject_moved


class OpenAIServerConfig(Section):
    """The OpenAI-compatible server a worker with backend "openai" drives (workers/backends/openai.py)."""

    url: str = Field(min_length=1, description="The server, e.g. http://127.0.0.1:8000.")
    model: str = Field(min_length=1, description="The model name the server serves.")
    reload: Literal["weights", "lora"] = Field(
        "weights", description="New versions: 'weights' POSTs the directory to reload_route; 'lora' loads an adapter."
    )
    reload_route: str = Field(
        "/update_weights_from_disk", description="reload = 'weights': the route taking {\"model_path\": dir} (SGLang's)."
    )


class WorkerConfig(Section):
    """An inference worker: pulls versions, generates, posts rollouts."""

    backend: Literal["hf", "vllm", "openai"] = Field(
        "hf", description="Inference backend: transformers, in-process vLLM, or an OpenAI-compatible server."
    )
    device: str = Field("cpu", description="torch device for the hf backend (and `decentrl eval`).")
    policy: str | None = Field(
        None, pattern=r"^[a-z][a-z0-9_]{0,31}$", description="A run of two policies ([orchestrator.roles] policies = "
        "'per_role'): the one this worker loads and generates for (proposer: new units; solver: their solver nodes); "
        "`decentrl run` splits num_workers between them. None: the run's one policy.",
    )
    gpu_memory: float | None = Field(
        None, gt=0, le=1, description="Share of its GPU's memory this worker may take: the vllm backend's "
        "gpu_memory_utilization (None: vLLM's default), the hf backend's torch.cuda.set_per_process_memory_fraction "
        "on a CUDA device (None: no limit). `decentrl run` sets it from [placement] workers.memory.",
    )
    vllm_compile: bool = Field(
        True, description="The vllm backend compiles the model and captures CUDA graphs, as vLLM does by default; "
        "false sets enforce_eager: the engine starts in seconds instead of minutes but generates more slowly "
        "(17% on CPU, docs/real_model.md).",
    )
    openai: OpenAIServerConfig | None = Field(
        None, description="The server, with backend = 'openai' ([worker.openai] url and model)."
    )
    swap_deadline_s: float = Field(
        5.0, ge=0, description="Soft pause: in-flight generation may finish for this long before it continues "
        "under the new weights as a partial rollout.",
    )
    version_wait_s: float = Field(
        30.0, ge=1, le=MAX_VERSION_WAIT_S, description="How long one GET /v1/version long-poll waits for a new "
        "version before it is asked again (workers/versions.py); below the read timeout of any proxy in front of "
        "the orchestrator.",
    )
    version_poll_s: float = Field(
        2.0, gt=0, le=300, description="After a failed version long-poll (the orchestrator unreachable), ask again "
        "this much later; against an orchestrator without GET /v1/version, poll /v1/info this often.",
    )
    groups_per_request: int = Field(
        4, ge=1, le=1024, description="Prompts (groups) leased and generated together."
    )
    torch_threads: int = Field(1, ge=1, description="Intra-op CPU threads.")
    compute_dtype: Literal["auto", "fp32", "bf16"] = Field(
        "auto", description="The hf and vllm backends' (and `decentrl eval`'s) compute dtype. auto: the versions' published dtype "
        "where the device computes it natively, else fp32 from the same weights (bf16 versions on an AVX2 CPU: "
        "4x faster in fp32). bf16 needs bf16 versions: the verifier holds fp32 versions to fp32 bounds.",
    )
    concurrency: int = Field(
        1, ge=1, le=256, description="Lease slots in flight per worker (concurrent requests to the backend)."
    )
    max_batch_rows: int = Field(
        256, ge=1, description="Most rows (samples) of all slots generated together in one backend call; bounds "
        "the memory of a batched decode.",
    )
    deterministic_groups_per_call: int = Field(
        8, ge=1, le=1024, description="Deterministic runs (docs/reproducibility.md): every backend call has this "
        "many groups' rows of one prompt length, a fixed shape, filled with discarded repeats of its own rows when "
        "fewer groups wait; a CPU forward gives a row the same bits at a fixed shape whatever its neighbours, so "
        "groups batch without depending on each other. Part of what a run reproduces, like torch_threads: every "
        "worker of a run must use the same value. Its rows (times group_size) must fit max_batch_rows.",
    )

    @model_validator(mode="before")
    @classmethod
    def _moved(cls, data: object) -> object:
        return reject_moved(data, {
            "simulated_latency_median_s": "[simulation] latency_median_s",
            "simulated_latency_sigma": "[simulation] latency_sigma",
            "slowdowns": "[simulation] slowdowns, keyed by worker id (slowdowns = { worker-0 = 10.0 })",
        })

    @model_validator(mode="after")
    def _server_given(self) -> WorkerConfig:
        if self.backend == "openai" and self.openai is None:
            raise ValueError(
                "backend = 'openai' needs the server: add [worker.openai] with url and model "
                "(or --set worker.openai.url=... --set worker.openai.model=...)"
            )
        if self.backend != "openai" and self.openai is not None:
            raise ValueError(f"[worker.openai] is only read with backend = 'openai' (backend is {self.backend!r})")
        return self
