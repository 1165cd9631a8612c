"""decentrl/store/weights.py: checkpoint weights written and read back in every layout, and copied
into a built model all or nothing (a version that does not fit leaves the old weights)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from transformers import PreTrainedModel

from decentrl.config import TinyModelConfig
from decentrl.model.build import build_model, build_tiny_tokenizer
from decentrl.store.weights import (
    INDEX_NAME,
    WEIGHTS_NAME,
    Adapter,
    CheckpointError,
    copy_into,
    load_pretrained,
    merge_adapter,
    read_hf_weights,
    weights_from_files,
    write_hf_dir,
)
from workers.backends.hf import HFBackend

TINY = {"hidden_size": 32, "num_layers": 1, "num_heads": 2, "intermediate_size": 64}


def snapshot(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: tensor.clone() for name, tensor in model.state_dict().items()}


def assert_same(state: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert state.keys() == expected.keys()
    for name, tensor in expected.items():
        torch.testing.assert_close(state[name], tensor, rtol=0, atol=0)


@pytest.fixture
def model() -> PreTrainedModel:
    return build_model(TinyModelConfig(**TINY, seed=0))


@pytest.fixture
def other() -> dict[str, torch.Tensor]:
    """Weights of the same architecture, every tensor different from `model`'s."""
    return snapshot(build_model(TinyModelConfig(**TINY, seed=1)))


def test_copy_into_replaces_every_tensor_in_place(model: PreTrainedModel, other: dict[str, torch.Tensor]) -> None:
    storage = {name: tensor.data_ptr() for name, tensor in model.state_dict().items()}
    copy_into(model, other)
    assert_same(model.state_dict(), other)
    assert {name: tensor.data_ptr() for name, tensor in model.state_dict().items()} == storage  # no new tensors


def broken(other: dict[str, torch.Tensor], fault: str) -> tuple[dict[str, torch.Tensor], str]:
    """`other` with one fault, and the text the error must name."""
    state = dict(other)
    if fault == "missing key":
        del state["lm_head.weight"]
        return state, "missing lm_head.weight"
    if fault == "unexpected key":
        state["model.layers.7.mlp.up_proj.weight"] = torch.zeros(64, 32)
        return state, "unexpected model.layers.7.mlp.up_proj.weight"
    if fault == "wrong shape":
        state["model.norm.weight"] = torch.ones(31)
        return state, "model.norm.weight (31,) torch.float32 (model: (32,) torch.float32)"
    state["model.norm.weight"] = state["model.norm.weight"].double()
    return state, "model.norm.weight (32,) torch.float64 (model: (32,) torch.float32)"


@pytest.mark.parametrize("fault", ["missing key", "unexpected key", "wrong shape", "wrong dtype"])
def test_copy_into_checks_everything_before_copying_anything(
    model: PreTrainedModel, other: dict[str, torch.Tensor], fault: str
) -> None:
    """Every other tensor of the faulty state would change the model: none may be copied."""
    before = snapshot(model)
    state, named = broken(other, fault)
    with pytest.raises(CheckpointError, match="the weights do not fit the model") as error:
        copy_into(model, state)
    assert named in str(error.value)
    assert_same(model.state_dict(), before)


def test_an_error_names_the_first_offending_keys_and_counts_the_rest(model: PreTrainedModel) -> None:
    with pytest.raises(CheckpointError) as error:
        copy_into(model, {})
    names = sorted(model.state_dict())
    assert f"missing {', '.join(names[:8])} and {len(names) - 8} more" in str(error.value)


