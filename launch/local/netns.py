"""The local cluster's network: one bridge per run, one network namespace per node.

    this machine   bridge spr<h>b, 10.213.X.1/24 (X: a free /24 of cluster.subnet)
    node i         namespace spotring-<run id>-<i>; its eth0 is 10.213.X.(10+i)/24,
                   joined to the bridge by a veth pair whose other end is spr<h>h<i>

<h> is a short hash of the run id: interface names have 15 characters at most. Every
name starts with a fixed prefix, so `down --all-mine` finds strays by name alone.
"""

from __future__ import annotations

import hashlib
import ipaddress
import os
import re
import shlex
import signal
import subprocess
from collections.abc import Sequence
from pathlib import Path

from spotring.polling import poll

NS_PREFIX = "spotring-"
LINK_PREFIX = "spr"
# Any run's links (down --all-mine): the prefix alone would also match others' names.
ANY_RUNS_LINK = re.compile(rf"{LINK_PREFIX}[0-9a-f]{{6}}(b|[hn][0-9]+)")


class Names:
    def __init__(self, run_id: str):
        self.ns_prefix = f"{NS_PREFIX}{run_id}-"
        self.link_prefix = LINK_PREFIX + hashlib.sha1(run_id.encode()).hexdigest()[:6]
        self.bridge = f"{self.link_prefix}b"

    def ns(self, i: int) -> str:
        return f"{self.ns_prefix}{i}"

    def veth(self, i: int) -> str:
        """This machine's end of node i's veth pair."""
        return f"{self.link_prefix}h{i}"

    def peer(self, i: int) -> str:
        """The node's end, until it moves into the namespace as eth0."""
        return f"{self.link_prefix}n{i}"


def ip(*args: str) -> str:
    proc = subprocess.run(["ip", *args], capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {proc.stderr.strip()}")
    return proc.stdout


def free_subnet(base: str, run_id: str) -> ipaddress.IPv4Network:
    """A /24 of ``base`` that no interface here uses, chosen by the run id's hash so that
    concurrent runs rarely try the same one."""
    taken = [ipaddress.ip_interface(word).network for line in ip("-4", "-o", "addr").splitlines()
             for word in line.split()[3:4]]
    candidates = list(ipaddress.ip_network(base).subnets(new_prefix=24))
    start = int(hashlib.sha1(run_id.encode()).hexdigest(), 16) % len(candidates)
    for net in candidates[start:] + candidates[:start]:
        if not any(net.overlaps(t) for t in taken):
            return net
    raise RuntimeError(f"cluster.subnet={base}: every /24 of it is in use here")


def add_bridge(name: str, address: str) -> None:
    # A MAC address of its own (locally administered, from its name): a bridge without
    # one takes the lowest of its ports', and changes it when that port goes. When a
    # node was deleted, the others kept sending to the old one, and this machine's ssh
    # to them stalled until their ARP entries expired, for most of a minute.
    mac = "02:" + ":".join(f"{b:02x}" for b in hashlib.sha256(name.encode()).digest()[:5])
    ip("link", "add", name, "address", mac, "type", "bridge")
    ip("addr", "add", address, "dev", name)
    ip("link", "set", name, "up")


def bridge_network(name: str) -> ipaddress.IPv4Network:
    words = ip("-4", "-o", "addr", "show", "dev", name).split()
    return ipaddress.ip_interface(words[3]).network


def add_node(ns: str, veth: str, peer: str, bridge: str, address: str) -> None:
    """Namespace ``ns`` with eth0 at ``address`` (a CIDR), plugged into ``bridge``."""
    ip("netns", "add", ns)
    ip("link", "add", veth, "type", "veth", "peer", "name", peer)
    ip("link", "set", veth, "master", bridge)
    ip("link", "set", veth, "up")
    ip("link", "set", peer, "netns", ns)
    # Every node's interface has the same name, as on identical machines: Horovod looks
    # for interfaces common to all hosts.
    ip("-n", ns, "link", "set", peer, "name", "eth0")
    ip("-n", ns, "addr", "add", address, "dev", "eth0")
    ip("-n", ns, "link", "set", "eth0", "up")
    ip("-n", ns, "link", "set", "lo", "up")


def on_node(ns: str, hostname: str, binds: Sequence[tuple[Path, Path]],
            argv: Sequence[str]) -> list[str]:
    """The command line that runs ``argv`` as a process of node ``ns``: in its network
    namespace, with ``hostname`` and each (source, target) of ``binds`` mounted over its
    target. `ip netns exec` gives the command a mount namespace of its own; unshare adds
    the hostname's. What the command starts (an sshd's sessions, a slurmd's tasks)
    inherits both."""
    script = " && ".join(
        [f"hostname {shlex.quote(hostname)}"]
        + [f"mount --bind {shlex.quote(str(a))} {shlex.quote(str(b))}" for a, b in binds]
        + [f"exec {shlex.join(argv)}"])
    return ["ip", "netns", "exec", ns, "unshare", "--uts", "sh", "-c", script]


def namespaces(prefix: str) -> list[str]:
    return sorted(line.split()[0] for line in ip("netns", "list").splitlines()
                  if line.startswith(prefix))


def links(prefix: str | re.Pattern) -> list[str]:
    """This machine's links whose names start with ``prefix`` or match it whole."""
    names = (line.split(":")[1].strip().split("@")[0] for line in ip("-o", "link").splitlines())
    if isinstance(prefix, str):
        return sorted(n for n in names if n.startswith(prefix))
    return sorted(n for n in names if prefix.fullmatch(n))


def delete_namespace(ns: str, stops: tuple[tuple[int, float], ...] = (
        (signal.SIGTERM, 5.0), (signal.SIGKILL, 2.0))) -> list[int]:
    """Stop every process in ``ns`` (its sshd, any job), then remove it; returns the pids.
    ``stops``: the signals sent in turn, each with the seconds it has to end them all."""
    pids = [int(p) for p in ip("netns", "pids", ns).split()]
    def all_ended() -> bool | None:
        return not any(_signal(p, 0) for p in pids) or None

    for sig, wait in stops:
        for pid in pids:
            _signal(pid, sig)
        try:
            poll(all_ended, timeout_s=wait, interval_s=0.1, what=f"the processes of {ns}")
            break
        except TimeoutError:  # the next, harder signal
            continue
    try:
        ip("netns", "delete", ns)
    except RuntimeError:  # one that went meanwhile is fine (another caller deleted it)
        if ns in namespaces(ns):
            raise
    return pids


def delete_link(name: str) -> None:
    """Delete a link; one that went meanwhile is fine: the kernel removes a veth pair
    when the namespace of its other end goes, a moment after `ip netns delete`."""
    try:
        ip("link", "delete", name)
    except RuntimeError:
        if name in links(name):
            raise


def _signal(pid: int, sig: int) -> bool:
    """Send ``sig``; False if the process is gone (or a zombie nobody reaped yet)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                return False
        os.kill(pid, sig)
        return True
    except (FileNotFoundError, ProcessLookupError):
        return False
