"""Finding the address and interface that ranks use to reach the driver and each other."""

from __future__ import annotations

import socket

import psutil


def interface_for(ip: str) -> str:
    """The network interface that holds ``ip`` (Gloo needs a name, not an address)."""
    for name, addrs in psutil.net_if_addrs().items():
        if any(a.family == socket.AF_INET and a.address == ip for a in addrs):
            return name
    raise RuntimeError(f"no network interface on {socket.gethostname()} holds the address {ip}")


def network_of(ip: str) -> str:
    """The subnet (CIDR) of the interface that holds ``ip``, e.g. 10.0.0.0/24."""
    import ipaddress

    for addrs in psutil.net_if_addrs().values():
        for a in addrs:
            if a.family == socket.AF_INET and a.address == ip and a.netmask:
                return str(ipaddress.ip_interface(f"{ip}/{a.netmask}").network)
    return f"{ip}/32"