@pytest.mark.parametrize("sharded", [False, True])
def test_an_hf_dir_reads_back_as_written(model: PreTrainedModel, tmp_path: Path, sharded: bool) -> None:
    state = snapshot(model)
    total = sum(t.numel() * t.element_size() for t in state.values())
    write_hf_dir(str(tmp_path), state, model.config, extras_from=str(tmp_path), max_shard_bytes=total // 4 if sharded else total)
    assert (tmp_path / INDEX_NAME).is_file() == sharded and (tmp_path / WEIGHTS_NAME).is_file() != sharded
    assert_same(read_hf_weights(str(tmp_path)), state)
    files = {path.name: path.read_bytes() for path in tmp_path.iterdir() if path.name != "config.json"}
    assert_same(weights_from_files(files), state)


def test_only_the_files_the_index_names_are_read(model: PreTrainedModel, tmp_path: Path) -> None:
    state = snapshot(model)
    total = sum(t.numel() * t.element_size() for t in state.values())
    write_hf_dir(str(tmp_path), state, model.config, extras_from=str(tmp_path), max_shard_bytes=total // 4)
    (tmp_path / "stray.safetensors").write_bytes(b"not read")
    assert_same(read_hf_weights(str(tmp_path)), state)
    shard = sorted(tmp_path.glob("model-*.safetensors"))[-1]
    shard.unlink()
    with pytest.raises(CheckpointError, match=f"{shard.name}, named by {INDEX_NAME}, is missing"):
        read_hf_weights(str(tmp_path))
    (tmp_path / INDEX_NAME).unlink()
    with pytest.raises(CheckpointError, match=f"neither {WEIGHTS_NAME} nor {INDEX_NAME}"):
        read_hf_weights(str(tmp_path))


def test_an_adapter_for_modules_the_base_lacks_is_refused(other: dict[str, torch.Tensor]) -> None:
    adapter = Adapter(
        {"base_model.model.model.layers.3.self_attn.q_proj.lora_A.weight": torch.zeros(2, 32),
         "base_model.model.model.layers.3.self_attn.q_proj.lora_B.weight": torch.zeros(32, 2)},
        scale=2.0,
    )
    with pytest.raises(CheckpointError, match=r"missing model\.layers\.3\.self_attn\.q_proj\.weight"):
        merge_adapter(other, adapter)


def test_a_worker_keeps_its_version_when_the_next_does_not_fit(model: PreTrainedModel, tmp_path: Path) -> None:
    """The HF backend's weight swap: a version of another architecture raises and leaves the
    loaded version's weights in the model, still usable."""
    v0, wide = tmp_path / "v0", tmp_path / "wide"
    build_tiny_tokenizer().save_pretrained(v0)
    write_hf_dir(str(v0), model.state_dict(), model.config, extras_from=str(v0))
    foreign = build_model(TinyModelConfig(**{**TINY, "intermediate_size": 96}))
    write_hf_dir(str(wide), foreign.state_dict(), foreign.config, extras_from=str(v0))
    backend = HFBackend(seed=0)
    backend.load(str(v0), 0)
    assert backend.model is not None
    before = snapshot(backend.model)
    with pytest.raises(CheckpointError, match=r"wrong shape or dtype .*model\.layers\.0\.mlp\.down_proj\.weight \(32, 96\)"):
        backend.load(str(wide), 1)
    assert backend.version == 0
    assert_same(backend.model.state_dict(), before)


def pulled_version(tmp_path: Path, state: dict[str, torch.Tensor], model: PreTrainedModel, *, shard_bytes: int | None = None) -> Path:
    """`state` written as the trainer writes a version, published and pulled: a directory
    holding the manifest its pull kept."""
    from decentrl.store.checkpoints import CheckpointStore

    source = tmp_path / "source"
    build_tiny_tokenizer().save_pretrained(source)
    total = sum(t.numel() * t.element_size() for t in state.values())
    write_hf_dir(str(source), state, model.config, extras_from=str(source), max_shard_bytes=shard_bytes or total)
    store = CheckpointStore(str(tmp_path / "store"), link_local=False)
    store.publish(0, str(source))
    return Path(store.pull(0, str(tmp_path / "cache")))


def test_a_pulled_versions_first_load_is_checked_too(model: PreTrainedModel, tmp_path: Path) -> None:
    """from_pretrained fills a missing tensor with random values: the first version a worker
    loads is refused for it, as every later one is."""
    state = snapshot(model)
    del state["lm_head.weight"]
    pulled = pulled_version(tmp_path, state, model)
    with pytest.raises(CheckpointError, match="missing lm_head.weight"):
        HFBackend(seed=0).load(str(pulled), 0)


def test_a_pulled_version_is_read_as_its_manifest_lists_it(model: PreTrainedModel, tmp_path: Path) -> None:
    """Only the manifest's files, each a regular file; an index that is not one, or a tensor in
    two shards, is a CheckpointError naming the file."""
    state = snapshot(model)
    total = sum(t.numel() * t.element_size() for t in state.values())
    pulled = pulled_version(tmp_path, state, model, shard_bytes=total // 4)
    # A model.safetensors planted beside the manifest's shards is never read.
    save_file({name: torch.zeros_like(tensor) for name, tensor in state.items()}, str(pulled / WEIGHTS_NAME))
    assert_same(read_hf_weights(str(pulled)), state)
    first, second = sorted(pulled.glob("model-*.safetensors"))[:2]
    second.unlink()
    second.symlink_to(first)
    with pytest.raises(CheckpointError, match="a symlink, not a file the pull made"):
        read_hf_weights(str(pulled))
    second.unlink()
    second.write_bytes(first.read_bytes())  # the same tensors in two files
    with pytest.raises(CheckpointError, match="tensors also in another file"):
        read_hf_weights(str(pulled))
    (pulled / INDEX_NAME).write_text('{"weight_map": [1, 2]}')
    with pytest.raises(CheckpointError, match="weight_map is not a map"):
        read_hf_weights(str(pulled))
    files = {path.name: path.read_bytes() for path in pulled.iterdir() if path.name != "config.json"}
    with pytest.raises(CheckpointError, match=f"{INDEX_NAME}: weight_map is not a map"):
        weights_from_files(files)


def test_a_tied_head_is_written_once_whatever_tensor_holds_it(tmp_path: Path) -> None:
    """A gathered (FSDP) or dtype-converted state holds the tied head as a tensor of its own: the
    directory still holds it once, as save_pretrained writes it, and loads tied again."""
    from safetensors import safe_open
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=2, tie_word_embeddings=True,
    )
    tied = LlamaForCausalLM(config)
    state = {name: tensor.clone() for name, tensor in tied.state_dict().items()}  # no storage shared
    assert "lm_head.weight" in state
    tokenizer_dir = tmp_path / "tokenizer"
    build_tiny_tokenizer().save_pretrained(tokenizer_dir)
    out = tmp_path / "out"
    write_hf_dir(str(out), state, config, str(tokenizer_dir), dtype=torch.bfloat16)
    with safe_open(str(out / "model.safetensors"), "pt") as written:
        assert "lm_head.weight" not in set(written.keys()) and "model.embed_tokens.weight" in set(written.keys())
    loaded = load_pretrained(str(out), as_published=True)
    assert torch.equal(loaded.lm_head.weight, loaded.model.embed_tokens.weight)
    assert torch.equal(loaded.lm_head.weight, state["model.embed_tokens.weight"].to(torch.bfloat16))
