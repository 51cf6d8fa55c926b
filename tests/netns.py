"""Simulated hosts: network namespaces joined to this one by a bridge.

    root namespace:    bridge hvb<pid> 10.77.N.1/24 (the driver and the Spark master)
    hvdmagic-<pid>-h1: veth  10.77.N.2/24          (a Spark worker)
    hvdmagic-<pid>-h2: veth  10.77.N.3/24          (a Spark worker)
    ...                                             (up to 200 hosts)

With ``rate`` (tc's units: "1gbit", "200mbit"), every link is capped as a cluster's
are: the driver's uplink (the bridge's own egress, what the kernel sends), and each
host's downlink and uplink (its veth pair's two egresses), each with a token bucket.
Link time then dominates, as it does between real machines, not memory copies.

Names are this process's own (from its pid), and the subnet one no interface here uses yet
(N picked when the network is made), so two runs on one machine (``make test`` beside
``make test-latest``, a benchmark beside the tests) neither tear down nor shadow each other's.

Each namespace has only its loopback and its veth, so a rank there can reach the
others only over 10.77.0.0/24, and never through ``lo``. Everything is created
by the test and removed afterwards; it needs root (CAP_NET_ADMIN).
"""

from __future__ import annotations

import os
import subprocess

# Interface names have at most 15 characters: a pid has at most 7 digits.
_OWN = os.getpid()
BRIDGE = f"hvb{_OWN}"


def _free_subnet() -> str:
    """10.77.N, for an N that no address here is in: two bridges on one subnet would make the
    root namespace route one's traffic into the other."""
    used = _ip("-o", "-4", "addr", "show").stdout
    for n in [(_OWN + i) % 250 + 1 for i in range(250)]:
        if f" 10.77.{n}." not in used:
            return f"10.77.{n}"
    raise RuntimeError("every 10.77.N.0/24 subnet is in use here")


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check)


def inside_interface(host: int) -> str:
    """The name of the veth that host ``host`` (0, 1, ...) has inside its namespace."""
    return f"hv{_OWN}v{host}i"


def available() -> str | None:
    """None when namespaces can be made here, else why not."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    probe = f"hvdmagic-{_OWN}-probe"
    result = _ip("netns", "add", probe, check=False)
    if result.returncode != 0:
        return f"'ip netns add' failed: {result.stderr.strip()}"
    _ip("netns", "del", probe, check=False)
    return None


def _tc(rate: str, device: str, namespace: str | None = None) -> None:
    """A token bucket of ``rate`` on ``device``'s egress. The burst holds several 64 KB
    segments (a veth passes GSO segments whole) and more than a tick of the rate, as tbf
    needs at high rates."""
    where = ["-n", namespace] if namespace else []
    subprocess.run(["tc", *where, "qdisc", "replace", "dev", device, "root", "tbf", "rate", rate,
                    "burst", "1mb", "latency", "50ms"], capture_output=True, text=True, check=True)


class Hosts:
    """``rates``: a host's own cap on both its links, by its index, where it differs from ``rate``
    (a host on a busy rack)."""

    def __init__(self, hosts: int = 2, rate: str | None = None, rates: dict[int, str] | None = None):
        if not 1 <= hosts <= 200:
            raise ValueError(f"1 to 200 simulated hosts, not {hosts}")
        self._count = hosts
        self.rate = rate
        self.rates = rates or {}
        self.driver = ""
        self.hosts: list[tuple[str, str]] = []  # (address, namespace), once entered

    def __enter__(self) -> Hosts:
        subnet = _free_subnet()
        self.driver = f"{subnet}.1"
        self.hosts = [(f"{subnet}.{i + 2}", f"hvdmagic-{_OWN}-h{i + 1}") for i in range(self._count)]
        try:
            _ip("link", "add", BRIDGE, "type", "bridge")
            _ip("addr", "add", f"{self.driver}/24", "dev", BRIDGE)
            _ip("link", "set", BRIDGE, "up")
            if self.rate:
                _tc(self.rate, BRIDGE)
            for i, (address, ns) in enumerate(self.hosts):
                outside, inside = f"hv{_OWN}v{i}o", inside_interface(i)
                _ip("netns", "add", ns)
                _ip("link", "add", outside, "type", "veth", "peer", "name", inside)
                _ip("link", "set", outside, "master", BRIDGE)
                _ip("link", "set", outside, "up")
                _ip("link", "set", inside, "netns", ns)
                _ip("-n", ns, "addr", "add", f"{address}/24", "dev", inside)
                _ip("-n", ns, "link", "set", inside, "up")
                _ip("-n", ns, "link", "set", "lo", "up")
                if rate := self.rates.get(i, self.rate):
                    _tc(rate, outside)  # into the host
                    _tc(rate, inside, ns)  # out of the host
        except subprocess.CalledProcessError as exc:
            self.__exit__(None, None, None)
            raise RuntimeError(f"could not build the test network: {' '.join(exc.cmd)}: {exc.stderr.strip()}") from None
        return self

    def slow_down(self, host: int, rate: str) -> None:
        """Cap what reaches host ``host`` (0, 1, ...) at ``rate`` from now on: a download held open."""
        _tc(rate, f"hv{_OWN}v{host}o")

    def __exit__(self, *exc) -> None:
        for i, (_, ns) in enumerate(self.hosts):
            _ip("netns", "del", ns, check=False)  # takes the inside veth, and with it the pair
            _ip("link", "del", f"hv{_OWN}v{i}o", check=False)
        _ip("link", "del", BRIDGE, check=False)
