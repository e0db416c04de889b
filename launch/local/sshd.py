"""A local node's sshd, started inside the node's network namespace with its own
hostname (a UTS namespace) and its own view of three paths (a mount namespace), so that
what runs over ssh on node i sees a machine of its own:

    <run dir>/workdir   ->  nodes/node-i/work    its workdir: the copied code, .venv, runs/
    ~/.ssh              ->  nodes/node-i/ssh     its keys and known_hosts
    /etc/hosts          ->  nodes/node-i/hosts   its hostname -> its address

Why a hostname per node: Horovod 0.28.1 makes the Gloo device of its process sets from
the machine's hostname instead of HOROVOD_GLOO_IFACE, so with one shared hostname that
resolves to loopback every node would offer the others 127.0.0.1. Real machines have
hostnames that resolve to their own address; so do these.
"""

from __future__ import annotations

import pwd
import subprocess
from pathlib import Path

from spotring.launch.local import netns
from spotring.launch.ssh import new_key
from spotring.polling import poll

SSHD = Path("/usr/sbin/sshd")

CONFIG = """\
ListenAddress {address}
HostKey {dir}/host_key
AuthorizedKeysFile {dir}/authorized_keys
PidFile {dir}/sshd.pid
PermitRootLogin prohibit-password
PasswordAuthentication no
KbdInteractiveAuthentication no
UsePAM no
# The run dir may lie under /tmp (sticky and world-writable), where StrictModes would
# refuse the key; the files themselves are 0600 in a 0700 directory.
StrictModes no
"""


def ssh_dir(user: str) -> Path:
    return Path(pwd.getpwnam(user).pw_dir) / ".ssh"


def prepare(node_dir: Path, address: str, hostname: str, public_key: str) -> None:
    """The node's sshd config, host key, authorized key and /etc/hosts."""
    (node_dir / "ssh").mkdir(parents=True, mode=0o700)
    (node_dir / "work").mkdir()
    new_key(node_dir / "host_key", hostname)
    (node_dir / "authorized_keys").write_text(public_key + "\n")
    (node_dir / "authorized_keys").chmod(0o600)
    (node_dir / "hosts").write_text(f"127.0.0.1 localhost\n{address} {hostname}\n")
    (node_dir / "sshd_config").write_text(CONFIG.format(address=address, dir=node_dir))


def start(ns: str, node_dir: Path, hostname: str, workdir: Path, user: str) -> int:
    """sshd for the node (it daemonizes); returns its pid."""
    Path("/run/sshd").mkdir(mode=0o755, exist_ok=True)  # sshd's privilege separation dir
    ssh_dir(user).mkdir(mode=0o700, exist_ok=True)  # a mount point needs to exist
    binds = [(node_dir / "work", workdir), (node_dir / "ssh", ssh_dir(user)),
             (node_dir / "hosts", Path("/etc/hosts"))]
    # sshd and every session it starts see the node's hostname and paths.
    proc = subprocess.run(netns.on_node(ns, hostname, binds, [
        str(SSHD), "-f", str(node_dir / "sshd_config"), "-E", str(node_dir / "sshd.log")]),
        capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"sshd in {ns} did not start: {proc.stderr.strip()}")
    pid_file = node_dir / "sshd.pid"
    pid = poll(lambda: pid_file.exists() and pid_file.read_text().strip() or None,
               timeout_s=10, interval_s=0.05,
               what=f"sshd in {ns}: its pid file (see {node_dir / 'sshd.log'})")
    return int(pid)
