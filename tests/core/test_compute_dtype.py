"""Each role computes in the dtype its hardware is fast at (decentrl/model/devices.py): bf16 only
where the device computes it natively, else fp32 from the same bf16 weights, so that the published
bytes never change. The rule, the roles that follow it (hf worker, verifier, trainer, `decentrl
run`'s start-up line), and the emulated AVX2 machine (docs/reproducibility.md) that reports itself
as one.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from decentrl.api.wire import Rollout, SamplingParams
from decentrl.config import TinyModelConfig, VerificationConfig, load_config
from decentrl.model import devices
from decentrl.model.build import build_model, build_tiny_tokenizer
from decentrl.model.devices import compute_dtype, machine, roles_line
from decentrl.store.checkpoints import CheckpointStore
from decentrl.store.weights import CheckpointError, write_hf_dir
from decentrl.trainer.train import mixed_precision
from orchestrator.verify import Verifier
from workers.backends.hf import HFBackend

ROOT = Path(__file__).resolve().parents[2]
TINY = TinyModelConfig(hidden_size=32, num_layers=2, num_heads=2, intermediate_size=64, seed=3)
CPU = torch.device("cpu")
SetNative = Callable[[bool], None]
AVX2 = {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2", "MKL_ENABLE_INSTRUCTIONS": "AVX2"}


@pytest.fixture
def bf16_native(monkeypatch: pytest.MonkeyPatch) -> SetNative:
    """Set whether this CPU counts as computing bf16 natively."""

    def set_to(native: bool) -> None:
        monkeypatch.setattr(devices, "bf16_native", lambda device: native)

    return set_to


def test_auto_computes_bf16_weights_in_bf16_only_where_native(bf16_native: SetNative) -> None:
    bf16_native(True)
    assert compute_dtype("auto", CPU, torch.bfloat16) == torch.bfloat16
    bf16_native(False)  # an AVX2 CPU: bf16 matmuls emulated, 4-5x slower than fp32
    assert compute_dtype("auto", CPU, torch.bfloat16) == torch.float32
    assert compute_dtype("auto", CPU, torch.float16) == torch.float32  # no CPU here computes fp16 natively


def test_auto_never_lowers_fp32_weights_and_an_explicit_setting_wins(bf16_native: SetNative) -> None:
    bf16_native(True)
    assert compute_dtype("auto", CPU, torch.float32) == torch.float32
    assert compute_dtype("fp32", CPU, torch.bfloat16) == torch.float32
    bf16_native(False)
    assert compute_dtype("bf16", CPU, torch.bfloat16) == torch.bfloat16


def test_the_machine_reports_what_torch_dispatches_to() -> None:
    here = machine()
    assert here.device == "cpu" and here.threads == torch.get_num_threads()
    assert here.isa in ("amx", "avx512", "avx2", "arm", "default")
    if here.isa == "avx2":
        assert not here.bf16_native  # bf16 is emulated on AVX2
    assert "computes in float32" in here.line("float32")


def _in_child(env: dict[str, str], tmp_path: Path) -> dict[str, object]:
    code = (
        "import json, torch; from decentrl.model.devices import machine, compute_dtype; m = machine(); "
        "print(json.dumps({'isa': m.isa, 'cpu_isa': m.cpu_isa, 'bf16_native': m.bf16_native, "
        "'auto': str(compute_dtype('auto', torch.device('cpu'), torch.bfloat16))}))"
    )
    # Its own inductor cache: inductor's is not keyed by ATEN_CPU_CAPABILITY (docs/reproducibility.md).
    child_env = {**os.environ, **env, "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor")}
    done = subprocess.run([sys.executable, "-c", code], env=child_env, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_an_emulated_avx2_machine_reports_itself_and_computes_in_fp32(tmp_path: Path) -> None:
    """ATEN_CPU_CAPABILITY=avx2 with oneDNN and MKL held to AVX2 is how a developer on an AVX-512
    or AMX machine reproduces an AVX2 one: every role must see an AVX2 machine there too."""
    if machine().cpu_isa not in ("avx512", "amx"):
        pytest.skip(f"this CPU ({machine().cpu_isa}) has no AVX-512 to hold back: nothing is emulated")
    found = _in_child(AVX2, tmp_path)
    assert found == {"isa": "avx2", "cpu_isa": machine().cpu_isa, "bf16_native": False, "auto": "torch.float32"}


# -- the roles ----------------------------------------------------------------------------


def published(tmp_path: Path, dtype: torch.dtype, seed: int = 3) -> tuple[CheckpointStore, torch.nn.Module]:
    """The tiny model published as version 0 in `dtype`, as the trainer publishes one."""
    model = build_model(TINY.model_copy(update={"seed": seed}))
    directory = tmp_path / f"v0-{seed}"
    directory.mkdir()
    tokenizer = build_tiny_tokenizer()
    tokenizer.save_pretrained(str(directory))
    model.generation_config.save_pretrained(str(directory))
    write_hf_dir(str(directory), model.state_dict(), model.config, extras_from=str(directory), dtype=dtype)
    store = CheckpointStore(f"file://{tmp_path}/store")
    store.publish(0, str(directory))
    return store, model


def test_an_hf_worker_computes_bf16_versions_in_fp32_where_bf16_is_not_native(tmp_path: Path, bf16_native: SetNative) -> None:
    bf16_native(False)
    store, model = published(tmp_path, torch.bfloat16)
    backend = HFBackend(seed=0)
    backend.load(store.pull(0, str(tmp_path / "cache")), 0)
    assert backend.compute_dtype == "float32" and backend.published == torch.bfloat16
    for name, tensor in backend.model.state_dict().items():  # the published bf16 weights, upcast exactly
        torch.testing.assert_close(tensor, model.state_dict()[name].bfloat16().float(), rtol=0, atol=0)
    completion = backend.generate([[1, 5, 3, 7]], SamplingParams(temperature=1.0, max_tokens=4))[0]
    assert len(completion.token_ids) >= 1
    # A later version is copied in (upcast); one published in another dtype is refused whole.
    other = build_model(TINY.model_copy(update={"seed": 4})).state_dict()
    store.publish(1, _version_dir(tmp_path / "v1", other, torch.bfloat16), parent=0)
    backend.load(store.pull(1, str(tmp_path / "cache")), 1)
    torch.testing.assert_close(backend.model.state_dict()["lm_head.weight"], other["lm_head.weight"].bfloat16().float(),
                               rtol=0, atol=0)
    store.publish(2, _version_dir(tmp_path / "v2", other, torch.float32), parent=1)
    with pytest.raises(CheckpointError, match="every version of a run is published in one dtype"):
        backend.load(store.pull(2, str(tmp_path / "cache")), 2)
    assert backend.version == 1


def _version_dir(directory: Path, state: dict[str, torch.Tensor], dtype: torch.dtype) -> str:
    model = build_model(TINY)
    directory.mkdir()
    build_tiny_tokenizer().save_pretrained(str(directory))
    model.generation_config.save_pretrained(str(directory))
    write_hf_dir(str(directory), state, model.config, extras_from=str(directory), dtype=dtype)
    return str(directory)


def test_an_hf_worker_computes_in_bf16_where_native_or_told(tmp_path: Path, bf16_native: SetNative) -> None:
    bf16_native(True)
    store, _ = published(tmp_path, torch.bfloat16)
    backend = HFBackend(seed=0)
    backend.load(store.pull(0, str(tmp_path / "cache")), 0)
    assert backend.compute_dtype == "bfloat16"
    bf16_native(False)
    told = HFBackend(seed=0, compute="bf16")
    told.load(store.pull(0, str(tmp_path / "cache")), 0)
    assert told.compute_dtype == "bfloat16"


def test_an_hf_worker_told_bf16_refuses_fp32_versions(tmp_path: Path) -> None:
    """The verifier holds fp32 versions to fp32 bounds: a worker computing them in bf16 would be struck."""
    store, _ = published(tmp_path, torch.float32)
    with pytest.raises(ValueError, match="compute_dtype = 'bf16' but the run publishes float32 versions"):
        HFBackend(seed=0, compute="bf16").load(store.pull(0, str(tmp_path / "cache")), 0)


def test_the_verifier_computes_bf16_versions_in_fp32_and_keeps_the_bf16_bounds(tmp_path: Path, bf16_native: SetNative) -> None:
    bf16_native(False)
    store, _ = published(tmp_path, torch.bfloat16)
    config = VerificationConfig(enabled=True)
    verifier = Verifier(config, store=store, build=lambda: build_model(TINY), cache_dir=str(tmp_path / "verifier"))
    worker = HFBackend(seed=0, compute="bf16")  # a worker on a bf16 machine
    worker.load(store.pull(0, str(tmp_path / "cache")), 0)
    prompt = [1, 5, 3, 7]
    sampling = SamplingParams(temperature=1.0, max_tokens=8)
    completion = worker.generate([prompt], sampling)[0]
    rollout = Rollout(
        run_name="r", rollout_id="x", lease_id="l", policy_version=0, prompt_id=0, worker_id="w",
        prompt_token_ids=prompt, completion_token_ids=completion.token_ids, logprobs=completion.logprobs,
        finish_reason=completion.finish_reason, sampling=sampling,
    )
    recomputed, _ = verifier.recompute([rollout], 0)
    assert verifier.dtype == torch.float32
    assert verifier.tolerances == (config.half_tolerance, config.half_mean_tolerance)
    differences = (recomputed - torch.tensor(completion.logprobs, dtype=recomputed.dtype)).abs()
    assert differences.max() <= config.half_tolerance


def test_the_trainer_resolves_auto_against_the_published_dtype(bf16_native: SetNative) -> None:
    tiny = load_config(str(ROOT / "configs" / "local.toml"))  # fp32 versions: fp32 whatever the CPU
    bf16_native(True)
    assert mixed_precision(tiny, CPU) == "fp32"
    bf16 = tiny.model_copy(update={"store": tiny.store.model_copy(update={"publish_dtype": "bf16"})})
    assert mixed_precision(bf16, CPU) == "bf16"
    bf16_native(False)
    assert mixed_precision(bf16, CPU) == "fp32"
    told = bf16.model_copy(update={"trainer": bf16.trainer.model_copy(update={"mixed_precision": "bf16"})})
    assert mixed_precision(told, CPU) == "bf16"


def test_decentrl_run_says_what_each_role_computes_in(bf16_native: SetNative) -> None:
    config = load_config(str(ROOT / "configs" / "local.toml"), ["store.publish_dtype=bf16"])
    bf16_native(False)
    line = roles_line(config)
    assert line.startswith(f"machine: {machine().isa}")
    assert "versions in bf16" in line and "trainer fp32 x 2 ranks" in line and "workers fp32" in line
    bf16_native(True)
    assert "trainer bf16" in roles_line(config) and "workers bf16" in roles_line(config)
