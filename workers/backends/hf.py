"""transformers backend, the CPU default. Its own decode loop with a KV cache, not `generate()`, so
that each token's logprob and kept set come from the one distribution it was sampled from
(`sampling_distribution`, which the orchestrator's verifier recomputes). With `seeds`
(deterministic runs) each row has its own generator: its tokens do not depend on its neighbours.
It computes in `[worker] compute_dtype` (auto: the published dtype where the device computes it
natively, else fp32 from the same weights; decentrl/model/devices.py).
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
from transformers import AutoTokenizer, DynamicCache, PreTrainedModel, PreTrainedTokenizerBase

from decentrl.api.wire import SamplingParams
from decentrl.model.devices import ComputeDtype, compute_dtype, limit_gpu_memory, machine
from decentrl.model.routers import RouteRecorder, to_wire
from decentrl.model.sampling import sampling_distribution
from decentrl.model.stopping import eos_id_set, stop_cut
from decentrl.store.weights import copy_into, load_pretrained, model_dir, read_weights
from workers.backends import Completion, never, truncates
from workers.simulation import noisy_routers

log = logging.getLogger("decentrl.worker")


@contextmanager
def without_cudnn_attention(device: torch.device) -> Iterator[None]:
    """On CUDA, SDPA without cuDNN's kernel (flash or memory-efficient attention instead), put back
    after. cuDNN's attention builds a plan for every new sequence length, and a decode meets a new
    one at every token and every prompt width: on an H100 (2026-11-27, benchmarks/gpu_check.py)
    the first 64 x 256-token decode took 24 s against ~7 s warm, and warm without it was not
    slower (2,564 tokens/s against 2,225-2,436 with it). The setting is the process's: a worker
    runs one hf decode at a time (workers/batching.py combines its slots into one round)."""
    if device.type != "cuda":
        yield
        return
    was = torch.backends.cuda.cudnn_sdp_enabled()
    torch.backends.cuda.enable_cudnn_sdp(False)
    try:
        yield
    finally:
        torch.backends.cuda.enable_cudnn_sdp(was)


class HFBackend:
    records_routes = True  # router hooks, for the MoE architectures decentrl/model/routers.py knows
    plays_trees = True  # step by step, its own decoding loop (workers/tree.py)

    def __init__(
        self, *, device: str = "cpu", seed: int | None = None, router_noise: float = 0.0, gpu_memory: float | None = None,
        compute: ComputeDtype = "auto",
    ) -> None:
        """`gpu_memory`: the share of a CUDA device's memory this process may take ([worker] gpu_memory);
        `compute`: [worker] compute_dtype, resolved against the first version's dtype (`load`)."""
        self.device = torch.device(device)
        self.compute = compute
        self.published: torch.dtype | None = None  # the run's versions' dtype (the first one loaded)
        self.dtype: torch.dtype | None = None  # the one the model computes in
        limit_gpu_memory(self.device, gpu_memory)
        self.router_noise = router_noise  # [simulation] router_noise: benchmarks only (workers/simulation.py)
        self.model: PreTrainedModel | None = None
        self._last_only: dict[str, int] = {}  # the prefill's logits_to_keep, where the model takes it (load)
        self._cache_arg = "past_key_values"  # the KV cache's keyword in the model's forward (load)
        self.tokenizer: PreTrainedTokenizerBase | None = None
        self.version: int | None = None
        self.generator = torch.Generator(device=self.device)
        if seed is not None:
            self.generator.manual_seed(seed)
        else:
            self.generator.seed()

    def load(self, checkpoint_dir: str, version: int) -> None:
        """The first version builds the model; later ones are copied in place, all or nothing: one
        that cannot be read or does not fit raises (CheckpointError) and keeps the loaded one."""
        if self.model is None:
            model = load_pretrained(checkpoint_dir, as_published=True)
            self.published = next(model.parameters()).dtype
            self.dtype = compute_dtype(self.compute, self.device, self.published)
            if self.dtype != self.published and self.published == torch.float32:
                raise ValueError(f"[worker] compute_dtype = {self.compute!r} but the run publishes float32 versions: "
                                      "the verifier holds them to fp32 bounds; set compute_dtype = 'auto' or 'fp32'")
            model = model.to(self.device, self.dtype).eval()  # bf16 -> fp32: an exact upcast
            log.info("hf backend: %s (versions published in %s)", machine(str(self.device)).line(self.compute_dtype),
                     str(self.published).removeprefix("torch."))
            self.model, self.tokenizer = model, AutoTokenizer.from_pretrained(model_dir(checkpoint_dir))
            # The prefill keeps the last position's logits only: (B, W, V) ones can outweigh the model.
            takes = inspect.signature(model.forward).parameters
            self._last_only = {"logits_to_keep": 1} if "logits_to_keep" in takes else {}
            # transformers 5.24 renamed past_key_values to cache (the old name warns, and goes in 5.40).
            self._cache_arg = "cache" if "cache" in takes else "past_key_values"
        else:
            copy_into(self.model, read_weights(checkpoint_dir), published=self.published)
        self.version = version

    @property
    def compute_dtype(self) -> str | None:
        return None if self.dtype is None else str(self.dtype).removeprefix("torch.")

    def _eos_and_pad(self) -> tuple[set[int], int]:
        assert self.model is not None
        config = self.model.generation_config
        eos_ids = eos_id_set(config.eos_token_id)
        # Many pretrained models have no pad token; any id works under a zero attention mask.
        pad = config.pad_token_id if config.pad_token_id is not None else min(eos_ids, default=0)
        return eos_ids, pad

    def _sample(self, dist: torch.Tensor, generators: list[torch.Generator] | None) -> torch.Tensor:
        """One token id per row (B, 1) from log-probabilities `dist` (B, V)."""
        probs = dist.exp()
        if generators is None:
            return torch.multinomial(probs, 1, generator=self.generator)
        return torch.cat([torch.multinomial(probs[row : row + 1], 1, generator=g) for row, g in enumerate(generators)])

    def _text(self, token_ids: list[int]) -> str:
        assert self.tokenizer is not None
        return self.tokenizer.decode(token_ids, skip_special_tokens=True)

    @torch.no_grad()
    def generate(
        self,
        prompts: list[list[int]],
        sampling: SamplingParams,
        should_stop: Callable[[], bool] = never,
        seeds: list[int] | None = None,
    ) -> list[Completion]:
        """`Backend.generate`; with `seeds`, row i samples from a generator seeded with seeds[i]."""
        assert self.model is not None, "load() a version before generate()"
        if seeds is not None and len(seeds) != len(prompts):
            raise ValueError(f"{len(seeds)} seeds for {len(prompts)} prompts: give one seed per prompt")
        generators = None if seeds is None else [torch.Generator(device=self.device).manual_seed(seed) for seed in seeds]
        # The noise hooks first: the recorder records the routes the (noisy) model really ran.
        with (
            noisy_routers(self.model, self.router_noise, self.generator), RouteRecorder(self.model) as recorder,
            without_cudnn_attention(self.device),
        ):
            return self._decode(prompts, sampling, should_stop, recorder, generators)

    def _decode(
        self, prompts: list[list[int]], sampling: SamplingParams, should_stop: Callable[[], bool], recorder: RouteRecorder,
        generators: list[torch.Generator] | None,
    ) -> list[Completion]:
        eos_ids, pad = self._eos_and_pad()
        width = max(len(p) for p in prompts)
        # Left padding keeps every prompt's last token in the last column.
        input_ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts], device=self.device)
        attention = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=self.device)
        positions = (attention.cumsum(-1) - 1).clamp(min=0)
        cache = DynamicCache()
        moe = recorder.layers > 0
        logits = self.model(
            input_ids=input_ids, attention_mask=attention, position_ids=positions, use_cache=True,
            **{self._cache_arg: cache}, **self._last_only,
        ).logits[:, -1]  # (B, V)
        # Routes: the prefill's (B, W, layers, K), then one (B, 1, layers, K) per fed token.
        fed = [recorder.take().view(*input_ids.shape, recorder.layers, -1)] if moe else []
        rows = len(prompts)
        tokens: list[list[int]] = [[] for _ in range(rows)]
        logprobs: list[list[float]] = [[] for _ in range(rows)]
        masks: list[list[list[int]]] = [[] for _ in range(rows)]
        finish: list[str | None] = [None] * rows
        record_mask = truncates(sampling)
        for _ in range(sampling.max_tokens):
            dist = sampling_distribution(logits, sampling)  # (B, V)
            chosen = self._sample(dist, generators)  # (B, 1)
            # One device-to-host copy a token: ids (exact in float64) and their logprobs together.
            picked, chosen_lp = torch.cat([chosen.double(), dist.gather(-1, chosen).double()], dim=-1).T.tolist()
            kept = torch.isfinite(dist) if record_mask else None
            for row, token in enumerate(map(int, picked)):
                if finish[row] is not None:
                    continue
                tokens[row].append(token)
                logprobs[row].append(chosen_lp[row])
                if kept is not None:
                    masks[row].append(kept[row].nonzero().squeeze(-1).tolist())
                cut = stop_cut(self._text, tokens[row], sampling.stop, start=len(tokens[row]) - 1)
                if token in eos_ids or cut is not None:
                    finish[row] = "stop"
            if all(f is not None for f in finish) or should_stop():
                break
            attention = torch.cat([attention, attention.new_ones(rows, 1)], dim=-1)
            positions = positions[:, -1:] + 1
            logits = self.model(
                input_ids=chosen, attention_mask=attention, position_ids=positions, use_cache=True, **{self._cache_arg: cache}
            ).logits[:, -1]
            if moe:
                fed.append(recorder.take().view(rows, 1, recorder.layers, -1))
        routes = torch.cat(fed, dim=1) if moe else None  # (B, W + steps, layers, K)
        return [
            Completion(
                tokens[row],
                logprobs[row],
                finish[row] or ("length" if len(tokens[row]) == sampling.max_tokens else "interrupted"),  # type: ignore[arg-type]
                masks[row] if record_mask else None,
                # The prompt's columns (left padding cut) and every completion token but the last.
                to_wire(routes[row, width - len(prompts[row]) : width + len(tokens[row]) - 1]) if routes is not None else None,
            )
            for row in range(rows)
        ]
