"""SSH to the nodes: the run's key pair, its known_hosts, and one way to run commands.

Host keys are never taken on faith mid-run: `up` scans each node once with
ssh-keyscan (trust on first use, right after the node was made) into the run's own
known_hosts, and every later ssh checks against it (StrictHostKeyChecking=yes). Each
known_hosts line names both addresses of a node, so node 0 can check the others by
their private addresses with the same file. (horovodrun's own ssh calls add
StrictHostKeyChecking=no by themselves; that is Horovod's choice, not ours.)
"""

from __future__ import annotations

import shlex
import subprocess
import threading
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from contextvars import ContextVar
from pathlib import Path
from typing import TypeVar

from spotring.launch.provider import Node
from spotring.polling import poll

T = TypeVar("T")


def new_key(path: Path, comment: str) -> str:
    """An ed25519 key pair at ``path`` (0600) and ``path``.pub; returns the public key."""
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", comment,
                    "-f", str(path)], check=True, capture_output=True)
    return path.with_suffix(".pub").read_text().strip()


def scan_host_keys(nodes: Sequence[Node], known_hosts: Path, timeout_s: float) -> None:
    """Wait for every node's sshd and put its host key in ``known_hosts``, in place of
    any earlier key for its addresses (a replacement node may reuse one)."""
    fresh = on_each(nodes, lambda node: _scan(node, timeout_s))
    addresses = {a for n in nodes for a in (n.address, n.private_address)}
    kept = [line for line in (known_hosts.read_text().splitlines(keepends=True)
                              if known_hosts.exists() else [])
            if not set(line.split(" ", 1)[0].split(",")) & addresses]
    known_hosts.write_text("".join(kept + fresh))
    known_hosts.chmod(0o600)


def _scan(node: Node, timeout_s: float) -> str:
    said = ""  # ssh-keyscan's last complaint, for the error

    def scan() -> str | None:
        nonlocal said
        proc = _run(["ssh-keyscan", "-T", "5", "-t", "ed25519", node.address], text=True)
        said = proc.stderr.strip()
        keys = [line.split(None, 1)[1] for line in proc.stdout.splitlines()
                if line.strip() and not line.startswith("#")]
        names = ",".join(dict.fromkeys([node.address, node.private_address]))
        return "".join(f"{names} {key}\n" for key in keys) or None

    try:
        return poll(scan, timeout_s=timeout_s, interval_s=2,
                    what=f"node {node.id} ({node.address}): an sshd that answers "
                         "ssh-keyscan (cluster.ssh_timeout_s)")
    except TimeoutError as e:
        raise TimeoutError(f"{e}; ssh-keyscan said: {said or 'nothing'}") from None


def on_each(nodes: Sequence[Node], fn: Callable[[Node], T]) -> list[T]:
    """``fn`` on every node at once; the results in node order, the first error raised.
    When it raises (a node's error, Ctrl-C), the other nodes' work is given up: the
    processes it started through this module are killed, and it starts no more."""
    if not nodes:
        return []
    batch = _Batch(_batch.get())

    def work(node: Node) -> T:
        _batch.set(batch)  # this pool's thread, which runs nothing else
        return fn(node)

    pool = ThreadPoolExecutor(max_workers=min(len(nodes), 32))
    futures = [pool.submit(work, node) for node in nodes]
    try:
        # Wait in short slices: Ctrl-C is handled between two, not after the slowest node.
        while wait(futures, timeout=0.2, return_when=FIRST_EXCEPTION).not_done:
            if any(f.done() and f.exception() for f in futures):
                break
        return [f.result() for f in futures]
    except BaseException:
        # Else a node's ssh started a moment after Ctrl-C (which reached only the ones
        # running) would go on, and Python's exit would wait for its thread.
        batch.give_up()
        raise
    finally:
        pool.shutdown(wait=False, cancel_futures=True)


class GivenUp(Exception):
    """Raised in a worker of an on_each that has given up on its work."""


class _Batch:
    """The processes that the workers of one on_each started and that still run."""

    def __init__(self, outer: _Batch | None):
        self.outer = outer  # an on_each whose worker called this one: it gives this up too
        self.procs: set[subprocess.Popen] = set()
        self.given_up = False

    def chain(self) -> Iterator[_Batch]:
        batch: _Batch | None = self
        while batch is not None:
            yield batch
            batch = batch.outer

    def give_up(self) -> None:
        with _lock:
            self.given_up = True
            for proc in self.procs:
                proc.kill()


