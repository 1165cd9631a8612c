"""[placement]: the config's checks, who goes on which GPU, the start-up checks against the
machine's GPUs (given as a count, so all of it runs on CPU), and the commands and environments
`decentrl run` builds from it - unchanged for a config without [placement]; and the summary it prints."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from decentrl.cli.launch import launch, role_starts, summarize
from decentrl.cli.main import app
from decentrl.config import ConfigError, HFScorerConfig, Placed, RunConfig, load_config, parse_config
from decentrl.model.devices import device_problem, gpus_problem, placement_problem

PLACEMENT_TOML = """
trainer_ranks = 4
num_workers = 4

[placement.trainer]
gpus = [0, 1, 2, 3]
memory = 0.9
[placement.workers]
gpus = [4, 5, 6, 7]
memory = 0.9
[placement.scorers]
gpus = []
memory = 0.2
"""

MODEL_SCORER = {"orchestrator": {"rewards": {"type": "model"}}, "scorer": {"type": "hf", "path": "/rm"}}


def placed(**placement: dict) -> RunConfig:
    return parse_config({"trainer_ranks": 2, "num_workers": 1, "placement": placement})


def test_the_documented_toml_shape_loads(tmp_path: Path) -> None:
    path = tmp_path / "run.toml"
    path.write_text(PLACEMENT_TOML)
    config = load_config(str(path))
    assert config.placement.trainer.gpus == [0, 1, 2, 3] and config.placement.scorers.memory == 0.2
    assert config.processes() == {
        "trainer": Placed((0, 1, 2, 3), 0.9),
        **{f"worker-{i}": Placed((4 + i,), 0.9) for i in range(4)},
    }


def test_without_placement_every_process_stays_on_the_cpu() -> None:
    config = parse_config({"num_scorers": 1, **MODEL_SCORER})
    assert not config.placement.used
    assert config.processes() == {"trainer": Placed(), "worker-0": Placed(), "worker-1": Placed(), "scorer-0": Placed()}


def test_workers_cycle_over_their_gpus_and_the_trainer_sees_all_of_its_own() -> None:
    config = parse_config({
        "trainer_ranks": 2, "num_workers": 5,
        "placement": {"trainer": {"gpus": [3, 1], "memory": 0.5}, "workers": {"gpus": [1, 2], "memory": 0.15}},
    })
    places = config.processes()
    assert places["trainer"].visible_devices == "3,1"  # LOCAL_RANK 0 -> cuda:0 = GPU 3
    assert [places[f"worker-{i}"].gpus for i in range(5)] == [(1,), (2,), (1,), (2,), (1,)]
    assert places["worker-4"].memory == 0.15


@pytest.mark.parametrize(("data", "names"), [
    ({"trainer_ranks": 2, "placement": {"trainer": {"gpus": [0, 1, 2]}}},
     ["placement.trainer.gpus lists 3 GPU(s)", "trainer_ranks = 2"]),
    ({"trainer_ranks": 2, "placement": {"trainer": {"gpus": [0, 0]}}},
     ["placement.trainer.gpus = [0, 0] lists GPU 0 more than once"]),
    ({"placement": {"workers": {"gpus": [0, -1]}}}, ["placement.workers.gpus.1: Input should be greater than or equal to 0"]),
    ({"placement": {"workers": {"memory": 0}}}, ["placement.workers.memory: Input should be greater than 0"]),
    ({"placement": {"scorers": {"memory": 1.5}}}, ["placement.scorers.memory: Input should be less than or equal to 1"]),
    ({"worker": {"backend": "openai", "openai": {"url": "http://127.0.0.1:1", "model": "m"}},
      "placement": {"workers": {"gpus": [0]}}}, ["worker.backend = 'openai'", "placement.workers.gpus = []"]),
    ({"num_scorers": 1, **MODEL_SCORER, "scorer": {"type": "python", "function": "m:f"},
      "placement": {"scorers": {"gpus": [0]}}}, ["scorer.type = 'python'", "placement.scorers.gpus = []"]),
    ({"num_scorers": 1, "orchestrator": {"rewards": {"type": "sum", "model_weight": 0.0}, "advantages": {"distill": {}}},
      "scorer": {"type": "teacher", "server": {"base_url": "http://127.0.0.1:1/v1", "model": "t"}},
      "placement": {"scorers": {"gpus": [0]}}}, ["scorer.type = 'teacher' with a [scorer.server]", "placement.scorers.gpus = []"]),
    ({"num_workers": 2, "placement": {"workers": {"gpus": [0, 1, 2]}}},
     ["placement.workers.gpus lists 3 GPUs [0, 1, 2] but num_workers = 2", "set num_workers = 3"]),
    ({"num_scorers": 1, **MODEL_SCORER, "placement": {"scorers": {"gpus": [0, 1]}}},
     ["placement.scorers.gpus lists 2 GPUs [0, 1] but num_scorers = 1"]),
    ({"worker": {"gpu_memory": 0}}, ["worker.gpu_memory: Input should be greater than 0"]),
    ({"trainer": {"gpu_memory": 1.1}}, ["trainer.gpu_memory: Input should be less than or equal to 1"]),
])
def test_a_bad_placement_names_the_keys_to_change(data: dict, names: list[str]) -> None:
    with pytest.raises(ConfigError) as error:
        parse_config(data)
    for name in names:
        assert name in str(error.value)


def test_memory_shares_on_one_gpu_must_fit() -> None:
    with pytest.raises(ConfigError) as error:
        parse_config({
            "trainer_ranks": 1, "num_workers": 1,
            "placement": {"trainer": {"gpus": [0], "memory": 0.6}, "workers": {"gpus": [0], "memory": 0.5}},
        })
    assert ("GPU 0: trainer rank 0 (0.6) + worker-0 (0.5) = 1.1 > 1: "
            "lower placement.trainer.memory or placement.workers.memory") in str(error.value)
    # Two workers cycling onto one GPU count twice; at 0.5 each they fit, next to a scorer they do not.
    assert parse_config({"num_workers": 2, "placement": {"workers": {"gpus": [5], "memory": 0.5}}}).placement.used
    with pytest.raises(ConfigError, match=r"GPU 5: worker-0 \(0.5\) \+ worker-1 \(0.5\) \+ scorer-0 \(0.2\) = 1.2 > 1"):
        parse_config({
            "num_workers": 2, "num_scorers": 1, **MODEL_SCORER,
            "placement": {"workers": {"gpus": [5], "memory": 0.5}, "scorers": {"gpus": [5], "memory": 0.2}},
        })


def test_placement_on_a_machine_without_cuda_or_without_that_gpu() -> None:
    config = placed(workers={"gpus": [0]})
    assert placement_problem(config, available=0) == (
        "placement.workers.gpus = [0] but this machine has no CUDA GPU (torch.cuda.is_available() is False): "
        "remove [placement] or run on a GPU machine"
    )
    assert placement_problem(config, available=1) is None
    wide = parse_config({
        "trainer_ranks": 2, "num_workers": 2,
        "placement": {"trainer": {"gpus": [0, 1], "memory": 0.5}, "workers": {"gpus": [2, 3], "memory": 0.5}},
    })
    problem = placement_problem(wide, available=3)
    assert problem is not None and problem.startswith("placement.workers.gpus = [2, 3] names GPU 3 but this machine has 3")
    assert placement_problem(wide, available=4) is None


def test_a_role_device_naming_cuda_needs_cuda() -> None:
    assert device_problem("worker.device", "cpu", 0) is None
    assert device_problem("worker.device", "cuda", 1) is None
    assert device_problem("worker.device", "cuda", 0) == (
        "worker.device = 'cuda' but this machine has no CUDA GPU (torch.cuda.is_available() is False): "
        "set worker.device = 'cpu' or run on a GPU machine"
    )
    problem = device_problem("scorer.device", "cuda:2", 2)
    assert problem is not None and "scorer.device = 'cuda:2' names GPU 2 but this machine has 2" in problem
    assert gpus_problem("x", [], [], 0, instead="y") is None
    # the launcher checks the devices of roles it starts unplaced too
    assert "worker.device = 'cuda:0'" in (placement_problem(parse_config({"worker": {"device": "cuda:0"}}), 0) or "")


def test_without_placement_the_launcher_builds_todays_commands(tmp_path: Path) -> None:
    config = parse_config({"num_scorers": 1, **MODEL_SCORER})
    path, url = tmp_path / "config.json", "http://127.0.0.1:1"
    tokens = {"trainer": "t", "worker-0": "w0", "worker-1": "w1", "scorer-0": "s0"}
    starts = role_starts(config, path, tmp_path, url, tokens)
    run = [sys.executable, "-m", "decentrl"]
    assert [(s.name, s.argv, s.env) for s in starts] == [
        ("trainer", [sys.executable, "-m", "decentrl.trainer.torchrun", "--standalone", "--nproc-per-node=2", "-m", "decentrl",
                     "trainer", str(path), "--orchestrator", url, "--run-dir", str(tmp_path)],
         {"DECENTRL_TOKEN": "t", "OMP_NUM_THREADS": "1"}),
        *[(f"worker-{i}", [*run, "worker", "--orchestrator", url, "--config", str(path), "--worker-id", f"worker-{i}",
                           "--cache-dir", str(tmp_path / "cache" / f"worker-{i}")],
           {"DECENTRL_TOKEN": f"w{i}", "OMP_NUM_THREADS": "1"}) for i in range(2)],
        ("scorer-0", [*run, "scorer", "--orchestrator", url, "--config", str(path), "--scorer-id", "scorer-0"],
         {"DECENTRL_TOKEN": "s0", "OMP_NUM_THREADS": "1"}),
    ]


def test_a_placed_run_sets_visible_devices_and_the_roles_settings(tmp_path: Path) -> None:
    config = parse_config({
        "trainer_ranks": 2, "num_workers": 3, "num_scorers": 1, **MODEL_SCORER,
        "placement": {
            "trainer": {"gpus": [0, 1], "memory": 0.6},
            "workers": {"gpus": [2, 3], "memory": 0.4},
            "scorers": {"gpus": [2], "memory": 0.2},
        },
    })
    tokens = {"trainer": "t", "worker-0": "w0", "worker-1": "w1", "worker-2": "w2", "scorer-0": "s0"}
    starts = {s.name: s for s in role_starts(config, tmp_path / "config.json", tmp_path, "http://127.0.0.1:1", tokens)}
    assert starts["trainer"].env["CUDA_VISIBLE_DEVICES"] == "0,1"
    assert starts["trainer"].argv[-2:] == ["--set", "trainer.gpu_memory=0.6"]
    assert [starts[f"worker-{i}"].env["CUDA_VISIBLE_DEVICES"] for i in range(3)] == ["2", "3", "2"]
    assert starts["worker-1"].argv[-4:] == ["--set", "worker.device=cuda", "--set", "worker.gpu_memory=0.4"]
    assert starts["scorer-0"].env == {"DECENTRL_TOKEN": "s0", "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": "2"}
    assert starts["scorer-0"].argv[-4:] == ["--set", "scorer.device=cuda", "--set", "scorer.gpu_memory=0.2"]
    # what the launcher hands a role loads as that role's settings
    argv = starts["worker-1"].argv
    overrides = [argv[i + 1] for i, arg in enumerate(argv) if arg == "--set"]
    worker = load_config(None, overrides).worker
    assert (worker.device, worker.gpu_memory) == ("cuda", 0.4)


def test_decentrl_run_refuses_a_placement_this_machine_cannot_hold(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("checks the machine without CUDA")
    assert launch(placed(workers={"gpus": [0]}), str(tmp_path / "run")) == 2
    assert "placement.workers.gpus = [0] but this machine has no CUDA GPU" in capsys.readouterr().err
    assert not (tmp_path / "run" / "logs").exists()  # nothing started


def test_hf_roles_on_cuda_without_it_stop_with_one_line(tmp_path: Path) -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("checks the machine without CUDA")
    from workers.scorers import BackendConfigError
    from workers.scorers.hf import HFScoreBackend

    with pytest.raises(BackendConfigError, match=r"scorer.device = 'cuda' but this machine has no CUDA GPU"):
        HFScoreBackend(HFScorerConfig(path=str(tmp_path / "no-model"), device="cuda"))
    result = CliRunner().invoke(
        app, ["worker", "--orchestrator", "http://127.0.0.1:9", "--token", "t", "--set", "worker.device=cuda"]
    )
    assert result.exit_code == 2
    assert "error: worker.device = 'cuda' but this machine has no CUDA GPU" in result.output


@pytest.mark.gpu
def test_a_memory_share_caps_what_the_process_may_allocate() -> None:
    # In a process of its own: the share holds for the whole process, and other GPU tests share this one.
    script = """
