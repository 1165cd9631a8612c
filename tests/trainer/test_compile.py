"""`[trainer] compile` (decentrl/trainer/step.py `compile_blocks`): what it refuses at start-up, and
LoRA's adapters inside compiled blocks. The compiled step itself is checked against one plain model
in tests/trainer/test_trainer_parity.py."""

from __future__ import annotations

import pytest
import torch

from decentrl.config import LoRAConfig, TinyModelConfig, TrainerConfig
from decentrl.model.build import build_model
from decentrl.trainer.batching import batch_totals, collate
from decentrl.trainer.lora import add_adapters
from decentrl.trainer.step import accumulate_gradients, compile_blocks
from tests.trainer.test_loss_chunks import sample

DENSE = TinyModelConfig(hidden_size=32, num_layers=2, num_heads=2, intermediate_size=64)


def test_a_moe_model_is_refused_saying_what_to_set() -> None:
    """A compiled block would not follow the replay hooks on its routers; a pretrained MoE model
    (which the config cannot see: `[model.moe]` is refused there) is refused when the trainer loads it."""
    moe = TinyModelConfig(hidden_size=32, num_layers=2, num_heads=2, intermediate_size=64,
                          moe={"num_experts": 4, "top_k": 2, "expert_intermediate_size": 16})
    with pytest.raises(ValueError, match=r"MoE routers.*trainer\.compile = false"):
        compile_blocks(build_model(moe))


def test_a_missing_compiler_is_refused_at_start_up(monkeypatch: pytest.MonkeyPatch) -> None:
    """Inductor builds CPU kernels with the C++ compiler CXX names: a missing one is a clear error
    when the trainer loads its model, not a traceback at its first step."""
    monkeypatch.setenv("CXX", "no-such-compiler-here")
    with pytest.raises(ValueError, match=r"C\+\+ compiler .*no-such-compiler-here.*trainer\.compile = false"):
        compile_blocks(build_model(DENSE))


def test_lora_adapters_in_compiled_blocks_get_the_eager_gradients() -> None:
    samples = [sample([1, 7, 3], [5, 2, 8, 2], 1.0), sample([1, 7, 5, 8, 3], [4, 4, 6], -0.5)]
    grads = []
    for compiled in (False, True):
        torch.manual_seed(0)
        model = add_adapters(build_model(DENSE), LoRAConfig(rank=4))
        with torch.no_grad():  # B starts at zero: move it, so the adapters change the output
            for name, parameter in model.named_parameters():
                if "lora_B" in name:
                    parameter.normal_(0, 0.1)
        if compiled:
            compile_blocks(model)
        config = TrainerConfig(compile=compiled, entropy_coef=0.01)
        loss, _ = accumulate_gradients(model, None, [collate(samples, pad_id=0)], totals=batch_totals(samples, 8),
                                       config=config, temperature=1.0)
        grads.append({name: p.grad for name, p in model.named_parameters() if p.requires_grad})
    eager, compiled_grads = grads
    assert eager and set(eager) == set(compiled_grads) and all("lora_" in name for name in eager)
    for name, grad in eager.items():
        torch.testing.assert_close(compiled_grads[name], grad, rtol=1e-4, atol=1e-6, msg=name)