_batch: ContextVar[_Batch | None] = ContextVar("spotring_on_each", default=None)
# Held while a process starts and while a batch is given up, so that none starts unseen.
_lock = threading.Lock()


def _run(argv: list[str], input: bytes | None = None,
         text: bool = False) -> subprocess.CompletedProcess:
    """subprocess.run(argv, capture_output=True), which an on_each that gives up kills;
    GivenUp instead of starting, or of a result, in the work of one that has."""
    batch = _batch.get()
    batches = list(batch.chain()) if batch else []

    def gone() -> None:
        if any(b.given_up for b in batches):
            raise GivenUp(f"`{' '.join(argv)}`: given up, as the work on another node "
                          "failed or was interrupted")

    with _lock:
        gone()
        proc = subprocess.Popen(argv, stdin=None if input is None else subprocess.PIPE,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=text)
        for b in batches:
            b.procs.add(proc)
    try:
        out, err = proc.communicate(input)
    except BaseException:  # Ctrl-C in the main thread: as subprocess.run, leave no child
        proc.kill()
        proc.wait()
        raise
    finally:
        with _lock:
            for b in batches:
                b.procs.discard(proc)
    gone()
    return subprocess.CompletedProcess(argv, proc.returncode, out, err)


class Ssh:
    """ssh as ``user`` with the run's key, checked against the run's known_hosts."""

    def __init__(self, user: str, key: Path, known_hosts: Path):
        self.user = user
        self.common = [
            "-o", "IdentitiesOnly=yes", "-o", "StrictHostKeyChecking=yes", "-o", "BatchMode=yes",
            "-o", "ConnectTimeout=10", "-o", "ServerAliveInterval=30", "-o", "LogLevel=ERROR",
        ]
        self.options = ["-i", str(key), "-o", f"UserKnownHostsFile={known_hosts}", *self.common]

    def argv(self, node: Node, command: str, tty: bool = False,
             forward: int | None = None) -> list[str]:
        """``forward``: the node's 127.0.0.1:PORT reaches this machine's for as long as
        the connection lasts (the connection fails where the node cannot listen there)."""
        # A pty (-tt) ties the remote command to this connection: when it closes (Ctrl-C
        # here), sshd hangs the command up instead of leaving it running on the node.
        tunnel = [] if forward is None else [
            "-o", "ExitOnForwardFailure=yes", "-R", f"127.0.0.1:{forward}:127.0.0.1:{forward}"]
        return ["ssh", *self.options, *(["-tt"] if tty else []), *tunnel,
                f"{self.user}@{node.address}", command]

    def between(self, target: Node, command: str) -> str:
        """The shell command by which a node runs ``command`` on ``target``, over the
        private network, with the run's key and known_hosts that `run` gave every node."""
        return " ".join(["ssh", "-i", "~/.ssh/id_ed25519", "-o",
                         "UserKnownHostsFile=~/.ssh/known_hosts", *self.common,
                         shlex.quote(f"{self.user}@{target.private_address}"),
                         shlex.quote(command)])

    def run(self, node: Node, command: str, input: bytes | None = None,
            check: bool = True) -> subprocess.CompletedProcess:
        proc = _run(self.argv(node, command), input=input)
        if check and proc.returncode != 0:
            raise RemoteError(node, command, proc.returncode, proc.stderr)
        return proc

    def popen(self, node: Node, command: str, tty: bool = False, forward: int | None = None,
              **kwargs) -> subprocess.Popen:
        return subprocess.Popen(self.argv(node, command, tty, forward), **kwargs)

    def wait_for_login(self, nodes: Sequence[Node], timeout_s: float) -> None:
        """sshd may answer before the node accepts the key (cloud-init still at work)."""
        def login(node: Node) -> None:
            last: subprocess.CompletedProcess | None = None

            def try_once() -> bool | None:
                nonlocal last
                last = self.run(node, "true", check=False)
                return last.returncode == 0 or None

            try:
                poll(try_once, timeout_s=timeout_s, interval_s=3, what=f"node {node.id}: a login")
            except TimeoutError:  # ssh's own words say why better than a timeout does
                raise RemoteError(node, "true", last.returncode, last.stderr) from None
        on_each(nodes, login)


class RemoteError(RuntimeError):
    def __init__(self, node: Node, command: str, code: int, stderr: bytes | str | None):
        text = stderr.decode(errors="replace") if isinstance(stderr, bytes) else stderr or ""
        tail = "\n".join(text.strip().splitlines()[-15:])
        super().__init__(f"node {node.id} ({node.address}): `{command}` exited {code}"
                         + (f":\n{tail}" if tail else ""))
        self.code = code
