"""A node's Python environment: .venv in its workdir, built once and copied to the nodes
that come later.

    .spotring/          what every node gets with the project: the wheel of the spotring
                        that runs the launcher (launch/wheel.py: the user's version, pip-
                        installed or not) and node/ (setup.sh, Horovod's build)
    key                 a hash of all that goes into a .venv: the wheel, the scripts, the
                        project's requirements (the arguments, and requirements.txt's
                        text; a local package it names counts by its path, so a changed
                        one needs a new version), cluster.setup, the image's Python, the
                        extras; .venv/.spotring-env holds the key of the .venv a node has
    prepare             nodes whose .venv has the key: nothing to do (a restart on the
                        same nodes); nodes without, while another has it: a copy of that
                        .venv, node to node over the private network (no build, no
                        download: a replacement trains again in the time the copy takes;
                        cluster.copy_env=false builds instead); none has it: setup.sh on
                        every node at once

A .venv copied between nodes works because every node has the same image and the same
workdir path (the venv's scripts name their python by absolute path).
"""

from __future__ import annotations

import hashlib
import logging
import shlex
import time
from collections.abc import Sequence
from dataclasses import dataclass
from importlib.resources import files
from pathlib import Path

from spotring.launch.provider import Node
from spotring.launch.ssh import Ssh, on_each

STAMP = ".venv/.spotring-env"
NODE_FILES = "node"  # launch/node/: setup.sh, build-horovod, cxx20, the Horovod patch
log = logging.getLogger("launch")


@dataclass(frozen=True)
class Environment:
    key: str
    files: dict[str, Path]  # name under the workdir -> file here
    setup: str  # the shell command that builds it in the workdir

    @classmethod
    def of(cls, wheel: Path, project: Path, requirements: Sequence[str], image_python: str,
           extras: Sequence[str], horovod: bool, cluster_setup: str) -> Environment:
        """The environment of spotring's ``wheel``, the ``requirements`` (pip arguments,
        relative to the ``project`` directory) and Horovod where ``horovod``, on top of
        ``image_python``."""
        node = files("spotring.launch").joinpath(NODE_FILES)
        shipped = {f".spotring/{wheel.name}": wheel} | {
            f".spotring/node/{f.name}": Path(str(f)) for f in node.iterdir() if f.is_file()}
        digest = hashlib.sha256()
        for name, path in sorted(shipped.items()):
            digest.update(name.encode() + b"\0" + path.read_bytes())
        for word in requirements:  # a named file counts by its contents
            digest.update(word.encode() + b"\0")
            if (project / word).is_file():
                digest.update((project / word).read_bytes())
        digest.update(repr((image_python, sorted(extras), horovod, cluster_setup)).encode())
        variables = {"SPOTRING_ENV_KEY": digest.hexdigest()[:16],
                     "SPOTRING_IMAGE_PYTHON": image_python,
                     "SPOTRING_EXTRAS": ",".join(extras), "SPOTRING_HOROVOD": int(horovod)}
        setup = " ".join([*(f"{k}={shlex.quote(str(v))}" for k, v in variables.items()),
                          "bash .spotring/node/setup.sh", *map(shlex.quote, requirements)])
        return cls(variables["SPOTRING_ENV_KEY"], shipped, setup)


def prepare(ssh: Ssh, nodes: Sequence[Node], workdir: str, env: Environment,
            copy_env: bool, logs: Path) -> dict[str, str]:
    """Every node's .venv made ``env``; returns how, per node id. Each node's output goes
    to ``logs``/setup-<node id>.log."""
    wd = shlex.quote(workdir)
    have = on_each(nodes, lambda n: ssh.run(n, f"cat {wd}/{STAMP}", check=False)
                   .stdout.decode().strip())
    ready = [n for n, key in zip(nodes, have, strict=True) if key == env.key]
    missing = [n for n in nodes if n not in ready]
    how = {n.id: "ready" for n in ready}
    if not missing:
        return how

    def build(node: Node) -> str:
        started = time.monotonic()
        proc = ssh.run(node, f"cd {wd} && {env.setup} 2>&1", check=False)
        _keep(logs, node, proc.stdout)
        if proc.returncode != 0:
            tail = "\n".join(proc.stdout.decode(errors="replace").splitlines()[-15:])
            raise RuntimeError(f"node {node.id} ({node.address}): the environment's setup "
                               f"exited {proc.returncode}:\n{tail}\n(all of it: "
                               f"{logs / f'setup-{node.id}.log'})")
        return f"built in {time.monotonic() - started:.1f} s"

    def copy(node: Node) -> str:
        source, started = ready[0], time.monotonic()
        remote = ssh.between(node, f"rm -rf {wd}/.venv && tar -xf - -C {wd}")
        proc = ssh.run(source, f"tar -cf - -C {wd} .venv | {remote} && "
                               f"du -sm {wd}/.venv | cut -f1", check=False)
        _keep(logs, node, proc.stdout + proc.stderr)
        if proc.returncode != 0:  # the source may be going: build instead
            log.info("run: node %s: no copy of the environment from %s (%s); building it",
                     node.id, source.id, proc.stderr.decode(errors="replace").strip())
            return build(node)
        size = proc.stdout.decode().split()[-1]
        return f"copied from {source.id} in {time.monotonic() - started:.1f} s ({size} MB)"

    work = copy if ready and copy_env else build
    how |= dict(zip((n.id for n in missing), on_each(missing, work), strict=True))
    return how


def _keep(logs: Path, node: Node, output: bytes) -> None:
    with open(logs / f"setup-{node.id}.log", "ab") as f:
        f.write(output)
