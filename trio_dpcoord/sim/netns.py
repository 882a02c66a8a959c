"""Several hosts on one machine: Linux network namespaces joined by a private bridge.

:func:`network_lab` builds a head namespace holding a bridge and ``nodes`` node
namespaces, each joined to the bridge by a veth pair, with addresses it assigns itself
(``10.231.0.1`` for the head, ``10.231.0.2`` ... for the nodes; the namespaces are
private, so they clash with nothing on the host). A node is partitioned by taking its
link down at the bridge, so that nothing, not even a TCP reset, crosses until it is
healed: to its peers it goes silent, as behind a broken switch. Everything is torn down
when the block ends, however it ends: every process left in the namespaces is killed,
then the namespaces (and the links in them) are deleted. Namespaces left behind by a
process that died without cleaning up are removed by the next lab.

Processes run in a namespace through :meth:`NetworkLab.prefix` (``ip netns exec NAME``);
the calling thread itself enters one with :func:`inside` (what a test does to run the
front-end and the coordinator process in the head). It needs root and iproute2's
``ip``: :func:`unavailable_reason` says why a lab cannot be built here.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import re
import shutil
import signal
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

__all__ = ["NetworkLab", "Node", "inside", "network_lab", "unavailable_reason"]

logger = logging.getLogger(__name__)

SUBNET = "10.231.0"
_CLONE_NEWNET = 0x40000000
_NAME = re.compile(r"^tdp(\d+)x\d+-")
_labs = 0


def _ip(*args: str, check: bool = True) -> str:
    result = subprocess.run(["ip", *args], capture_output=True, text=True, check=False)
    if check and result.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)} failed: {result.stderr.strip()}")
    return result.stdout


def unavailable_reason() -> str | None:
    """Why a lab cannot be built on this machine (None if it can)."""
    if os.geteuid() != 0:
        return "network namespaces need root (CI runs as root)"
    if shutil.which("ip") is None:
        return "iproute2's `ip` command is not installed"
    probe = f"tdp{os.getpid()}x0-probe"
    try:
        # everything a lab does: a namespace, a bridge and a veth pair in it, a process
        _ip("netns", "add", probe)
        _ip("-n", probe, "link", "add", "br0", "type", "bridge")
        _ip("-n", probe, "link", "add", "v0", "type", "veth", "peer", "name", "v1")
        _ip("netns", "exec", probe, "true")
    except RuntimeError as exc:
        return f"network namespaces do not work here: {exc}"
    finally:
        _ip("netns", "del", probe, check=False)
    return None


def _setns(fd: int) -> None:
    setns = getattr(os, "setns", None)  # Python >= 3.12
    if setns is not None:
        setns(fd, _CLONE_NEWNET)
        return
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.setns(fd, _CLONE_NEWNET) != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"setns: {os.strerror(errno)}")


@contextmanager
def inside(namespace: str) -> Iterator[None]:
    """Run the calling thread in network namespace ``namespace`` for the block.

    Sockets this thread creates in the block live in that namespace, and so do threads
    it starts (ZeroMQ's I/O threads: they start with a context's first socket). Threads
    that already exist stay where they were, trio's cached worker threads included, and
    ``trio.lowlevel.open_process`` starts processes from one of those: start processes
    through :meth:`NetworkLab.prefix` instead. On exit the thread goes back where it was.
    """
    with open("/proc/thread-self/ns/net", "rb") as own:
        with open(f"/var/run/netns/{namespace}", "rb") as target:
            _setns(target.fileno())
        try:
            yield
        finally:
            _setns(own.fileno())


@dataclass(frozen=True, slots=True)
class Node:
    """One node: its namespace, its address, and its link's name at the bridge."""

    namespace: str
    address: str
    link: str


class NetworkLab:
    """The namespaces of one lab; build it with :func:`network_lab`."""

    def __init__(self, nodes: int) -> None:
        global _labs
        _labs += 1
        self._tag = f"tdp{os.getpid()}x{_labs}"
        self.head = f"{self._tag}-head"
        self.head_address = f"{SUBNET}.1"
        self.nodes = [
            Node(f"{self._tag}-n{i + 1}", f"{SUBNET}.{i + 2}", f"veth{i + 1}") for i in range(nodes)
        ]
        self.namespaces = [self.head, *(node.namespace for node in self.nodes)]

    @staticmethod
    def prefix(namespace: str) -> tuple[str, ...]:
        """The command prefix that runs a program in ``namespace``."""
        return ("ip", "netns", "exec", namespace)

    def _build(self) -> None:
        head = self.head
        _ip("netns", "add", head)
        _ip("-n", head, "link", "set", "lo", "up")
        _ip("-n", head, "link", "add", "br0", "type", "bridge")
        _ip("-n", head, "addr", "add", f"{self.head_address}/24", "dev", "br0")
        _ip("-n", head, "link", "set", "br0", "up")
        for node in self.nodes:
            _ip("netns", "add", node.namespace)
            _ip("-n", node.namespace, "link", "set", "lo", "up")
            _ip(
                "link", "add", node.link, "netns", head, "type", "veth",
                "peer", "name", "eth0", "netns", node.namespace,
            )  # fmt: skip
            _ip("-n", head, "link", "set", node.link, "master", "br0", "up")
            _ip("-n", node.namespace, "addr", "add", f"{node.address}/24", "dev", "eth0")
            _ip("-n", node.namespace, "link", "set", "eth0", "up")
        logger.info(
            "network lab: head %s (%s), nodes %s",
            head,
            self.head_address,
            ", ".join(f"{n.namespace} ({n.address})" for n in self.nodes),
        )

    def partition(self, node: Node) -> None:
        """Cut ``node`` off: its link goes down at the bridge, nothing crosses."""
        _ip("-n", self.head, "link", "set", node.link, "down")
        logger.info("network lab: %s (%s) partitioned", node.namespace, node.address)

    def heal(self, node: Node) -> None:
        """Join ``node`` again."""
        _ip("-n", self.head, "link", "set", node.link, "up")
        logger.info("network lab: %s (%s) healed", node.namespace, node.address)

    @staticmethod
    def pids(namespace: str) -> list[int]:
        """The processes running in ``namespace``."""
        return [int(p) for p in _ip("netns", "pids", namespace, check=False).split()]

    def signal_node(self, node: Node, signum: int) -> list[int]:
        """Send ``signum`` to every process of ``node``; returns their pids."""
        pids = self.pids(node.namespace)
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signum)
        return pids

    def teardown(self) -> None:
        """Kill every process left in the lab's namespaces, then delete them."""
        _remove(self.namespaces)


def _remove(namespaces: list[str]) -> None:
    for namespace in namespaces:
        for pid in NetworkLab.pids(namespace):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    for namespace in namespaces:
        _ip("netns", "del", namespace, check=False)


def _remove_stale() -> None:
    """Delete namespaces of labs whose process is gone (it was killed mid-test)."""
    stale = []
    for line in _ip("netns", "list", check=False).splitlines():
        name = line.split()[0] if line.split() else ""
        match = _NAME.match(name)
        if match is not None and not os.path.exists(f"/proc/{match.group(1)}"):
            stale.append(name)
    if stale:
        logger.warning("network lab: removing stale namespaces %s", stale)
        _remove(stale)


@contextmanager
def network_lab(nodes: int = 2) -> Iterator[NetworkLab]:
    """A head and ``nodes`` nodes on a private bridge for the block; always torn down."""
    if nodes < 1:
        raise ValueError("a lab needs at least one node")
    _remove_stale()
    lab = NetworkLab(nodes)
    try:
        lab._build()
        yield lab
    finally:
        lab.teardown()
