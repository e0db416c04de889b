"""The command that starts the trainer across the nodes, one per launcher (job.launcher).

Each runs in the workdir (the same path on every node) with the node's .venv first on
PATH; G is a node's slots (its GPUs), N*G all of them:

    horovodrun  node 0   horovodrun --gloo -np N*G --hostfile hosts python -m trainer ...
    mpirun      node 0   mpirun -np N*G --hostfile hosts --prefix .venv python -m trainer ...
    torchrun    node i   torchrun --nnodes N --nproc-per-node G --node-rank i
                                  --master-addr NODE0 -m trainer ...

The engine follows the launcher (horovod under horovodrun and mpirun, ddp under
torchrun) unless the trainer arguments name one. Rank 0 writes to runs/<run id> in node
0's workdir, which `run` brings back.
"""

from __future__ import annotations

import re
import shlex
from collections.abc import Sequence
from dataclasses import dataclass

from launch.commands import LAUNCHER_ENV
from launch.provider import Node
from spotring.exits import DIVERGED, EXIT_DIVERGED, EXIT_PREEMPTED, PREEMPTED

ENGINES = {"horovodrun": "horovod", "mpirun": "horovod", "torchrun": "ddp"}
TORCHRUN_PORT = 29400
HOROVOD_START_TIMEOUT_S = 120
# The notes rank 0 leaves in its run dir (spotring/exits.py), and the exit code each says.
NOTES = {PREEMPTED: EXIT_PREEMPTED, DIVERGED: EXIT_DIVERGED}


def results_dir(run_id: str) -> str:
    """Where rank 0 writes, relative to node 0's workdir."""
    return f"runs/{run_id}"


@dataclass(frozen=True)
class JobCommand:
    launcher: str
    commands: dict[int, str]  # node index -> shell command

    def exit_code(self, returncode: int, output: str, note: str | None = None) -> int:
        """The trainer's exit code, so that the launcher can tell a lost rank (69), a
        preemption (75) or a divergence (65) from a failure. horovodrun exits 1 whatever
        the ranks did and names the first failed rank's code in its last words; torchrun
        exits 1 too and names none reliably, but rank 0 leaves a note (``note``, one of
        NOTES: preempted.json or diverged.json)."""
        if returncode != 0 and note is not None:
            return NOTES[note]
        if self.launcher == "horovodrun" and returncode != 0:
            codes = re.findall(r"^Exit code: (\d+)$", output, re.MULTILINE)
            if codes:
                return int(codes[-1])
        return returncode


def build(launcher: str, nodes: Sequence[Node], workdir: str, run_id: str,
          args: Sequence[str]) -> JobCommand:
    trainer = ["-m", "trainer", f"hydra.run.dir={results_dir(run_id)}", *args]
    if not any(a.startswith("engine=") for a in args):
        trainer.insert(2, f"engine={ENGINES[launcher]}")
    total = sum(n.slots for n in nodes)
    if launcher == "horovodrun":
        # --gloo: Horovod's Gloo controller needs nothing on the nodes but ssh, and its
        # rendezvous server also carries DDP's store address, so both engines run under it
        # (job.launcher=mpirun for MPI's).
        # --start-timeout: its ssh checks of every node take longer than its default 30 s
        # on a busy node 0 or with many nodes.
        commands = {0: ["horovodrun", "--gloo", "-np", total, "--hostfile", "hosts",
                        "--start-timeout", HOROVOD_START_TIMEOUT_S, "python", *trainer]}
    elif launcher == "mpirun":
        # --prefix: the other nodes start Open MPI's daemon from the same .venv; -x PATH:
        # their ranks find the same python (Open MPI passes on only what -x names).
        commands = {0: ["mpirun", "-np", total, "--hostfile", "hosts", "--prefix",
                        f"{workdir}/.venv", "--bind-to", "none",
                        *[a for k in ("PATH", *LAUNCHER_ENV) for a in ("-x", k)],
                        "python", *trainer]}
    elif launcher == "torchrun":
        commands = {i: ["torchrun", "--nnodes", len(nodes), "--nproc-per-node", node.slots,
                        "--node-rank", i, "--master-addr", nodes[0].private_address,
                        "--master-port", TORCHRUN_PORT, *trainer]
                    for i, node in enumerate(nodes)}
    else:
        raise ValueError(f"job.launcher={launcher}")
    return JobCommand(launcher, {i: _in_workdir(workdir, argv) for i, argv in commands.items()})


def _in_workdir(workdir: str, argv: list) -> str:
    env = " ".join(f"{k}={v}" for k, v in LAUNCHER_ENV.items())
    words = " ".join(shlex.quote(str(a)) for a in argv)
    venv = shlex.quote(f"{workdir}/.venv/bin")
    return f'cd {shlex.quote(workdir)} && PATH={venv}:"$PATH" {env} exec {words}'
