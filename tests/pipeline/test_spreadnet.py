"""The spread testbed's network (benchmarks/spreadnet.py) with real traffic between network
namespaces: bandwidth, RTT and jitter, and loss as each host's profile says, the delayer keeping up
at L1's 100 Mbit/s with its RTT applied, partitions that time out and heal, and nothing left behind
- when the block ends, on an error, and when the owner is killed. Skipped, saying why, where this
machine cannot make namespaces (not root, no iproute2/iptables/ethtool)."""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[2]
pytestmark = [pytest.mark.network, pytest.mark.integration]


def _load_spreadnet():  # noqa: ANN202 - a module loaded from benchmarks/, which is not a package
    if "spreadnet" not in sys.modules:  # one module object for every test (and benchmark) that loads it
        spec = importlib.util.spec_from_file_location("spreadnet", ROOT / "benchmarks" / "spreadnet.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules["spreadnet"] = module
        spec.loader.exec_module(module)
    return sys.modules["spreadnet"]


sn = _load_spreadnet()


@pytest.fixture(scope="module", autouse=True)
def _namespaces_work() -> None:
    if reason := sn.unavailable_reason():
        pytest.skip(reason)


def _leftovers(testbed_id: str) -> list[str]:
    return [ns for ns in sn._namespaces() if ns.startswith(f"{testbed_id}-")]


def _gone(pid: int) -> bool:
    """Exited: no process, or a zombie its (possibly non-reaping) parent has not collected."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except FileNotFoundError:
        return True


def _root_links() -> set[str]:
    return {line.split(":")[1].strip().split("@")[0] for line in
            subprocess.run(["ip", "-o", "link"], capture_output=True, text=True, check=True).stdout.splitlines()}


def _connect(host, ip: str, port: int, timeout: float = 0.5) -> str:  # noqa: ANN001 - a spreadnet.Host
    """'ok', or the error a TCP connect from `host` ran into."""
    code = ("import socket,sys\ntry:\n socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=float(sys.argv[3]))"
            "\n print('ok')\nexcept OSError as e:\n print(type(e).__name__)")
    return host.run([sys.executable, "-c", code, ip, str(port), str(timeout)], capture_output=True, text=True,
                    check=True).stdout.strip()


@pytest.mark.timeout(60)
def test_bandwidth_and_rtt_follow_the_profile() -> None:
    """10/2 Mbit/s and 60 ms: the frames that arrive within 5% of the rate each way, TCP goodput
    within 15% of the rate's payload share (a window opened mid-repair of a slow-start loss reads
    high), the RTT within a few ms of the profile (the echo itself adds about 0.2 ms)."""
    with sn.Testbed() as net:
        server = net.add_host("server", sn.Link(100, 100))
        home = net.add_host("home", sn.Link(10, 2, rtt_ms=60))
        measured = sn.measure_link(home, server, seconds=2, pings=10)
        stats = net.delayer_stats()
    assert measured["down_wire_mbit"] == pytest.approx(10, rel=0.05), measured
    assert measured["up_wire_mbit"] == pytest.approx(2, rel=0.05), measured
    assert measured["down_mbit"] == pytest.approx(10 * sn.PAYLOAD_PER_WIRE, rel=0.15), measured
    assert measured["up_mbit"] == pytest.approx(2 * sn.PAYLOAD_PER_WIRE, rel=0.15), measured
    assert 60 <= measured["rtt_ms"]["median"] <= 62, measured["rtt_ms"]
    # Two echoes of ten may meet a busy host's scheduler (CI: 67.2 ms with the median at 60.9; at load
    # 7-11, 66.8 and 71.0 with the median at 60.3, 2026-11-29): the third largest stays near the profile.
    assert sorted(measured["rtt_ms"]["samples"])[-3] <= 66 and measured["rtt_ms"]["max"] <= 80, measured["rtt_ms"]
    for host in stats.values():
        assert host["missed"] == 0 and host["unstamped"] == 0, stats
    assert stats["home"]["packets"] > 1000 and stats["server"]["packets"] > 1000, stats


@pytest.mark.timeout(60)
def test_jitter_spreads_the_rtt_within_its_range() -> None:
    """100 ms +- 40: every echo within the range (+ a few ms; a busy host's scheduler may add 10:
    146.1 ms at load 6-11, 2026-11-29), and spread across it."""
    with sn.Testbed() as net:
        server = net.add_host("server", sn.Link(100, 100))
        far = net.add_host("far", sn.Link(100, 100, rtt_ms=100, jitter_ms=40))
        rtts = sn.measure_link(far, server, seconds=0, pings=30)["rtt_ms"]
    assert 60 - 1 <= rtts["min"] and rtts["max"] <= 140 + 10, rtts
    assert rtts["max"] - rtts["min"] >= 30, rtts  # 30 draws of a sum of two uniforms of +-20 ms
    # The median of 30 draws of that triangular sum has a standard error of 40 / (2 * sqrt(30)) = 3.7 ms:
    # +-10 ms failed 1 run in a few hundred (CI, 2026-11-29: 111.7 ms); +-15 is 4 standard errors.
    assert 85 <= rtts["median"] <= 115, rtts


@pytest.mark.timeout(60)
def test_loss_is_the_profiles_each_way() -> None:
    """2% loss: 5000 UDP datagrams each way lose 2% (+- 4 standard deviations), whether the lossy
    host sends or receives them; a lossless pair loses none."""
    with sn.Testbed() as net:
        server = net.add_host("server", sn.Link(100, 100))
        lossy = net.add_host("lossy", sn.Link(20, 20, loss=0.02))
        clean = net.add_host("clean", sn.Link(20, 20))
        measured = sn.measure_link(lossy, server, seconds=0, pings=0, loss_packets=5000, loss_rate_pps=5000)
        control = sn.measure_link(clean, server, seconds=0, pings=0, loss_packets=2000, loss_rate_pps=5000)
    sigma = (0.02 * 0.98 / 5000) ** 0.5
    assert abs(measured["loss_up"] - 0.02) <= 4 * sigma, measured
    assert abs(measured["loss_down"] - 0.02) <= 4 * sigma, measured
    assert control["loss_up"] == control["loss_down"] == 0, control


@pytest.mark.timeout(60)
def test_one_stream_on_l2_is_bounded_by_its_loss() -> None:
    """L2 (50 Mbit/s, 150 ms, 0.5%): one TCP stream carries a few Mbit/s, as Mathis's bound
    (1.3 Mbit/s) says for a loss-based congestion control, not the link's 50. Measured over 8 s
    (the first 2 left out): over 3 s, a stream in slow start until its first loss, it carried
    1.7-13.9 Mbit/s down, 3 of 10 runs over 8 (2026-11-29, one a failed CI run); over 8 s 1.0-1.9."""
    with sn.Testbed() as net:
        store = net.add_host("store", sn.PROFILES["store"])
        worker = net.add_host("worker", sn.PROFILES["L2"])
        measured = sn.measure_link(worker, store, seconds=8, pings=0)
    assert net.shaping["congestion_control"] == "reno"
    assert 0.3 <= measured["down_mbit"] <= 8, measured


@pytest.mark.timeout(60)
def test_the_delayer_keeps_up_at_l1() -> None:
    """L1 against the store: 100 Mbit/s down with 40 ms applied, every packet held (none missed),
    released on time on average: within 1 ms (2.5% of the delay), under 30% of packets over 1 ms
    late. The delayer runs at real-time priority, but the kernel's own packet work does not: the
    project's CI machine (2 cores) measured 0.44 ms late on average and 17.6% over 1 ms
    (2026-11-29), with the RTT's median still within 40-42 ms."""
    with sn.Testbed() as net:
        store = net.add_host("store", sn.PROFILES["store"])
        worker = net.add_host("worker", sn.Link(100, 20, rtt_ms=40))  # L1 without its loss: the link's rate, not Mathis
        measured = sn.measure_link(worker, store, seconds=3, pings=5)
        stats = net.delayer_stats()["worker"]
    assert measured["down_wire_mbit"] >= 0.9 * 100 and measured["down_mbit"] >= 0.85 * 100 * sn.PAYLOAD_PER_WIRE, measured
    assert 40 <= measured["rtt_ms"]["median"] <= 42, measured["rtt_ms"]
    assert stats["packets"] > 20000 and stats["missed"] == 0, stats
    assert abs(stats["late_ms_sum"]) / stats["packets"] <= 1 and stats["late_over_1ms"] <= 0.3 * stats["packets"], stats


