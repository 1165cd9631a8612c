"""LoRA: the trainer's adapter files are what peft loads, and a worker's merged weights give the
logprobs of the adapted model; an adapter version in the store brings its base along."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from peft import PeftModel
from transformers import AutoModelForCausalLM, PreTrainedModel

from decentrl.config import LoRAConfig, TinyModelConfig
from decentrl.model.build import build_model, build_tiny_tokenizer
from decentrl.store.checkpoints import CheckpointStore
from decentrl.store.weights import ADAPTER_CONFIG, ADAPTER_WEIGHTS, write_hf_dir
from decentrl.trainer.lora import BASE_VERSION, add_adapters, is_adapter_weight, write_adapter_dir
from workers.backends.hf import HFBackend

MODEL = TinyModelConfig(hidden_size=32, num_layers=2, num_heads=2, intermediate_size=64, seed=3)
LORA = LoRAConfig(rank=4, alpha=8.0)


def trained_lora_model() -> PreTrainedModel:
    """The tiny model with adapters whose B matrices are no longer zero (as after some steps)."""
    model = add_adapters(build_model(MODEL), LORA)
    torch.manual_seed(1)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if is_adapter_weight(name):
                parameter.normal_(std=0.2)
    return model.eval()


def log_softmax(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return torch.log_softmax(model(input_ids=ids).logits.float(), dim=-1)  # (B, T, V)


@pytest.fixture
def ids() -> torch.Tensor:
    return torch.randint(3, 14, (3, 9), generator=torch.Generator().manual_seed(0))


def test_only_adapters_train_and_start_as_the_base(ids: torch.Tensor) -> None:
    model = add_adapters(build_model(MODEL), LORA)
    trainable = {name for name, p in model.named_parameters() if p.requires_grad}
    assert trainable and all(is_adapter_weight(name) for name in trainable)
    # 2 layers x q, k, v, o x (A, B)
    assert len(trainable) == 2 * 4 * 2
    torch.testing.assert_close(log_softmax(model.eval(), ids), log_softmax(build_model(MODEL).eval(), ids), rtol=0, atol=0)


def test_published_adapter_loads_in_peft_with_the_same_logits(tmp_path: Path, ids: torch.Tensor) -> None:
    model = trained_lora_model()
    write_adapter_dir(str(tmp_path), model.state_dict(), LORA)
    assert sorted(os.listdir(tmp_path)) == [ADAPTER_CONFIG, ADAPTER_WEIGHTS]
    loaded = PeftModel.from_pretrained(build_model(MODEL), str(tmp_path)).eval()
    torch.testing.assert_close(log_softmax(loaded, ids), log_softmax(model, ids), rtol=0, atol=1e-6)


@pytest.mark.kernels
def test_worker_merges_the_adapter_onto_its_pulled_base(tmp_path: Path, ids: torch.Tensor) -> None:
    base = build_model(MODEL)
    v0, v1 = tmp_path / "v0", tmp_path / "v1"
    build_tiny_tokenizer().save_pretrained(v0)
    write_hf_dir(str(v0), base.state_dict(), base.config, extras_from=str(v0))
    model = trained_lora_model()
    write_adapter_dir(str(v1), model.state_dict(), LORA)
    store = CheckpointStore(str(tmp_path / "store"))
    store.publish(BASE_VERSION, str(v0))
    store.publish(1, str(v1), parent=0, base_version=BASE_VERSION)
    assert store.manifest(1).base_version == BASE_VERSION and store.manifest(0).base_version is None

    # A worker that joins at v1 gets the base with it, in its cache.
    cache = tmp_path / "cache"
    backend = HFBackend(seed=0)
    backend.load(store.pull(1, str(cache)), 1)
    assert sorted(os.listdir(cache)) == ["v000000", "v000001"]
    assert backend.version == 1
    peft_model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(cache / "v000000"), str(cache / "v000001")).eval()
    torch.testing.assert_close(log_softmax(backend.model, ids), log_softmax(peft_model, ids), rtol=0, atol=1e-5)
    assert (log_softmax(backend.model, ids) - log_softmax(base.eval(), ids)).abs().max() > 1e-2  # the adapter did something

    # Back on the base (a full version): every merged weight is restored.
    backend.load(str(cache / "v000000"), 0)
    torch.testing.assert_close(log_softmax(backend.model, ids), log_softmax(base, ids), rtol=0, atol=0)


def test_cache_cap_keeps_the_base_of_the_adapter_in_use(tmp_path: Path) -> None:
    base = build_model(MODEL)
    v0 = tmp_path / "v0"
    write_hf_dir(str(v0), base.state_dict(), base.config, extras_from=str(v0))
    store = CheckpointStore(str(tmp_path / "store"), cache_max_bytes=1)  # everything but what is in use goes
    store.publish(0, str(v0))
    for version in (1, 2):
        adapter = tmp_path / f"v{version}"
        write_adapter_dir(str(adapter), trained_lora_model().state_dict(), LORA)
        store.publish(version, str(adapter), parent=version - 1, base_version=0)
    cache = tmp_path / "cache"
    store.pull(1, str(cache))
    store.pull(2, str(cache))
    assert sorted(os.listdir(cache)) == ["v000000", "v000002"]
