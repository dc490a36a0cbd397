"""Separate hosts on one machine, for the tests: each host a Linux network namespace with one
address, all joined by veth pairs to a bridge that lives in a namespace of its own. The root
namespace (the test process: the driver) joins the bridge too, by one veth pair whose root end
gets the subnet's `.1`. Every namespace and link is the test's own: nothing in the root
namespace but that one veth end, which goes when the bridge's namespace is deleted.

A host is cut off the network by setting its veth's bridge end down (a pulled cable): no RST,
no FIN, its processes keep running; peers learn of it only through their own timeouts.

Needs root (CAP_NET_ADMIN and CAP_SYS_ADMIN) and iproute2; `unavailable()` says why not.
"""

from __future__ import annotations

import contextlib
import ipaddress
import os
import shutil
import signal
import subprocess
import uuid
from pathlib import Path

PREFIX = "ftn"  # every namespace and root-side link this module creates starts with it
IFNAME = "eth0"  # a host's interface inside its namespace (GLOO_SOCKET_IFNAME for gloo)


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    done = subprocess.run(["ip", *args], capture_output=True, text=True)
    if check and done.returncode != 0:
        raise RuntimeError(f"`ip {' '.join(args)}` failed: {done.stderr.strip()}")
    return done


def unavailable() -> str | None:
    """Why namespaces cannot be made here, or None: tried, not guessed from the uid."""
    if shutil.which("ip") is None:
        return "iproute2's `ip` is not installed (apt-get install iproute2)"
    probe = f"{PREFIX}probe{os.getpid()}"
    done = _ip("netns", "add", probe, check=False)
    if done.returncode != 0:
        return (
            f"cannot create a network namespace (`ip netns add`: {done.stderr.strip()}); "
            "this test needs root, or CAP_NET_ADMIN and CAP_SYS_ADMIN"
        )
    try:
        _ip("link", "add", probe[:15], "type", "veth", "peer", "name", "p", "netns", probe)
    except RuntimeError as e:
        return f"cannot create a veth pair ({e}): needs CAP_NET_ADMIN"
    finally:
        _ip("netns", "del", probe, check=False)  # and the veth pair with it
    return None


def _free_subnet() -> ipaddress.IPv4Network:
    """A private /24 that no address or route of this machine's root namespace overlaps (other
    runs of this test included: their root ends are routes here)."""
    taken = []
    for line in (
        _ip("-4", "-o", "addr").stdout.splitlines() + _ip("-4", "route").stdout.splitlines()
    ):
        for word in line.split():
            with contextlib.suppress(ValueError):
                if "/" in word or word[0].isdigit():
                    taken.append(ipaddress.ip_network(word, strict=False))
    for third in range(137, 256):
        net = ipaddress.IPv4Network(f"10.213.{third}.0/24")
        if not any(net.overlaps(t) for t in taken):
            return net
    raise RuntimeError("no free /24 under 10.213.0.0/16 for the test's hosts")


def _sweep_stale() -> None:
    """Namespaces left by a run of this module whose process is gone (one killed before its
    cleanup ran): each name carries the creating pid."""
    for line in _ip("netns", "list").stdout.splitlines():
        name = line.split()[0] if line.split() else ""
        if not name.startswith(PREFIX) or "-" not in name:
            continue
        pid = name[len(PREFIX) :].split("-", 1)[0].split("x", 1)[0]
        if pid.isdigit() and not Path(f"/proc/{pid}").exists():
            _ip("netns", "del", name, check=False)


class Host:
    """One namespace with one address on the subnet; starts processes inside it."""

    def __init__(self, network: Network, name: str, address: str):
        self.network, self.name, self.address = network, name, address
        self.netns = f"{network.tag}-{name}"
        self.link = f"v-{name}"[:15]  # its veth's bridge end, in the bridge's namespace

    def start(self, label: str, argv: list[str], env: dict[str, str], cwd: str) -> subprocess.Popen:
        """`argv` in this host's namespace, in its own process group, output to `label`.log."""
        log = open(self.network.log_dir / f"{label}.log", "w")
        proc = subprocess.Popen(
            ["ip", "netns", "exec", self.netns, *argv],
            env=env,
            cwd=cwd,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        log.close()
        self.network.procs[label] = proc
        return proc

    def cut(self) -> None:
        """Off the network: its veth's bridge end goes down."""
        _ip("-n", self.network.bridge_ns, "link", "set", self.link, "down")


class Network:
    """The bridge, the root namespace's link to it, and the hosts; `close()` removes them all
    and kills every process started in them, whatever state the test left them in."""

    def __init__(self, log_dir: Path):
        _sweep_stale()
        self.tag = f"{PREFIX}{os.getpid()}x{uuid.uuid4().hex[:4]}"
        self.bridge_ns = f"{self.tag}-br"
        self.root_link = f"{PREFIX}{uuid.uuid4().hex[:8]}"  # 11 characters: under IFNAMSIZ
        self.log_dir = log_dir
        self.procs: dict[str, subprocess.Popen] = {}
        self.hosts: dict[str, Host] = {}
        self.subnet = _free_subnet()
        self._addresses = iter(self.subnet.hosts())
        try:
            self._bridge()
        except BaseException:
            self.close()
            raise

    def _bridge(self) -> None:
        ns = self.bridge_ns
        _ip("netns", "add", ns)
        _ip("-n", ns, "link", "add", "br0", "type", "bridge")
        _ip("-n", ns, "link", "set", "br0", "up")
        _ip("link", "add", self.root_link, "type", "veth", "peer", "name", "root", "netns", ns)
        _ip("-n", ns, "link", "set", "root", "master", "br0", "up")
        root_address = next(self._addresses)
        _ip("addr", "add", f"{root_address}/{self.subnet.prefixlen}", "dev", self.root_link)
        _ip("link", "set", self.root_link, "up")
        self.root_address = str(root_address)

    def add_host(self, name: str) -> Host:
        host = Host(self, name, str(next(self._addresses)))
        self.hosts[name] = host  # before it exists: close() removes what was made of it
        _ip("netns", "add", host.netns)
        _ip("-n", host.netns, "link", "set", "lo", "up")
        _ip(
            "-n", self.bridge_ns, "link", "add", host.link, "type", "veth",
            "peer", "name", IFNAME, "netns", host.netns,
        )  # fmt: skip
        _ip("-n", self.bridge_ns, "link", "set", host.link, "master", "br0", "up")
        _ip(
            "-n",
            host.netns,
            "addr",
            "add",
            f"{host.address}/{self.subnet.prefixlen}",
            "dev",
            IFNAME,
        )
        _ip("-n", host.netns, "link", "set", IFNAME, "up")
        return host

    def close(self) -> None:
        for proc in self.procs.values():
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
        for proc in self.procs.values():
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=10)
        # Deleting a namespace deletes the veth ends in it, and with them their peers.
        for host in self.hosts.values():
            _ip("netns", "del", host.netns, check=False)
        _ip("netns", "del", self.bridge_ns, check=False)
        _ip("link", "del", self.root_link, check=False)
