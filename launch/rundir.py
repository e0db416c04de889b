"""One launch's directory, runs/launch/<run id>/, and what it holds:

    launch.yaml        the config `up` composed; later commands take the cluster from it
    state.json         the nodes (addresses, type, zone, price), when they came and went,
                       those that left the run (lost spot nodes) for the bill, and each
                       try of the job with how it ended (launch/tries.py)
    ledger.json        the run's bill, node by node and restart by restart (launch/ledger.py)
    id_ed25519[.pub]   the run's SSH key pair (private key 0600, never leaves this machine
                       except to node 0, which uses it to reach the other nodes, and for a
                       sweep under horovodrun or mpirun to the first node of each slice)
    known_hosts        the nodes' host keys, scanned at `up`
    hosts              `ADDRESS slots=G`, one line per node (horovodrun, Open MPI)
    hosts.mpich        `ADDRESS:G` (MPICH)
    job.log            what the job printed (rank 0, and any rank's errors)
    job/               what `run` brought back: train.log, metrics.jsonl, tensorboard/,
                       summary.json, the final checkpoint
    nodes/             local cluster only: each node's sshd files, ~/.ssh and workdir

Run ids sort by time (20261122-114501-3f2a); the newest run is the one `up` made last.
"""

from __future__ import annotations

import json
import secrets
import time
from dataclasses import asdict
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from spotring.exits import ConfigError
from spotring.launch.provider import Node
from spotring.stores import write_atomic


def write_json(path: Path, value) -> None:
    """``value`` as JSON at ``path``, atomically: a crash keeps the old file or none."""
    write_atomic(path, json.dumps(value, indent=2).encode())


class RunDir:
    """The paths of one run's files, and its state."""

    def __init__(self, path: Path):
        # Absolute from here on: the paths written into the run's files (a local node's
        # sshd_config, which sshd reads again after changing to /) and those handed to
        # other programs must not depend on the directory the launcher started in.
        self.path = Path(path).resolve()

    @property
    def id(self) -> str:
        return self.path.name

    config = property(lambda self: self.path / "launch.yaml")
    key = property(lambda self: self.path / "id_ed25519")
    known_hosts = property(lambda self: self.path / "known_hosts")
    hosts = property(lambda self: self.path / "hosts")
    hosts_mpich = property(lambda self: self.path / "hosts.mpich")
    job_log = property(lambda self: self.path / "job.log")
    job = property(lambda self: self.path / "job")
    ledger = property(lambda self: self.path / "ledger.json")

    @classmethod
    def planned(cls, runs_dir: str | Path) -> RunDir:
        """A new run's directory, not created yet (a dry run shows it)."""
        stamp = time.strftime("%Y%m%d-%H%M%S")
        return cls(Path(runs_dir) / f"{stamp}-{secrets.token_hex(2)}")

    def create(self, cfg: DictConfig) -> None:
        self.path.mkdir(parents=True, mode=0o700)
        OmegaConf.save(cfg, self.config, resolve=True)
        self.save(created_at=time.time(), nodes=[])

    @classmethod
    def find(cls, runs_dir: str | Path, run_id: str | None) -> RunDir:
        """The run named ``run_id``, or the newest one under ``runs_dir``."""
        # By when `up` wrote launch.yaml: a run_id= of the user's own need not sort by time.
        runs = sorted(Path(runs_dir).glob("*/launch.yaml"), key=lambda p: p.stat().st_mtime)
        if run_id is not None:
            run = cls(Path(runs_dir) / run_id)
            if not run.config.exists():
                known = ", ".join(p.parent.name for p in runs[-5:]) or "none"
                raise ConfigError(f"run_id={run_id}: no such run in {runs_dir} "
                                  f"(newest: {known})")
            return run
        if not runs:
            raise ConfigError(f"no runs in {runs_dir}: start one with `spotring up`")
        return cls(runs[-1].parent)

    # ------------------------------------------------------------------------ state

    def state(self) -> dict:
        path = self.path / "state.json"
        return json.loads(path.read_text()) if path.exists() else {}

    def save(self, **changes) -> None:
        """Merge ``changes`` into state.json, atomically (a crash keeps the old file)."""
        write_json(self.path / "state.json", self.state() | changes)

    def nodes(self) -> list[Node]:
        return [Node(**n) for n in self.state().get("nodes", [])]

    def save_nodes(self, nodes: list[Node]) -> None:
        self.save(nodes=[asdict(n) for n in nodes])

    def retire(self, nodes: list[Node], at: float | None = None) -> None:
        """Record nodes that left the run (taken back by EC2, or replaced): they were
        billed until ``at`` (default now), and `cost` still counts them."""
        left = [{**asdict(n), "left_at": time.time() if at is None else at} for n in nodes]
        self.save(retired=self.state().get("retired", []) + left)

    def billed(self) -> list[tuple[Node, float]]:
        """Every node the run had, with when it left (None: still in the run)."""
        state = self.state()
        retired = [(Node(**{k: v for k, v in n.items() if k != "left_at"}), n["left_at"])
                   for n in state.get("retired", [])]
        return retired + [(n, None) for n in self.nodes()]

    def tries(self) -> list[dict]:
        """The job's tries so far, as launch/tries.py records them."""
        return self.state().get("tries", [])