@pytest.mark.timeout(60)
def test_a_partition_times_out_and_heal_restores() -> None:
    with sn.Testbed() as net:
        a, b, c = (net.add_host(name, sn.Link(100, 100, rtt_ms=2)) for name in ("a", "b", "c"))
        servers = {host.name: host.popen([sys.executable, sn.SCRIPT, "probe-serve"], stdout=subprocess.PIPE, text=True)
                   for host in (a, b, c)}
        port = {name: int(server.stdout.readline()) for name, server in servers.items()}
        assert _connect(a, b.ip, port["b"]) == "ok"

        net.partition(a, b)
        assert _connect(a, b.ip, port["b"]) == "TimeoutError"  # silent: a real time-out, not a refusal
        assert _connect(b, a.ip, port["a"]) == "TimeoutError"
        assert _connect(a, c.ip, port["c"]) == "ok"
        net.heal()
        assert _connect(a, b.ip, port["b"]) == "ok"

        net.isolate(c)
        assert _connect(a, c.ip, port["c"]) == "TimeoutError"
        assert _connect(c, b.ip, port["b"]) == "TimeoutError"
        assert _connect(a, b.ip, port["b"]) == "ok"
        net.heal()
        assert _connect(c, a.ip, port["a"]) == "ok"


@pytest.mark.timeout(60)
def test_nothing_is_left_when_the_block_ends_or_raises() -> None:
    links = _root_links()
    with pytest.raises(RuntimeError, match="inside the block"):
        with sn.Testbed() as net:
            host = net.add_host("a", sn.Link(10, 10, rtt_ms=10, loss=0.01))
            net.add_host("b", sn.Link(10, 10))
            sleeper = host.popen(["sleep", "600"])
            assert len(_leftovers(net.id)) == 3  # hub, a, b
            raise RuntimeError("inside the block")
    assert _leftovers(net.id) == []
    assert sleeper.poll() is not None
    assert _root_links() == links  # every veth was made inside the testbed's namespaces


