"""Hosts for tests: Linux network namespaces joined by veth pairs, made by the test and always
removed after (with every process left in them).

The first host is the hub: one veth pair joins it to the test's own namespace, and one more to
each other host, each pair on a /24 of its own under ``10.<octet>.0.0/16``, an octet no route of
this machine uses.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
from dataclasses import dataclass
from pathlib import Path


def unavailable() -> str | None:
    """Why network-namespace tests cannot run here (None: they can)."""
    if os.geteuid() != 0:
        return "network-namespace tests need root (ip netns, veth pairs); CI runs them as root"
    if shutil.which("ip") is None:
        return "network-namespace tests need iproute2's `ip`"
    return None


def _ip(*args: str) -> str:
    return subprocess.run(["ip", *args], check=True, capture_output=True, text=True).stdout


def _free_octet() -> int:
    used = _ip("-4", "route") + _ip("-4", "addr")
    for octet in range(231, 255):
        if f"10.{octet}." not in used:
            return octet
    raise RuntimeError("no free 10.x.0.0/16 range for test hosts")


@dataclass
class Host:
    name: str  # the namespace
    address: str  # where the hub reaches it (the hub's own: where the test reaches it)
    hub_side: str  # the hub's end of the veth pair to it ("" for the hub)

    def popen(self, command: list[str], env: dict[str, str], log: Path) -> subprocess.Popen[bytes]:
        out = open(log, "ab")
        return subprocess.Popen(["ip", "netns", "exec", self.name, *command], env=env, stdout=out, stderr=out)

    def pids(self) -> list[int]:
        out = subprocess.run(["ip", "netns", "pids", self.name], capture_output=True, text=True).stdout
        return [int(p) for p in out.split()]


class Hosts:
    """A hub host and ``others``, see the module docstring. Use as a context manager."""

    def __init__(self, others: int) -> None:
        self.tag = f"tl{os.getpid() % 100000}"
        self.octet = _free_octet()
        self.hub = Host(f"{self.tag}h", f"10.{self.octet}.0.2", "")
        self.others = [Host(f"{self.tag}w{i}", f"10.{self.octet}.{i + 1}.2", f"{self.tag}h{i}") for i in range(others)]
        self.links: list[str] = []  # veth ends in the test's namespace

    def __enter__(self) -> Hosts:
        try:
            self._make()
        except BaseException:
            self.remove()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()

    def _make(self) -> None:
        net = f"10.{self.octet}"
        for host in (self.hub, *self.others):
            _ip("netns", "add", host.name)
            _ip("-n", host.name, "link", "set", "lo", "up")
        # the test's namespace <-> hub
        outside, inside = f"{self.tag}t", f"{self.tag}ht"
        _ip("link", "add", outside, "type", "veth", "peer", "name", inside, "netns", self.hub.name)
        self.links.append(outside)
        _ip("addr", "add", f"{net}.0.1/24", "dev", outside)
        _ip("link", "set", outside, "up")
        _ip("-n", self.hub.name, "addr", "add", f"{self.hub.address}/24", "dev", inside)
        _ip("-n", self.hub.name, "link", "set", inside, "up")
        # hub <-> each other host
        for i, host in enumerate(self.others):
            far = f"{self.tag}x{i}"
            _ip("-n", self.hub.name, "link", "add", host.hub_side, "type", "veth", "peer", "name", far,
                "netns", host.name)
            _ip("-n", self.hub.name, "addr", "add", f"{net}.{i + 1}.1/24", "dev", host.hub_side)
            _ip("-n", self.hub.name, "link", "set", host.hub_side, "up")
            _ip("-n", host.name, "addr", "add", f"{host.address}/24", "dev", far)
            _ip("-n", host.name, "link", "set", far, "up")

    def hub_address_for(self, host: Host) -> str:
        """The hub's address on ``host``'s link."""
        return host.address.rsplit(".", 1)[0] + ".1"

    def cut(self, host: Host) -> None:
        """Pull the cable: ``host`` vanishes from the hub without closing anything."""
        _ip("-n", self.hub.name, "link", "set", host.hub_side, "down")

    def mend(self, host: Host) -> None:
        _ip("-n", self.hub.name, "link", "set", host.hub_side, "up")

    def kill(self, host: Host) -> None:
        """Every process in ``host`` dies at once (a power cut)."""
        for pid in host.pids():
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def remove(self) -> None:
        for host in (*self.others, self.hub):
            self.kill(host)
            subprocess.run(["ip", "netns", "del", host.name], capture_output=True)
        for link in self.links:
            subprocess.run(["ip", "link", "del", link], capture_output=True)
