"""The network of the spread testbed (issue 45): hosts in network namespaces on one bridge, each
with its own link profile (bandwidth down and up, round-trip time with jitter, random loss),
partitions that time out for real, and cleanup that holds when the owner is killed.

Imported by benchmarks/spread.py, benchmarks/faults.py and tests/pipeline/test_spreadnet.py (the
benchmarks put benchmarks/ on sys.path); run as a script it is also its own helper processes (the
reaper, the probe) and a small command line:

    .venv/bin/python benchmarks/spreadnet.py check    # every profile against the store host, measured
    .venv/bin/python benchmarks/spreadnet.py stale    # remove what dead testbeds left behind

Needs root, iproute2, iptables, ethtool and gcc (Debian packages). `unavailable_reason()` says
what is missing. The Python side uses the standard library only, so the helpers start fast inside
a namespace. `cleanup_stale()` is not called by a testbed: a benchmark calls it first.

Layout. A testbed owns a hub namespace holding a bridge, and one namespace per host with a veth
(`eth0`, 10.77.0.k/16) whose peer sits on the bridge. Every name starts with the testbed's id
(`dnt<owner pid>x<4 hex>`), so two testbeds, or one and a leftover, never meet; addresses repeat
between testbeds but each testbed is its own isolated network. Everything the testbed makes - the
veths, the bridge, qdiscs, iptables rules, helper processes - lives inside namespaces it owns, so
killing the processes in them and deleting the namespaces removes it all; the root namespace is
never touched. Processes started with `Host.popen` run in the host's namespace (`ip netns exec`),
see only the testbed's network, and reach other hosts by `Host.ip`.

What a profile means (`Link`):
- Bandwidth: a tbf qdisc on each veth end. Egress of the bridge-side end is the host's download,
  egress of the host-side end its upload. Rates count Ethernet frames: a bulk TCP transfer at MTU
  1500 carries `PAYLOAD_PER_WIRE` (1448/1514 = 0.956) of the rate as payload. The queue holds
  100 ms at the rate (at least 64 frames), a home router's buffer.
- Round-trip time: the host's RTT to a host with RTT 0; between two hosts the RTTs add (each is a
  last mile), one way being half the sum. `jitter_ms` is the +- range of that round trip, drawn
  uniformly per packet and per direction (+- jitter/2 each way) while keeping each flow's packet
  order, as netem does when it also shapes the rate: under load the delay sits nearer the top of
  the range.
- Loss: every packet the host sends and every packet it receives is lost with probability `loss`
  (its last mile loses that fraction each way; a round trip to a lossless host loses about 2x).
  A download's data and an upload's data both see `loss`, so with a loss-based congestion control
  (the testbed sets reno on every host: `Testbed(congestion_control=)`) a single TCP stream is
  bounded as Mathis says: MSS/RTT * 1.22/sqrt(loss), about 1.3 Mbit/s at 150 ms and 0.5%.

How delay and loss are made (`Testbed.shaping` says which was used). This kernel has no netem. Both
are applied where a packet arrives, in the receiving host's INPUT chain (for `eth0` only, never
`lo`): first the partition chain, then `-m statistic --mode random` DROP rules (the receiver's own
loss, and per source host that source's loss), then per source host
`-j NFQUEUE --queue-num <source index> --queue-bypass`. The host's delayer binds the queues of the
sources whose pair delay is not zero (an unbound queue accepts at once), holds each packet for
(rtt_src + rtt_dst)/2 +- jitter from the kernel's arrival stamp, and accepts whole runs at once
with batch verdicts (metadata only, no payload copied; fail-open; a queue of 131072). Nothing is
done on OUTPUT: a DROP there is a local error to the sender (TCP gets EPERM and sends again, with
no congestion response) and TCP small queues throttle a socket whose packets are held on the
way out, so neither would behave like a lossy or long link. TSO/GSO/GRO are off on every veth,
so one drop is one MTU packet. Where the kernel has netem it is used instead: netem with rate,
delay, jitter and loss on each veth end, with the same meaning per profile.

The delayer is a small C program (spreadnet_delayer.c, plain netlink), compiled with gcc when a
testbed starts and cached by its source's hash, one process per host at real-time priority. A
pure-Python delayer of the same design (a NETLINK_NETFILTER socket) was tried first: it kept up
with L1 and with a store and four L1 hosts at 190 Mbit/s, but took about 15 times the CPU (35-75
us of user time per packet against 1-5 us; 0.9 of a core for that store and four hosts), time the
roles under test lose on a 2-core machine (measured 2026-11-28). `Testbed.delayer_stats()`
reports per host the packets held, those missed (ids never seen: the kernel accepted them
undelayed, fail-open), releases later than 1 ms, and the CPU the delayer used.
"""

