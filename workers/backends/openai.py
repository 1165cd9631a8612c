"""OpenAI-compatible server backend (`vllm serve`, SGLang: /v1/completions with token ids and
logprobs). The server must report the logprobs of the distribution it sampled (vLLM:
`--logprobs-mode processed_logprobs`) and see the worker's cache directory, from which it loads
new weights itself. Generation goes in chunks of `chunk_tokens` so that a soft pause can cut it.
"""

from __future__ import annotations

import json
import urllib.request
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Literal

from decentrl.api.wire import SamplingParams
from workers.backends import Completion, in_chunks, never, truncates


class OpenAIBackend:
    records_routes = False  # the OpenAI API has no routed experts: keep_routing runs refuse it
    plays_trees = False  # tree leases need verdicts read between tokens, which a completion request cannot
    compute_dtype = None  # the server's own

    def __init__(
        self,
        *,
        url: str,
        model: str,
        reload: Literal["weights", "lora"] = "weights",
        reload_route: str = "/update_weights_from_disk",
        chunk_tokens: int = 64,
        timeout_s: float = 600.0,
    ) -> None:
        self.url = url.rstrip("/")
        self.model = model
        self.reload = reload
        self.reload_route = reload_route
        self.chunk_tokens = chunk_tokens
        self.timeout_s = timeout_s
        self.version: int | None = None
        self._served_model = model
        self._decode: Callable[[list[int]], str] | None = None

    def _post(self, route: str, body: dict[str, object]) -> dict:
        headers = {"Content-Type": "application/json"}
        request = urllib.request.Request(self.url + route, data=json.dumps(body).encode(), headers=headers)
        with urllib.request.urlopen(request, timeout=self.timeout_s) as response:
            text = response.read().decode()
        return json.loads(text) if text.strip() else {}

    def load(self, checkpoint_dir: str, version: int) -> None:
        if self.reload == "lora":
            name = f"decentrl-v{version}"
            self._post("/v1/load_lora_adapter", {"lora_name": name, "lora_path": checkpoint_dir})
            self._served_model = name
        else:
            self._post(self.reload_route, {"model_path": checkpoint_dir})
        if self._decode is None:  # the tokenizer never changes within a run
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(checkpoint_dir)
            self._decode = lambda ids: tokenizer.decode(ids, skip_special_tokens=True)
        self.version = version

    def _request(self, prompt: list[int], sampling: SamplingParams, max_tokens: int) -> Completion:
        masked = truncates(sampling)
        body: dict[str, object] = {
            "model": self._served_model,
            "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": sampling.temperature,
            "top_p": sampling.top_p,
            "logprobs": (sampling.top_k or 20) if masked else 1,
            "return_tokens_as_token_ids": True,
        }
        if sampling.top_k:
            body["top_k"] = sampling.top_k
        if sampling.stop:
            body["stop"] = sampling.stop
        choice = self._post("/v1/completions", body)["choices"][0]
        logprobs = choice["logprobs"]
        token_ids = [int(token.removeprefix("token_id:")) for token in logprobs["tokens"]]
        mask = [
            sorted(int(t.removeprefix("token_id:")) for t, lp in top.items() if lp > float("-inf"))
            for top in logprobs["top_logprobs"]
        ] if masked else None
        finish = "stop" if choice["finish_reason"] == "stop" else "length"
        return Completion(token_ids, [float(lp) for lp in logprobs["token_logprobs"]], finish, mask)

    def generate(
        self, prompts: list[list[int]], sampling: SamplingParams, should_stop: Callable[[], bool] = never
    ) -> list[Completion]:
        assert self._decode is not None, "load() a version before generate()"
        # Every row at once, so that the server batches them (at most the worker's max_batch_rows).
        with ThreadPoolExecutor(len(prompts) or 1, thread_name_prefix="openai") as pool:
            return list(pool.map(lambda prompt: self._complete(prompt, sampling, should_stop), prompts))

    def _complete(self, prompt: list[int], sampling: SamplingParams, should_stop: Callable[[], bool]) -> Completion:
        assert self._decode is not None
        return in_chunks(
            [prompt], sampling, should_stop, chunk_tokens=self.chunk_tokens, text=self._decode,
            generate=lambda prompts, sampling, budgets: [self._request(prompts[0], sampling, budgets[0])],
        )[0]