import torch
from workers.backends.hf import HFBackend
HFBackend(device="cuda", gpu_memory=0.05)  # as `--set worker.device=cuda --set worker.gpu_memory=0.05`
total = torch.cuda.get_device_properties(0).total_memory
small = torch.empty(int(total * 0.02), dtype=torch.uint8, device="cuda")
try:
    torch.empty(int(total * 0.1), dtype=torch.uint8, device="cuda")
except torch.OutOfMemoryError:
    print("capped")
"""
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300,
                            env={**os.environ, "CUDA_VISIBLE_DEVICES": "0"})
    assert result.stdout.strip() == "capped", result.stderr


CONFIGS = Path(__file__).resolve().parents[2] / "configs"


def test_the_gpu_configs_place_their_roles_and_need_the_gpus_they_name() -> None:
    one = load_config(str(CONFIGS / "gpu1.toml"))
    places = one.processes()
    assert places["trainer"] == Placed((0,), 0.45) and places["worker-0"] == Placed((0,), 0.45)
    assert one.trainer.mixed_precision == "bf16" and one.store.publish_dtype == "bf16"
    assert placement_problem(one, 1) is None
    assert "no CUDA GPU" in (placement_problem(one, 0) or "")

    node = load_config(str(CONFIGS / "gpu.toml"))
    places = node.processes()
    assert places["trainer"].visible_devices == "0,1,2,3"
    assert [places[f"worker-{i}"].visible_devices for i in range(4)] == ["4", "5", "6", "7"]
    assert node.worker.backend == "vllm"
    assert placement_problem(node, 8) is None
    assert "names GPU 4" in (placement_problem(node, 4) or "")
    # Measured on an H100 (2026-11-27): compile won 1.72x on this shape; and each config's lease
    # outlasts its requests (the default 30 s did not, at 384 tokens): workers renew, but size
    # their requests to half the lease, so a shorter one would cut them.
    assert node.trainer.compile and not one.trainer.compile
    assert one.orchestrator.lease_timeout_s >= 120 and node.orchestrator.lease_timeout_s >= 300


def test_the_run_summary_compares_windows_that_never_overlap() -> None:
    def steps(*rewards: float) -> list[dict[str, object]]:
        return [{"reward_mean": r} for r in rewards]

    # Fewer than twice the window: the first and last halves (a shared window showed a gain of 0).
    short = summarize(steps(0.0, 0.1, 0.5, 0.7, 0.9), window=10)
    assert (short["window"], short["reward_first"], short["reward_last"]) == (2, pytest.approx(0.05), pytest.approx(0.8))
    assert short["reward_gain"] == pytest.approx(0.75)
    long = summarize(steps(*[0.0] * 10, *[1.0] * 10, *[0.5] * 10), window=10)
    assert (long["window"], long["reward_first"], long["reward_last"], long["reward_gain"]) == (10, 0.0, 0.5, 0.5)
    assert summarize(steps(0.4))["reward_gain"] == 0.0  # one step: nothing to compare
    assert summarize([])["steps"] == 0
