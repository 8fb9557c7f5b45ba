"""Hosts on one machine for the multi-host Ray tests: Linux network namespaces on a private bridge. Needs root.

Each host is a network namespace with its own stack (loopback, one address, its own ports) joined by a veth to
a bridge the test creates, on a /24 of 10.0.0.0/8 that no interface or route of the machine uses. The bridge
sits in a namespace of its own (the switch), so a firewall of the machine's (Docker's FORWARD policy, with
br_netfilter) never sees the hosts' traffic to each other. One more veth joins the machine's own namespace to
the bridge with the subnet's .1: the tests' S3 server listens there, where every host reaches it (a store every
node sees). No host gets a route beyond the subnet, and the bridge has no other port: nothing sent on it leaves
the machine.

A host's disk: every process started on a host runs in a mount namespace of that host (`unshare --mount
--propagation private`) with a tmpfs of its own over the host's `disk` directory. What a process writes there
exists only for that host's processes: every other host, the driver and the test itself see an empty directory
at that path. When the host's last process dies (a node lost), its disk goes with it, as a lost machine's does.

Everything is found and stopped by what the test made: processes by `ip netns pids` (the pids in a namespace),
then the namespaces and the bridge by name; never by a process's name.
"""

from __future__ import annotations

import contextlib
import ipaddress
import os
import random
import secrets
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

DISK_BYTES = 512 * 2**20  # each host's tmpfs: its chunk checkpoints and temporary files


class NetworkError(RuntimeError):
    """The test network could not be made (not root, no `ip`, no free subnet)."""


def ip(*args: str, check: bool = True) -> str:
    result = subprocess.run(["ip", *args], capture_output=True, text=True)
    if check and result.returncode != 0:
        raise NetworkError(f"ip {' '.join(args)}: {result.stderr.strip()}")
    return result.stdout


def _free_subnet() -> ipaddress.IPv4Network:
    """A /24 of 10.200.0.0/13 that no address or route of the machine overlaps."""
    used = []
    for line in (ip("-o", "-4", "addr", "show") + ip("-4", "route", "show")).splitlines():
        for word in line.split():
            try:
                used.append(ipaddress.ip_network(word, strict=False))
            except ValueError:
                continue
    for _ in range(100):
        subnet = ipaddress.ip_network(f"10.{random.randint(200, 207)}.{random.randint(0, 255)}.0/24")
        if not any(subnet.overlaps(u) for u in used if u.prefixlen > 0):
            return subnet
    raise NetworkError("no free /24 in 10.200.0.0/13")


@dataclass
class Host:
    name: str
    netns: str
    address: str
    disk: Path  # this host's private tmpfs, at a path every host has (empty elsewhere)

    def command(self, *argv: str) -> list[str]:
        """`argv` run on this host: in its network namespace, with its private disk mounted."""
        mount = f'mount -t tmpfs -o size={DISK_BYTES:d},mode=0700 klpipe-host "$0" && exec "$@"'
        return ["ip", "netns", "exec", self.netns, "unshare", "--mount", "--propagation", "private",
                "sh", "-c", mount, str(self.disk), *argv]

    def pids(self) -> list[int]:
        """Every process in this host's network namespace."""
        return [int(p) for p in ip("netns", "pids", self.netns, check=False).split()]

    def kill(self) -> list[int]:
        """SIGKILL to every process of this host: the machine is gone (its disk with it)."""
        pids = self.pids()
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        return pids


class Network:
    """A private bridge and hosts on it, made by `add`, removed by `remove` (safe after a partial start)."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.tag = secrets.token_hex(3)  # names: interface names must fit 15 bytes
        self.switch = f"klpipe-{self.tag}-switch"  # the bridge's namespace
        self.bridge = "br0"
        self.uplink = f"kl{self.tag}gw"  # the machine's end of its veth to the bridge
        self.subnet = _free_subnet()
        self.gateway = str(self.subnet[1])  # the bridge's own address, in the machine's namespace
        self.hosts: dict[str, Host] = {}
        self._made = False

    def up(self) -> None:
        if os.geteuid() != 0:
            raise NetworkError("the multi-host tests make network namespaces, which needs root")
        ip("netns", "add", self.switch)
        self._made = True
        ip("-n", self.switch, "link", "add", self.bridge, "type", "bridge")
        ip("-n", self.switch, "link", "set", self.bridge, "up")
        ip("link", "add", self.uplink, "type", "veth", "peer", "name", "uplink", "netns", self.switch)
        ip("-n", self.switch, "link", "set", "uplink", "master", self.bridge, "up")
        ip("addr", "add", f"{self.gateway}/24", "dev", self.uplink)
        ip("link", "set", self.uplink, "up")

    def add(self, name: str) -> Host:
        netns = f"klpipe-{self.tag}-{name}"
        host = Host(name, netns, str(self.subnet[10 + len(self.hosts)]), self.root / name / "disk")
        host.disk.mkdir(parents=True)
        ip("netns", "add", netns)
        self.hosts[name] = host
        ip("-n", self.switch, "link", "add", name, "type", "veth", "peer", "name", "eth0", "netns", netns)
        ip("-n", self.switch, "link", "set", name, "master", self.bridge, "up")
        ip("-n", netns, "link", "set", "lo", "up")
        ip("-n", netns, "addr", "add", f"{host.address}/24", "dev", "eth0")
        ip("-n", netns, "link", "set", "eth0", "up")
        return host

    def processes(self) -> list[int]:
        return [pid for host in self.hosts.values() for pid in host.pids()]

    def remove(self, timeout: float = 30) -> None:
        """SIGKILL to whatever still runs on the hosts, then the namespaces (and their veths) and the bridge."""
        deadline = time.monotonic() + timeout
        while True:
            for host in self.hosts.values():
                host.kill()
            if not self.processes() or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        for host in self.hosts.values():
            ip("netns", "del", host.netns, check=False)  # takes its end of its veth, so the pair
        self.hosts.clear()
        if self._made:
            ip("netns", "del", self.switch, check=False)  # the bridge, and the uplink's pair with it
            ip("link", "del", self.uplink, check=False)  # gone already where the kernel has removed the pair
            self._made = False
