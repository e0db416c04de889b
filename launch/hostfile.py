"""The hostfiles, from the nodes' private addresses (what the nodes use between them):

    hosts         10.0.1.17 slots=4     horovodrun --hostfile, Open MPI mpirun --hostfile
    hosts.mpich   10.0.1.17:4           MPICH mpiexec -f

Node 0 comes first: horovodrun and mpirun put rank 0 there. The files hold nothing
but these lines: Horovod's parser reads every line as a host (a comment would be one).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from spotring.launch.provider import Node


def open_mpi(nodes: Sequence[Node]) -> str:
    return "".join(f"{n.private_address} slots={n.slots}\n" for n in nodes)


def mpich(nodes: Sequence[Node]) -> str:
    return "".join(f"{n.private_address}:{n.slots}\n" for n in nodes)


def write(nodes: Sequence[Node], hosts: Path, hosts_mpich: Path) -> None:
    hosts.write_text(open_mpi(nodes))
    hosts_mpich.write_text(mpich(nodes))
