"""The command that starts a job's command (CMD) across the nodes, one per launcher
(job.launcher). CMD is the user's, or the built-in trainer's, `spotring train OVERRIDES`
(launch/contract.py): nothing here tells them apart.

Each runs in the workdir (the same path on every node) with the node's .venv first on
PATH and the contract's variables (spotring/contract.py) set; G is a node's slots (its
GPUs), N*G all of them:

    horovodrun  node 0   horovodrun --gloo -np N*G --hostfile hosts CMD
    mpirun      node 0   mpirun -np N*G --hostfile hosts --prefix .venv -x ... CMD
    torchrun    node i   torchrun --nnodes N --nproc-per-node G --node-rank i
                                  --master-addr NODE0 --no-python CMD
    none        node i   CMD, once per node, with NODE_RANK=i NNODES=N NPROC_PER_NODE=G
                         MASTER_ADDR=NODE0 MASTER_PORT (for a launcher of the command's own)
    in_place    node i   CMD, once per slot s, each over an ssh of its own, with
                         RANK=i*G+s WORLD_SIZE=N*G LOCAL_RANK=s LOCAL_WORLD_SIZE=G
                         SPOTRING_IN_PLACE=on SPOTRING_RENDEZVOUS (launch/in_place.py)

Rank 0 writes to SPOTRING_RUN_DIR (runs/<run id> in node 0's workdir, or job.results),
which `run` brings back. The trainer's engine is its config's under every launcher (ddp
unless its overrides say engine=horovod): horovodrun's rendezvous also carries DDP's
store address, and under mpirun DDP takes its ranks from mpi4py.
"""

from __future__ import annotations

import re
import shlex
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from spotring.contract import IN_PLACE, RUN_DIR
from spotring.launch.commands import LAUNCHER_ENV
from spotring.launch.provider import Node
from spotring.support.restarts import with_note

TORCHRUN_PORT = 29400  # also MASTER_PORT under job.launcher=none
HOROVOD_START_TIMEOUT_S = 120


def results_dir(run_id: str) -> str:
    """Where rank 0 writes, relative to node 0's workdir."""
    return f"runs/{run_id}"


@dataclass(frozen=True)
class JobCommand:
    launcher: str
    commands: dict[int, str]  # node index -> shell command; in_place: rank -> command

    def exit_code(self, returncode: int, output: str, note: str | None = None) -> int:
        """The job's exit code, so that the launcher can tell a lost rank (69), a
        preemption (75) or a divergence (65) from a failure. horovodrun exits 1 whatever
        the ranks did and names the first failed rank's code in its last words; torchrun
        exits 1 too and names none reliably, but rank 0 leaves a note (``note``, one of
        spotring.support.restarts.NOTES: preempted.json or diverged.json)."""
        if self.launcher == "horovodrun" and returncode != 0 and note is None:
            codes = re.findall(r"^Exit code: (\d+)$", output, re.MULTILINE)
            return int(codes[-1]) if codes else returncode
        return with_note(returncode, note)


def build(launcher: str, nodes: Sequence[Node], workdir: str, run_id: str,
          command: Sequence[str], env: Mapping[str, str] | None = None,
          results: str | None = None) -> JobCommand:
    """The job ``command`` on ``nodes``; ``env`` joins every process's environment;
    ``results``: rank 0's run directory, relative to the workdir (default
    results_dir(run_id))."""
    results = results or results_dir(run_id)
    env = {RUN_DIR: f"{workdir}/{results}", **(env or {})}
    program = [str(a) for a in command]
    total = sum(n.slots for n in nodes)
    if launcher == "horovodrun":
        # --gloo: Horovod's Gloo controller needs nothing on the nodes but ssh, and its
        # rendezvous server also carries DDP's store address, so both engines run under it
        # (job.launcher=mpirun for MPI's). It passes this environment on to every rank.
        # --start-timeout: its ssh checks of every node take longer than its default 30 s
        # on a busy node 0 or with many nodes.
        commands = {0: ["horovodrun", "--gloo", "-np", total, "--hostfile", "hosts",
                        "--start-timeout", HOROVOD_START_TIMEOUT_S, *program]}
    elif launcher == "mpirun":
        # --prefix: the other nodes start Open MPI's daemon from the same .venv; -x: their
        # ranks get the same PATH (python) and variables (Open MPI passes on only those).
        commands = {0: ["mpirun", "-np", total, "--hostfile", "hosts", "--prefix",
                        f"{workdir}/.venv", "--bind-to", "none",
                        *[a for k in ("PATH", *LAUNCHER_ENV, *env) for a in ("-x", k)],
                        *program]}
    elif launcher == "torchrun":
        commands = {i: ["torchrun", "--nnodes", len(nodes), "--nproc-per-node", node.slots,
                        "--node-rank", i, "--master-addr", nodes[0].private_address,
                        "--master-port", TORCHRUN_PORT, "--no-python", *program]
                    for i, node in enumerate(nodes)}
    elif launcher == "in_place":
        slots = [(i, s) for i, node in enumerate(nodes) for s in range(node.slots)]
        return JobCommand(launcher, {rank: _in_workdir(workdir, program, {
            **env, "RANK": rank, "WORLD_SIZE": total, "LOCAL_RANK": slot,
            "LOCAL_WORLD_SIZE": nodes[i].slots, IN_PLACE: "on"})
            for rank, (i, slot) in enumerate(slots)})
    elif launcher == "none":
        node_env = {i: {"NODE_RANK": i, "NNODES": len(nodes), "NPROC_PER_NODE": node.slots,
                        "MASTER_ADDR": nodes[0].private_address, "MASTER_PORT": TORCHRUN_PORT}
                    for i, node in enumerate(nodes)}
        return JobCommand(launcher, {i: _in_workdir(workdir, program, {**env, **node_env[i]})
                                     for i in node_env})
    else:
        raise ValueError(f"job.launcher={launcher}")
    return JobCommand(launcher, {i: _in_workdir(workdir, argv, env)
                                 for i, argv in commands.items()})


def _in_workdir(workdir: str, argv: list, env: Mapping[str, object]) -> str:
    env = " ".join(f"{k}={shlex.quote(str(v))}" for k, v in {**LAUNCHER_ENV, **env}.items())
    words = " ".join(shlex.quote(str(a)) for a in argv)
    venv = shlex.quote(f"{workdir}/.venv/bin")
    return f'cd {shlex.quote(workdir)} && PATH={venv}:"$PATH" {env} exec {words}'
