"""A second (and third) "host" on one machine, for the cross-host tests (root only).

`Host` is a process that holds its own network namespace and its own mount namespace, with a fresh
tmpfs on /dev/shm: what runs in it (`Host.popen`, through nsenter) sees neither this machine's
shared memory nor its network, only its own loopback and the links made to it. `link(a, b)` joins
two hosts with a veth pair and gives each end an address on a private /30 that exists only inside
these namespaces (no address or route is added to the machine's own network namespace). Killing the
holder process tears the namespaces, and with them the veth pair, down.
"""

from __future__ import annotations

import functools
import itertools
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
_HOLD = "mount -t tmpfs -o size=256m tmpfs /dev/shm && ip link set lo up && echo ready && exec sleep infinity"
_links = itertools.count()


@functools.cache
def available() -> bool:
    """Whether this machine lets us make namespaces (root, unshare, nsenter, ip)."""
    try:
        r = subprocess.run(["unshare", "--net", "--mount", "sh", "-c", "ip link set lo up"], capture_output=True)
    except FileNotFoundError:
        return False
    return r.returncode == 0


class Host:
    def __init__(self, name: str):
        self.name = name
        self.holder = subprocess.Popen(
            ["unshare", "--net", "--mount", "sh", "-c", _HOLD], stdout=subprocess.PIPE, text=True
        )
        line = self.holder.stdout.readline()
        if line.strip() != "ready":
            self.holder.kill()
            raise RuntimeError(f"host {name}: namespaces not created ({line!r})")
        self.pid = self.holder.pid
        self.address = ""

    def cmd(self, argv: list[str]) -> list[str]:
        return ["nsenter", "-t", str(self.pid), "-n", "-m", "--", *argv]

    def popen(self, argv: list[str], **kw) -> subprocess.Popen:
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p))
        return subprocess.Popen(self.cmd(argv), env=kw.pop("env", env), **kw)

    def run(self, argv: list[str], **kw) -> subprocess.CompletedProcess:
        return subprocess.run(self.cmd(argv), capture_output=True, text=True, check=True, **kw)

    def python(self, *args: str, **kw) -> subprocess.Popen:
        return self.popen([sys.executable, *args], **kw)

    def close(self) -> None:
        self.holder.kill()
        self.holder.wait()


def link(a: Host, b: Host) -> tuple[str, str]:
    """A veth pair between two hosts, up, with addresses 10.213.<k>.1 (a) and .2 (b)."""
    k = next(_links) % 250
    ea, eb = f"vb{os.getpid() % 10000}a{k}", f"vb{os.getpid() % 10000}b{k}"
    a.run(["ip", "link", "add", ea, "type", "veth", "peer", "name", eb, "netns", str(b.pid)])
    a.address, b.address = f"10.213.{k}.1", f"10.213.{k}.2"
    a.run(["ip", "addr", "add", f"{a.address}/30", "dev", ea])
    b.run(["ip", "addr", "add", f"{b.address}/30", "dev", eb])
    a.run(["ip", "link", "set", ea, "up"])
    b.run(["ip", "link", "set", eb, "up"])
    a.link_dev, b.link_dev = ea, eb
    return a.address, b.address


def set_link(host: Host, up: bool) -> None:
    host.run(["ip", "link", "set", host.link_dev, "up" if up else "down"])
