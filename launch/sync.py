"""Files to the nodes, results back, all through the run's ssh.

    push    the project's files and the environment's (launch/project.py,
            launch/node_env.py), as one tar stream into the workdir of every node. To
            node 0 also the hostfiles; to every node the run's key and known_hosts as its
            ~/.ssh/id_ed25519 and ~/.ssh/known_hosts: node 0 starts the ranks on the
            others over ssh, and any node may copy its .venv to a new one.
    setup   cluster.setup in the workdir of every node, all at once
    fetch   rank 0's run directory from node 0 into the run dir's job/: the logs,
            metrics.jsonl, tensorboard/, summary.json, and of the checkpoints (in the run
            directory's checkpoints/, or wherever checkpoint.dir put them) only the newest,
            into job/checkpoints/
"""

from __future__ import annotations

import io
import shlex
import subprocess
import tarfile
from collections.abc import Sequence
from pathlib import Path

from spotring.checkpoint import layout
from spotring.launch.provider import Node
from spotring.launch.rundir import RunDir
from spotring.launch.ssh import RemoteError, Ssh, on_each


def tar(files: dict[str, Path], mode: int | None = None) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as archive:
        for name, path in files.items():
            info = archive.gettarinfo(str(path), arcname=name)
            info.uid = info.gid = 0
            info.uname = info.gname = ""
            if mode is not None:
                info.mode = mode
            with open(path, "rb") as f:
                archive.addfile(info, f)
    return buf.getvalue()


def push(ssh: Ssh, nodes: Sequence[Node], workdir: str, run: RunDir,
         files: dict[str, Path]) -> None:
    """``files`` (name in the workdir -> file here) to every node, and the rest above."""
    code = tar(files)
    keys = tar({"id_ed25519": run.key, "known_hosts": run.known_hosts}, mode=0o600)
    wd = shlex.quote(workdir)

    def give(node: Node) -> None:
        ssh.run(node, f"mkdir -p {wd} && tar -xzmf - -C {wd}", input=code)
        ssh.run(node, "mkdir -p -m 700 ~/.ssh && tar -xzmf - -C ~/.ssh", input=keys)

    on_each(nodes, give)
    ssh.run(nodes[0], f"tar -xzmf - -C {wd}",
            input=tar({"hosts": run.hosts, "hosts.mpich": run.hosts_mpich}))


def setup(ssh: Ssh, nodes: Sequence[Node], workdir: str, command: str) -> None:
    on_each(nodes, lambda n: ssh.run(n, f"cd {shlex.quote(workdir)} && {command}"))


def fetch(ssh: Ssh, node: Node, workdir: str, results: str, dest: Path) -> list[str]:
    """What rank 0 wrote to ``results`` (relative to the workdir; a run's is
    job_command.results_dir(run id)) into ``dest``; returns the files brought back (none
    if the job wrote nothing, e.g. it stopped on bad input). Streamed: a checkpoint can
    be large."""
    run_dir = f"{workdir}/{results}"
    src = shlex.quote(run_dir)
    note = ssh.run(node, f"cd {src} && {{ cat {layout.WHERE} 2>/dev/null || true; }}",
                   check=False)
    if note.returncode != 0:  # no such directory: the job wrote nothing
        return []
    folder = shlex.quote(str(layout.directory_of(run_dir, note.stdout.decode() or None)))
    listed = ssh.run(node, f"ls -1 {folder} 2>/dev/null || true")
    names = listed.stdout.decode().split()
    newest = [name for manifest in layout.manifests(names)[:1]
              for name in layout.files_of(manifest) if name in names]
    dest.mkdir(parents=True, exist_ok=True)
    fetched = _untar(ssh, node, f"cd {src} && tar -czf - --exclude=./checkpoints .", dest)
    if newest:
        fetched += [f"checkpoints/{name}" for name in _untar(
            ssh, node, f"cd {folder} && tar -czf - " + " ".join(map(shlex.quote, newest)),
            dest / "checkpoints")]
    return fetched


def _untar(ssh: Ssh, node: Node, command: str, dest: Path) -> list[str]:
    """What ``command`` (a tar to stdout on ``node``) streams, unpacked into ``dest``;
    the files' names."""
    dest.mkdir(parents=True, exist_ok=True)
    names = []
    with ssh.popen(node, command, stdout=subprocess.PIPE, stderr=subprocess.PIPE) as proc:
        with tarfile.open(fileobj=proc.stdout, mode="r|gz") as stream:
            for member in stream:
                stream.extract(member, dest, filter="data")
                if member.isfile():
                    names.append(member.name.removeprefix("./"))
        if proc.wait() != 0:
            raise RemoteError(node, command, proc.returncode, proc.stderr.read())
    return names