OWNER = """
import sys, time
sys.path.insert(0, sys.argv[1])
import spreadnet
net = spreadnet.Testbed().__enter__()
a = net.add_host("a", spreadnet.Link(10, 10, rtt_ms=20, loss=0.01))
net.add_host("b", spreadnet.Link(10, 10, rtt_ms=20))
sleeper = a.popen(["sleep", "600"])
print(net.id, flush=True)
time.sleep(600)
"""


@pytest.mark.timeout(60)
@pytest.mark.parametrize("kill", [signal.SIGKILL, signal.SIGTERM], ids=["SIGKILL", "SIGTERM"])
def test_nothing_is_left_when_the_owner_is_killed(kill: signal.Signals) -> None:
    """The reaper removes the namespaces and every process in them (the owner's sleeper, the
    delayers) when the process holding the testbed dies without leaving its block."""
    links = _root_links()
    owner = subprocess.Popen([sys.executable, "-c", OWNER, str(ROOT / "benchmarks")], stdout=subprocess.PIPE, text=True)
    testbed_id = owner.stdout.readline().strip()
    owner.stdout.close()
    inside = {int(pid) for ns in _leftovers(testbed_id)
              for pid in subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True).stdout.split()}
    assert len(_leftovers(testbed_id)) == 3 and len(inside) >= 3  # the sleeper and two delayers

    os.kill(owner.pid, kill)
    owner.wait()
    deadline = time.monotonic() + 15
    while (_leftovers(testbed_id) or not all(map(_gone, inside))) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _leftovers(testbed_id) == []
    assert all(map(_gone, inside))
    assert _root_links() == links


@pytest.mark.timeout(30)
def test_cleanup_stale_removes_only_dead_owners_leftovers() -> None:
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True,
                          check=True)
    leftover = f"{sn.PREFIX}{int(dead.stdout)}x0000-hub"
    subprocess.run(["ip", "netns", "add", leftover], check=True)
    with sn.Testbed() as net:
        net.add_host("a", sn.Link(10, 10))
        removed = sn.cleanup_stale()
        assert leftover in removed
        assert not [ns for ns in removed if ns.startswith(net.id)]
        assert len(_leftovers(net.id)) == 2
    assert leftover not in sn._namespaces()


def test_profiles_are_the_issues() -> None:
    """Issue 45's link profiles, spelled once."""
    profiles = {name: (link.down_mbit, link.up_mbit, link.rtt_ms, link.jitter_ms, link.loss) for name, link in sn.PROFILES.items()}
    assert profiles == {
        "L0": (1000, 1000, 0, 0, 0), "L1": (100, 20, 40, 0, 0.001), "L2": (50, 10, 150, 0, 0.005),
        "L3": (10, 2, 300, 50, 0.01), "store": (200, 200, 0, 0, 0), "trainer": (1000, 50, 0, 0, 0),
    }
    with pytest.raises(ValueError, match="jitter"):
        sn.Link(10, 10, rtt_ms=10, jitter_ms=20)
    assert json.dumps(sn.Testbed().shaping)  # a benchmark's report can carry it
