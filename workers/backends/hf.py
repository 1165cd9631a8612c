"""transformers backend: the CPU default (CUDA when the device says so).

Logprobs come from the raw logits (`output_logits`), scaled by the temperature actually used
for sampling, because `output_scores` holds logits after processors that may differ from the
sampled distribution.
"""

from __future__ import annotations

import glob
import os

import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, PreTrainedModel

from decentrl.wire import SamplingParams
from workers.backends import Completion


class HFBackend:
    def __init__(self, *, device: str = "cpu") -> None:
        self.device = torch.device(device)
        self.model: PreTrainedModel | None = None
        self.version: int | None = None

    def load(self, checkpoint_dir: str, version: int) -> None:
        if self.model is None:
            self.model = AutoModelForCausalLM.from_pretrained(checkpoint_dir, dtype=torch.float32)
            self.model.to(self.device).eval()
        else:
            # Same architecture, new weights: copy in place instead of rebuilding the module.
            state: dict[str, torch.Tensor] = {}
            for shard in sorted(glob.glob(os.path.join(checkpoint_dir, "*.safetensors"))):
                state.update(load_file(shard))
            self.model.load_state_dict(state, strict=True)
        self.version = version

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], sampling: SamplingParams) -> list[Completion]:
        assert self.model is not None, "load() a version before generate()"
        if sampling.top_k or sampling.top_p < 1.0:
            raise NotImplementedError("the hf backend samples from the full distribution; set top_k=0, top_p=1")
        config = self.model.generation_config
        eos_ids = {config.eos_token_id} if isinstance(config.eos_token_id, int) else set(config.eos_token_id or [])
        # Many pretrained models have no pad token; any id works under a zero attention mask.
        pad = config.pad_token_id if config.pad_token_id is not None else min(eos_ids, default=0)
        width = max(len(p) for p in prompts)
        # Left padding keeps every prompt's last token at the same position for generation.
        input_ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts], device=self.device)
        attention = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=self.device)
        out = self.model.generate(
            input_ids=input_ids,
            attention_mask=attention,
            do_sample=True,
            temperature=sampling.temperature,
            top_k=0,
            top_p=1.0,
            max_new_tokens=sampling.max_tokens,
            output_logits=True,
            return_dict_in_generate=True,
            pad_token_id=pad,
            eos_token_id=sorted(eos_ids) or None,
        )
        new_tokens = out.sequences[:, width:]  # (B, T)
        logits = torch.stack(out.logits, dim=1).float()  # (B, T, V)
        logprobs = torch.log_softmax(logits / sampling.temperature, dim=-1)
        token_logprobs = logprobs.gather(-1, new_tokens.unsqueeze(-1)).squeeze(-1)  # (B, T)
        return [self._cut(tokens, lps, eos_ids) for tokens, lps in zip(new_tokens.tolist(), token_logprobs.tolist())]

    @staticmethod
    def _cut(tokens: list[int], logprobs: list[float], eos_ids: set[int]) -> Completion:
        """Trim the padding generate() adds after a sequence's first end-of-sequence token."""
        for end, token in enumerate(tokens, start=1):
            if token in eos_ids:
                return Completion(tokens[:end], logprobs[:end], "stop")
        return Completion(tokens, logprobs, "length")