from __future__ import annotations

import argparse
import hashlib
import ipaddress
import json
import os
import re
import secrets
import select
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any

PREFIX = "dnt"
SUBNET = ipaddress.ip_network("10.77.0.0/16")
PAYLOAD_PER_WIRE = 1448 / 1514  # TCP payload per Ethernet frame at MTU 1500 with timestamps
SCRIPT = os.path.abspath(__file__)
TCPI_BYTES_RECEIVED = 128  # offset of tcpi_bytes_received in linux/tcp.h's struct tcp_info
QUEUE_MAXLEN = 131072
TERMINATE_GRACE_S = 5.0


@dataclass(frozen=True)
class Link:
    """One host's last mile. Rates in Mbit/s of Ethernet frames; `rtt_ms` and `jitter_ms` against
    a host with RTT 0 (they add between two hosts); `loss` a fraction lost each way."""

    down_mbit: float
    up_mbit: float
    rtt_ms: float = 0.0
    jitter_ms: float = 0.0
    loss: float = 0.0

    def __post_init__(self) -> None:
        if self.down_mbit <= 0 or self.up_mbit <= 0:
            raise ValueError(f"{self}: rates must be > 0 Mbit/s")
        if self.rtt_ms < 0 or not 0 <= self.jitter_ms <= self.rtt_ms:
            raise ValueError(f"{self}: need rtt_ms >= 0 and 0 <= jitter_ms <= rtt_ms")
        if not 0 <= self.loss < 1:
            raise ValueError(f"{self}: loss is a fraction in [0, 1)")


# Issue 45's profiles: workers on L0-L3, the store's host and the trainer's uplink.
PROFILES: dict[str, Link] = {
    "L0": Link(1000, 1000),
    "L1": Link(100, 20, rtt_ms=40, loss=0.001),
    "L2": Link(50, 10, rtt_ms=150, loss=0.005),
    "L3": Link(10, 2, rtt_ms=300, jitter_ms=50, loss=0.01),
    "store": Link(200, 200),
    "trainer": Link(1000, 50),
}


def _sh(*argv: str, input: str | None = None) -> str:
    """Runs one setup command; its stderr is the error a user sees when it fails."""
    done = subprocess.run(argv, input=input, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} failed ({done.returncode}): {done.stderr.strip()}")
    return done.stdout


def _in_ns(ns: str, argv: list[str]) -> list[str]:
    return ["ip", "netns", "exec", ns, *argv]


def _tc_rate(mbit: float) -> str:
    return f"{mbit * 1000:.0f}kbit"


def _queue_bytes(mbit: float) -> int:
    return max(int(mbit * 1e6 / 8 * 0.1), 64 * 1514)


class Host:
    """A network host: a namespace with `eth0` at `ip`. Processes it starts are tracked, and
    ended with the testbed."""

    def __init__(self, name: str, *, ns: str, index: int, link: Link) -> None:
        self.name = name
        self.ns = ns
        self.index = index
        self.link = link
        self.ip = str(SUBNET[index])
        self.processes: list[subprocess.Popen] = []

    def popen(self, argv: list[str], **kwargs: Any) -> subprocess.Popen:
        """`subprocess.Popen` inside this host (its environment is the caller's unless `env=`)."""
        proc = subprocess.Popen(_in_ns(self.ns, argv), **kwargs)
        self.processes.append(proc)
        return proc

    def run(self, argv: list[str], **kwargs: Any) -> subprocess.CompletedProcess:
        """`subprocess.run` inside this host."""
        return subprocess.run(_in_ns(self.ns, argv), **kwargs)

    def __repr__(self) -> str:
        return f"Host({self.name!r}, {self.ip}, {self.link})"


