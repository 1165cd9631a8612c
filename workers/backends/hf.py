"""transformers backend: the CPU default (CUDA when the device says so).

Decoding is a plain loop over the model's forward with a KV cache rather than `generate()`, so
that the distribution sampled from is computed here, once: temperature, then top-k, then top-p
(`sampling_distribution` of decentrl/sampling.py, which the orchestrator's verifier recomputes),
and the logprob of each sampled token and the kept set (the sampling mask) come from exactly
that distribution. The loop also checks `should_stop` between tokens, which is how a
soft-pause deadline interrupts a generation for a weight swap.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache, PreTrainedModel, PreTrainedTokenizerBase

from decentrl.loadcheck import check_loadable, read_weight_files
from decentrl.sampling import sampling_distribution
from decentrl.stopping import eos_id_set, stop_cut
from decentrl.store import MANIFEST_NAME, read_cached_manifest
from decentrl.wire import SamplingParams
from workers.backends import Completion, never, truncates
from workers.backends.adapters import adapter_base_dir, merged_weights


class HFBackend:
    def __init__(self, *, device: str = "cpu", seed: int | None = None) -> None:
        self.device = torch.device(device)
        self.model: PreTrainedModel | None = None
        self.tokenizer: PreTrainedTokenizerBase | None = None
        self.version: int | None = None
        self.generator = torch.Generator(device=self.device)
        if seed is not None:
            self.generator.manual_seed(seed)
        else:
            self.generator.seed()

    def load(self, checkpoint_dir: str, version: int) -> None:
        """Make `version` the weights used from now on, or raise (LoadError, VerificationError)
        leaving the model exactly as it was: every file is read and checked against the model
        before the first tensor is copied (`load_in_place`)."""
        if self.model is None:
            source = adapter_base_dir(checkpoint_dir) or checkpoint_dir  # LoRA run: built from the base
            model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32)
            model.to(self.device).eval()
            # from_pretrained fills a missing tensor with random values and reads the shards its
            # index names: load the manifest's files over it, checked, as every later version is.
            load_in_place(model, checkpoint_dir)
            self.model, self.tokenizer = model, AutoTokenizer.from_pretrained(source)
        else:
            load_in_place(self.model, checkpoint_dir)  # same architecture, new weights: no rebuild
        self.version = version

    def _eos_and_pad(self) -> tuple[set[int], int]:
        assert self.model is not None
        config = self.model.generation_config
        eos_ids = eos_id_set(config.eos_token_id)
        # Many pretrained models have no pad token; any id works under a zero attention mask.
        pad = config.pad_token_id if config.pad_token_id is not None else min(eos_ids, default=0)
        return eos_ids, pad

    def _text(self, token_ids: list[int]) -> str:
        assert self.tokenizer is not None
        return self.tokenizer.decode(token_ids, skip_special_tokens=True)

    @torch.no_grad()
    def generate(
        self, prompts: list[list[int]], sampling: SamplingParams, should_stop: Callable[[], bool] = never
    ) -> list[Completion]:
        assert self.model is not None, "load() a version before generate()"
        eos_ids, pad = self._eos_and_pad()
        width = max(len(p) for p in prompts)
        # Left padding keeps every prompt's last token in the last column.
        input_ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts], device=self.device)
        attention = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=self.device)
        positions = (attention.cumsum(-1) - 1).clamp(min=0)
        cache = DynamicCache()
        logits = self.model(
            input_ids=input_ids, attention_mask=attention, position_ids=positions, past_key_values=cache, use_cache=True
        ).logits[:, -1]  # (B, V)
        rows = len(prompts)
        tokens: list[list[int]] = [[] for _ in range(rows)]
        logprobs: list[list[float]] = [[] for _ in range(rows)]
        masks: list[list[list[int]]] = [[] for _ in range(rows)]
        finish: list[str | None] = [None] * rows
        record_mask = truncates(sampling)
        for _ in range(sampling.max_tokens):
            dist = sampling_distribution(logits, sampling)  # (B, V)
            chosen = torch.multinomial(dist.exp(), 1, generator=self.generator)  # (B, 1)
            chosen_lp = dist.gather(-1, chosen).squeeze(-1).tolist()
            kept = torch.isfinite(dist) if record_mask else None
            for row, token in enumerate(chosen.squeeze(-1).tolist()):
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
                input_ids=chosen, attention_mask=attention, position_ids=positions, past_key_values=cache, use_cache=True
            ).logits[:, -1]
        return [
            Completion(
                tokens[row],
                logprobs[row],
                finish[row] or ("length" if len(tokens[row]) == sampling.max_tokens else "interrupted"),  # type: ignore[arg-type]
                masks[row] if record_mask else None,
            )
            for row in range(rows)
        ]


def load_in_place(model: PreTrainedModel, checkpoint_dir: str) -> None:
    """Copy a pulled version's weights into `model`: only the files its manifest lists, all of
    them read and checked (names, shapes, dtypes) before any tensor is copied, so a version that
    does not fit leaves the model untouched. A LoRA adapter version is merged onto its base."""
    base_dir = adapter_base_dir(checkpoint_dir)
    weights_dir = base_dir or checkpoint_dir
    weights = read_weight_files(weights_dir, weight_names(weights_dir))
    params = model.state_dict()  # tensors aliasing the model's
    check_loadable(params, weights, where=weights_dir)
    if base_dir is not None:
        merged = merged_weights(base_dir, checkpoint_dir)
        check_loadable(params, merged, strict=False, where=checkpoint_dir)
        weights.update(merged)
    with torch.no_grad():
        for name, tensor in weights.items():
            params[name].copy_(tensor)


def weight_names(directory: str) -> list[str]:
    """The safetensors files of a version: in a pulled one, as its manifest lists them (never a
    glob: a file planted beside them is not the version's); in a directory that was not pulled
    (a local checkpoint, a test's), as from_pretrained finds them: the index's shards or model.safetensors."""
    if os.path.lexists(os.path.join(directory, MANIFEST_NAME)):
        return [f.path for f in read_cached_manifest(directory).files if f.path.endswith(".safetensors")]
    index = os.path.join(directory, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index, encoding="utf-8") as f:
            return sorted(set(json.load(f)["weight_map"].values()))
    return ["model.safetensors"]