def netem_available() -> bool:
    """Whether this kernel has the netem qdisc (probed in a throwaway namespace)."""
    ns = f"{PREFIX}{os.getpid()}x{secrets.token_hex(2)}-probe"  # cleanup_stale() knows the name
    _sh("ip", "netns", "add", ns)
    try:
        _sh("ip", "-n", ns, "link", "add", "name", "p0", "type", "veth", "peer", "name", "p1")
        probe = subprocess.run(["tc", "-n", ns, "qdisc", "add", "dev", "p0", "root", "netem", "delay", "1ms"],
                               capture_output=True)
        return probe.returncode == 0
    finally:
        _sh("ip", "netns", "del", ns)


def unavailable_reason() -> str | None:
    """Why no testbed can be built here, or None: root, the tools, and a namespace with a veth."""
    if os.geteuid() != 0:
        return "needs root (network namespaces, tc, iptables)"
    from shutil import which

    missing = [tool for tool in ("ip", "tc", "iptables", "iptables-restore", "ethtool", "gcc") if which(tool) is None]
    if missing:
        return f"needs {', '.join(missing)} (apt-get install iproute2 iptables ethtool gcc)"
    ns = f"{PREFIX}{os.getpid()}x{secrets.token_hex(2)}-probe"  # cleanup_stale() knows the name
    try:
        _sh("ip", "netns", "add", ns)
    except RuntimeError as error:
        return f"cannot make a network namespace: {error}"
    try:
        _sh("ip", "-n", ns, "link", "add", "name", "p0", "type", "veth", "peer", "name", "p1")
        _sh("ip", "netns", "exec", ns, "iptables", "-A", "INPUT", "-i", "p0", "-m", "statistic", "--mode", "random",
            "--probability", "0.5", "-j", "NFQUEUE", "--queue-num", "1", "--queue-bypass")
    except RuntimeError as error:
        return f"namespaces work but the testbed's network does not: {error}"
    finally:
        subprocess.run(["ip", "netns", "del", ns], capture_output=True)
    try:
        delayer_binary()
    except RuntimeError as error:
        return f"cannot compile the delayer (gcc, libc6-dev): {error}"
    return None


class Testbed:
    """Hosts on one bridge, each with its link profile. Use as a context manager:

        with Testbed() as net:
            store = net.add_host("store", PROFILES["store"])
            worker = net.add_host("w0", PROFILES["L2"])
            worker.popen([...])
            net.partition(worker, store); ...; net.heal()

    Everything is removed on leaving the block, on an exception, on Ctrl-C, and - by the reaper, a
    process in its own session watching a pipe from this one - when the owner is killed (SIGTERM,
    SIGKILL) or exits without leaving the block."""

    def __init__(self, *, congestion_control: str = "reno") -> None:
        """`congestion_control`: every host's TCP congestion control, set in its namespace (which
        otherwise inherits the machine's: bbr here, which ignores random loss and fills a lossy
        link with one stream). A namespace may only take one the machine lists in
        net.ipv4.tcp_allowed_congestion_control (reno always is). Reno is the loss-based rule
        Mathis's bound describes; cubic, Linux's default, behaves the same at these profiles
        (rate x RTT and loss put it in its Reno-friendly region), but is not allowed here."""
        self.id = f"{PREFIX}{os.getpid()}x{secrets.token_hex(2)}"
        self.congestion_control = congestion_control
        self.hub = f"{self.id}-hub"
        self.hosts: dict[str, Host] = {}
        self.netem = False
        self._delayer: str | None = None  # the delayer's binary, where no netem
        self._delayers: dict[str, subprocess.Popen] = {}
        self._reaper: subprocess.Popen | None = None
        self._reaper_pipe: int | None = None

    @property
    def shaping(self) -> dict[str, str]:
        """How bandwidth, delay and loss were made, for a benchmark's report."""
        if self.netem:
            return {"bandwidth": "netem rate on both veth ends", "delay": "netem delay on both veth ends",
                    "loss": "netem loss on both veth ends", "summary": "netem on each veth end",
                    "congestion_control": self.congestion_control}
        return {
            "congestion_control": self.congestion_control,
            "bandwidth": "tbf on both veth ends (egress of the bridge side = download, of the host side = upload)",
            "delay": "NFQUEUE delayer (C, kernel arrival stamps, batch verdicts) on each receiver's INPUT, per source host",
            "loss": "iptables statistic DROP on each receiver's INPUT (own loss and the source's)",
            "summary": "tbf + iptables statistic + NFQUEUE delayer (no netem in this kernel)",
        }

    def __enter__(self) -> Testbed:
        read_end, self._reaper_pipe = os.pipe()  # both ends close-on-exec: no other child holds them
        self._reaper = subprocess.Popen([sys.executable, SCRIPT, "reap", self.id], stdin=read_end,
                                        stdout=subprocess.DEVNULL, start_new_session=True)
        os.close(read_end)
        try:
            with open("/proc/sys/net/ipv4/tcp_allowed_congestion_control") as allowed:
                if self.congestion_control not in allowed.read().split():
                    raise ValueError(f"congestion control {self.congestion_control!r} is not in this machine's "
                                     "net.ipv4.tcp_allowed_congestion_control: add it there (root namespace), or use reno")
            self.netem = netem_available()
            self._delayer = None if self.netem else delayer_binary()
            _sh("ip", "netns", "add", self.hub)
            _sh("ip", "-n", self.hub, "link", "add", "br0", "type", "bridge")
            _sh("ip", "-n", self.hub, "link", "set", "br0", "up")
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def add_host(self, name: str, link: Link) -> Host:
        """A new host on the bridge with `link`; the other hosts learn its delay and loss."""
        if not re.fullmatch(r"[a-z0-9_]{1,20}", name) or name == "hub" or name in self.hosts:
            raise ValueError(f"host name {name!r}: use a new short name of [a-z0-9_] other than 'hub'")
        index = len(self.hosts) + 1
        if index >= 250:
            raise ValueError("a testbed holds at most 249 hosts")
        host = Host(name, ns=f"{self.id}-{name}", index=index, link=link)
        self.hosts[name] = host
        hub_end = f"h{index}"
        _sh("ip", "netns", "add", host.ns)
        _sh("ip", "-n", self.hub, "link", "add", "name", hub_end, "type", "veth", "peer", "name", "eth0", "netns", host.ns)
        _sh("ip", "-n", self.hub, "link", "set", hub_end, "master", "br0", "up")
        _sh("ip", "netns", "exec", self.hub, "ethtool", "-K", hub_end, "tso", "off", "gso", "off", "gro", "off")
        _sh("ip", "netns", "exec", host.ns, "ethtool", "-K", "eth0", "tso", "off", "gso", "off", "gro", "off")
        _sh("ip", "netns", "exec", host.ns, "sysctl", "-q", "-w", "net.ipv6.conf.all.disable_ipv6=1",
            f"net.ipv4.tcp_congestion_control={self.congestion_control}")
        _sh("ip", "-n", host.ns, "addr", "add", f"{host.ip}/{SUBNET.prefixlen}", "dev", "eth0")
        _sh("ip", "-n", host.ns, "link", "set", "lo", "up")
        _sh("ip", "-n", host.ns, "link", "set", "eth0", "up")
        # INPUT of the new host: partitions first; then its own loss and each source's loss and delay.
        rules = ["*filter", ":PARTITION - [0:0]", "-A INPUT -i eth0 -j PARTITION"]
        if self.netem:
            _netem(self.hub, hub_end, link.down_mbit, link)
            _netem(host.ns, "eth0", link.up_mbit, link)
            _sh("ip", "netns", "exec", host.ns, "iptables-restore", "--noflush", input="\n".join(rules + ["COMMIT", ""]))
            return host
        _tbf(self.hub, hub_end, link.down_mbit)
        _tbf(host.ns, "eth0", link.up_mbit)
        if link.loss > 0:
            rules.append(f"-A INPUT -i eth0 -m statistic --mode random --probability {link.loss} -j DROP")
        others = [other for other in self.hosts.values() if other is not host]
        for other in others:
            rules += _source_rules(other)
        _sh("ip", "netns", "exec", host.ns, "iptables-restore", "--noflush", input="\n".join(rules + ["COMMIT", ""]))
        assert self._delayer is not None
        self._delayers[name] = subprocess.Popen(_in_ns(host.ns, [self._delayer]), stdin=subprocess.PIPE,
                                                stdout=subprocess.PIPE, text=True, bufsize=1)
        for other in others:
            self._delay(host, other)
            self._delay(other, host)
            _sh("ip", "netns", "exec", other.ns, "iptables-restore", "--noflush",
                input="\n".join(["*filter", *_source_rules(host), "COMMIT", ""]))
        return host

    def _delay(self, receiver: Host, source: Host) -> None:
        """Tells the receiver's delayer how long to hold packets from `source`. Until it binds the
        queue, the rule that queues them accepts them at once (--queue-bypass)."""
        one_way_ms = (receiver.link.rtt_ms + source.link.rtt_ms) / 2
        jitter_ms = (receiver.link.jitter_ms + source.link.jitter_ms) / 2
        if one_way_ms > 0:
            self._ask(receiver.name, f"queue {source.index} {one_way_ms / 1000} {jitter_ms / 1000}")

    def _ask(self, name: str, line: str) -> str:
        """One command to a host's delayer; its one-line answer."""
        delayer = self._delayers[name]
        assert delayer.stdin is not None and delayer.stdout is not None
        delayer.stdin.write(line + "\n")
        delayer.stdin.flush()
        answer = delayer.stdout.readline().strip()
        if not answer.startswith("{"):
            raise RuntimeError(f"the delayer of {name} answered {line!r} with {answer!r}; exit code {delayer.poll()}")
        return answer

    def delayer_stats(self) -> dict[str, dict[str, float]]:
        """Per host (its delayer's counters): packets held, missed (accepted undelayed by the
        kernel), unstamped, releases over 1 ms late, wakes, queues bound, user and system CPU s."""
        return {name: json.loads(self._ask(name, "stats")) for name in self._delayers}

    def partition(self, a: Host, b: Host) -> None:
        """Packets between a and b vanish silently, both ways, until `heal()`."""
        self._drop(a, f"-s {b.ip}")
        self._drop(b, f"-s {a.ip}")

    def isolate(self, host: Host) -> None:
        """Cuts `host` off from every other host (silently) until `heal()`."""
        self._drop(host, "")
        for other in self.hosts.values():
            if other is not host:
                self._drop(other, f"-s {host.ip}")

    def heal(self) -> None:
        """Ends every partition and isolation."""
        for host in self.hosts.values():
            _sh("ip", "netns", "exec", host.ns, "iptables", "-F", "PARTITION")

    def _drop(self, host: Host, match: str) -> None:
        _sh("ip", "netns", "exec", host.ns, "iptables", "-A", "PARTITION", *match.split(), "-j", "DROP")

    def close(self) -> None:
        """Ends every process the testbed started (SIGTERM, then SIGKILL after a grace period),
        deletes its namespaces and lets the reaper go. Safe to call twice."""
        procs = [p for host in self.hosts.values() for p in host.processes] + list(self._delayers.values())
        running = [p for p in procs if p.poll() is None]
        for proc in running:
            proc.terminate()
        deadline = time.monotonic() + TERMINATE_GRACE_S
        for proc in running:
            try:
                proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        for proc in procs:
            for pipe in (proc.stdin, proc.stdout, proc.stderr):
                if pipe is not None:
                    pipe.close()
        remove_testbed(self.id)
        if self._reaper_pipe is not None:
            os.close(self._reaper_pipe)
            self._reaper_pipe = None
        if self._reaper is not None:
            self._reaper.wait()
            self._reaper = None


def _tbf(ns: str, dev: str, mbit: float) -> None:
    # Burst: 4 ms at the rate, at least 4 frames; hrtimers make a smaller one accurate too.
    burst = max(4 * 1514, int(mbit * 1e6 / 8 * 0.004))
    _sh("tc", "-n", ns, "qdisc", "replace", "dev", dev, "root", "tbf", "rate", _tc_rate(mbit),
        "burst", str(burst), "limit", str(_queue_bytes(mbit)))


def _netem(ns: str, dev: str, mbit: float, link: Link) -> None:
    argv = ["tc", "-n", ns, "qdisc", "replace", "dev", dev, "root", "netem", "rate", _tc_rate(mbit),
            "limit", str(_queue_bytes(mbit) // 1514)]  # netem's limit counts packets
    if link.rtt_ms > 0:
        argv += ["delay", f"{link.rtt_ms / 2}ms", f"{link.jitter_ms / 2}ms"]
    if link.loss > 0:
        argv += ["loss", f"{link.loss * 100}%"]
    _sh(*argv)


def _source_rules(source: Host) -> list[str]:
    """A receiver's INPUT rules for packets from `source`: the source's loss, then its queue. The
    receiver's delayer binds the queue only where the pair's delay is not zero; an unbound queue
    accepts at once (--queue-bypass)."""
    rules = []
    if source.link.loss > 0:
        rules.append(f"-A INPUT -i eth0 -s {source.ip} -m statistic --mode random --probability {source.link.loss} -j DROP")
    rules.append(f"-A INPUT -i eth0 -s {source.ip} -j NFQUEUE --queue-num {source.index} --queue-bypass")
    return rules


# --- removal ------------------------------------------------------------------------------------


def _namespaces() -> list[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def remove_testbed(testbed_id: str) -> list[str]:
    """Kills every process in the testbed's namespaces and deletes them (and with them its veths,
    bridge, qdiscs and rules). Returns the namespaces deleted."""
    names = [ns for ns in _namespaces() if ns.startswith(f"{testbed_id}-")]
    pids: set[int] = set()
    for ns in names:
        out = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True).stdout
        pids |= {int(pid) for pid in out.split()}
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + 5
    while pids and time.monotonic() < deadline:  # a namespace outlives its deletion while a process is in it
        pids = {pid for pid in pids if os.path.exists(f"/proc/{pid}/ns/net")}
        time.sleep(0.02)
    # The hub last: deleting a host first removes its veth pair from the bridge.
    for ns in sorted(names, key=lambda name: name.endswith("-hub")):
        subprocess.run(["ip", "netns", "del", ns], capture_output=True)
    return names


def cleanup_stale() -> list[str]:
    """Removes the namespaces (and processes in them) of testbeds whose owner process is gone.
    Returns the namespaces deleted."""
    removed: list[str] = []
    owners = {}
    for ns in _namespaces():
        if match := re.match(rf"({PREFIX}(\d+)x[0-9a-f]{{4}})-", ns):
            owners[match[1]] = int(match[2])
    for testbed_id, pid in owners.items():
        if not os.path.exists(f"/proc/{pid}"):
            removed += remove_testbed(testbed_id)
    return removed


# --- measurement --------------------------------------------------------------------------------


def measure_link(host: Host, peer: Host, *, seconds: float = 2.0, pings: int = 20, loss_packets: int = 0,
                 loss_rate_pps: float = 1000) -> dict[str, Any]:
    """`host`'s link to `peer`, measured with real traffic: the RTT of `pings` one-byte TCP echoes
    (`rtt_ms`); TCP goodput peer->host (`down_mbit`) and host->peer (`up_mbit`), one stream each
    for `seconds` (the first quarter left out as warm-up), beside the frames the receiver's eth0
    took in meanwhile (`down_wire_mbit`, `up_wire_mbit`: the shaper's rate, whatever TCP did); and
    the fraction of `loss_packets` UDP datagrams (sent at `loss_rate_pps`) lost each way
    (`loss_up`, `loss_down`). A zero leaves that part out. Goodput over a short window can read
    above the link's rate where a loss was being repaired as it opened (in-order bytes count when
    the hole is filled); the wire rate cannot."""
    server = peer.popen([sys.executable, SCRIPT, "probe-serve"], stdout=subprocess.PIPE, text=True)
    try:
        assert server.stdout is not None
        port = server.stdout.readline().strip()
        done = host.run([sys.executable, SCRIPT, "probe", peer.ip, port, host.ip, "--seconds", str(seconds),
                         "--pings", str(pings), "--loss-packets", str(loss_packets), "--loss-rate", str(loss_rate_pps)],
                        capture_output=True, text=True, timeout=4 * seconds + pings + loss_packets / loss_rate_pps * 2 + 60)
        if done.returncode != 0:
            raise RuntimeError(f"probe from {host.name} to {peer.name} failed: {done.stderr.strip()[-2000:]}")
        return json.loads(done.stdout)
    finally:
        server.terminate()
        server.wait()
        server.stdout.close()


def _received(sock: socket.socket) -> tuple[float, int, int]:
    """(now, payload bytes the kernel has received in order, bytes eth0 has received): kernel
    counts, so a receiver that the CPUs' load holds back does not measure its backlog as rate."""
    info = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 256)
    with open("/sys/class/net/eth0/statistics/rx_bytes") as rx:  # `ip netns exec` mounts the host's /sys
        return time.monotonic(), struct.unpack_from("=Q", info, TCPI_BYTES_RECEIVED)[0], int(rx.read())


def _receive_rate(sock: socket.socket, seconds: float) -> dict[str, float]:
    """Over [first byte + seconds/4, first byte + seconds], in Mbit/s: `goodput` (TCP payload in
    order) and `wire` (every frame eth0 received: what the link's shaper let through)."""
    buf = bytearray(1 << 16)
    sock.settimeout(seconds + 10)
    if not sock.recv_into(buf):
        raise RuntimeError("the sender closed before sending")
    first = time.monotonic()
    start = None
    while (now := time.monotonic()) < first + seconds:
        if start is None and now >= first + seconds / 4:
            start = _received(sock)
        if not sock.recv_into(buf):
            raise RuntimeError("the sender closed while measuring")
    end = _received(sock)
    if start is None:
        raise RuntimeError("too little data to measure a rate")
    elapsed = end[0] - start[0]
    return {"goodput": (end[1] - start[1]) * 8 / elapsed / 1e6, "wire": (end[2] - start[2]) * 8 / elapsed / 1e6}


def _send_udp(target: tuple[str, int], packets: int, rate_pps: float) -> None:
    """Paced in bursts of 10 ms so that no tbf queue overflows (that would count as loss)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    start = time.monotonic()
    for seq in range(packets):
        due = start + seq / rate_pps
        if (wait := due - time.monotonic()) > 0.01:
            time.sleep(wait)
        sock.sendto(seq.to_bytes(4, "big") + bytes(28), target)
    sock.close()


def _read_line(sock: socket.socket) -> str:
    """One line, read byte by byte: what follows it on the socket stays there for the caller."""
    line = b""
    while not line.endswith(b"\n"):
        byte = sock.recv(1)
        if not byte:
            raise RuntimeError(f"the connection closed after {line!r}")
        line += byte
    return line.decode()


def _probe_serve() -> None:
    """The far end of `measure_link`: TCP commands on one port, UDP datagrams counted on the same."""
    listener = socket.create_server(("0.0.0.0", 0))
    port = listener.getsockname()[1]
    udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    udp.bind(("0.0.0.0", port))
    udp_seen: set[int] = set()

    def count_udp() -> None:
        while True:
            udp_seen.add(int.from_bytes(udp.recv(64)[:4], "big"))

    def serve(conn: socket.socket) -> None:
        with conn:
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            words = _read_line(conn).split()
            if words[0] == "echo":
                while data := conn.recv(64):
                    conn.sendall(data)
            elif words[0] == "source":
                chunk = bytes(1 << 16)
                try:
                    while True:
                        conn.sendall(chunk)
                except OSError:
                    pass
            elif words[0] == "sink":
                conn.sendall(json.dumps(_receive_rate(conn, float(words[1]))).encode() + b"\n")
                while conn.recv(1 << 16):
                    pass
            elif words[0] == "udp-count":
                conn.sendall(f"{len(udp_seen)}\n".encode())
                udp_seen.clear()
            elif words[0] == "udp-send":
                _send_udp((words[3], int(words[4])), int(words[1]), float(words[2]))
                conn.sendall(b"sent\n")

    threading.Thread(target=count_udp, daemon=True).start()
    print(port, flush=True)
    while True:
        conn, _ = listener.accept()
        threading.Thread(target=serve, args=(conn,), daemon=True).start()


def _probe(peer: str, port: int, own_ip: str, seconds: float, pings: int, loss_packets: int, loss_rate: float) -> dict[str, Any]:
    def command(line: str) -> socket.socket:
        sock = socket.create_connection((peer, port), timeout=30)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.sendall(line.encode() + b"\n")
        return sock

    result: dict[str, Any] = {}
    if pings:
        with command("echo") as sock:
            rtts = []
            for _ in range(pings + 1):
                sent = time.perf_counter()
                sock.sendall(b"x")
                if sock.recv(1) != b"x":
                    raise RuntimeError("the echo closed")
                rtts.append((time.perf_counter() - sent) * 1000)
                time.sleep(0.01)
            rtts = sorted(rtts[1:])  # the first may include the server thread starting
            result["rtt_ms"] = {"min": rtts[0], "median": rtts[len(rtts) // 2], "max": rtts[-1], "samples": rtts}
    if seconds:
        with command("source") as sock:
            down = _receive_rate(sock, seconds)
            result["down_mbit"], result["down_wire_mbit"] = down["goodput"], down["wire"]
        with command(f"sink {seconds}") as sock:
            chunk = bytes(1 << 16)
            sock.setblocking(False)
            answer = b""
            while not answer.endswith(b"\n"):
                readable, writable, _ = select.select([sock], [sock], [], seconds + 10)
                if readable:
                    answer += sock.recv(4096)
                elif writable:
                    try:
                        sock.send(chunk)
                    except BlockingIOError:
                        pass
                else:
                    raise RuntimeError("no answer from the sink")
            up = json.loads(answer)
            result["up_mbit"], result["up_wire_mbit"] = up["goodput"], up["wire"]
    if loss_packets:
        settle = 1.0  # longer than any hold: two L3 hosts are 300 ms + 50 ms apart
        _send_udp((peer, port), loss_packets, loss_rate)
        time.sleep(settle)
        with command("udp-count") as sock:
            result["loss_up"] = 1 - int(_read_line(sock)) / loss_packets
        udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        udp.bind((own_ip, 0))
        seen: set[int] = set()
        udp.settimeout(settle)
        with command(f"udp-send {loss_packets} {loss_rate} {own_ip} {udp.getsockname()[1]}"):
            try:
                while True:
                    seen.add(int.from_bytes(udp.recv(64)[:4], "big"))
            except TimeoutError:
                pass
        result["loss_down"] = 1 - len(seen) / loss_packets
        result["loss_packets"] = loss_packets
    return result


# --- the delayer --------------------------------------------------------------------------------


def delayer_binary() -> str:
    """spreadnet_delayer.c compiled (gcc, linux headers only), cached by its source's hash."""
    source = os.path.join(os.path.dirname(SCRIPT), "spreadnet_delayer.c")
    with open(source, "rb") as file:
        digest = hashlib.sha256(file.read()).hexdigest()[:16]
    cache = os.path.expanduser("~/.cache/decentrl")
    binary = os.path.join(cache, f"spreadnet-delayer-{digest}")
    if not os.path.exists(binary):
        os.makedirs(cache, exist_ok=True)
        _sh("gcc", "-O2", "-Wall", "-o", f"{binary}.{os.getpid()}", source)
        os.replace(f"{binary}.{os.getpid()}", binary)
    return binary


def _reap(testbed_id: str) -> None:
    """Waits for EOF on stdin (the owner closed its end or died), then removes the testbed."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    sys.stdin.buffer.read()
    remove_testbed(testbed_id)


def _check() -> None:
    """Each profile against the store host: measured bandwidth, RTT and loss beside the profile."""
    with Testbed() as net:
        store = net.add_host("store", PROFILES["store"])
        hosts = {name: net.add_host(name.lower(), PROFILES[name]) for name in ("L0", "L1", "L2", "L3")}
        print(json.dumps({"shaping": net.shaping}), flush=True)
        for name, host in hosts.items():
            measured = measure_link(host, store, seconds=6 if name in ("L2", "L3") else 3, loss_packets=3000)
            measured["rtt_ms"].pop("samples")
            print(json.dumps({"profile": name, "link": vars(PROFILES[name]), **measured}), flush=True)
        print(json.dumps({"delayers": net.delayer_stats()}), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("check", help="build a testbed and measure every profile against the store host")
    sub.add_parser("stale", help="remove the namespaces and processes of testbeds whose owner is gone")
    sub.add_parser("reap", help="(internal) a testbed's reaper").add_argument("testbed_id")
    sub.add_parser("probe-serve", help="(internal) the far end of measure_link")
    probe = sub.add_parser("probe", help="(internal) the near end of measure_link")
    probe.add_argument("peer")
    probe.add_argument("port", type=int)
    probe.add_argument("own_ip")
    probe.add_argument("--seconds", type=float, default=2.0)
    probe.add_argument("--pings", type=int, default=20)
    probe.add_argument("--loss-packets", type=int, default=0)
    probe.add_argument("--loss-rate", type=float, default=1000)
    args = parser.parse_args()
    if args.command == "check":
        _check()
    elif args.command == "stale":
        print(json.dumps({"removed": cleanup_stale()}))
    elif args.command == "reap":
        _reap(args.testbed_id)
    elif args.command == "probe-serve":
        _probe_serve()
    elif args.command == "probe":
        print(json.dumps(_probe(args.peer, args.port, args.own_ip, args.seconds, args.pings, args.loss_packets,
                                args.loss_rate)))


if __name__ == "__main__":
    main()
