"""Which of a run's nodes are doomed: those whose instance metadata service announces a
spot interruption notice, asked on each node over ssh (`python -m spotring.metadata`)
of the same service the job's own watcher polls there (spotring/preemption.py).

EC2 takes such a node within two minutes of its notice, or stops it (an interruption
behaviour of stop or hibernate), and until then its notice stays up: a job restarted on
it would be stopped again at once, try after try. So recovery takes it down and replaces
it, or goes on without it (launch/recover.py). Off EC2 there is no metadata service, and
no node is noticed.
"""

from __future__ import annotations

import shlex
from collections.abc import Sequence

from spotring.launch.provider import Node
from spotring.launch.ssh import Ssh, on_each


def noticed(ssh: Ssh, nodes: Sequence[Node], workdir: str) -> dict[str, str]:
    """The notice each of ``nodes`` announces, by node id; a node that answers nothing
    (gone, unreachable, no metadata service) announces none."""
    # spotring.metadata imports no torch: a fraction of a second per node.
    probe = f"{shlex.quote(f'{workdir}/.venv/bin/python')} -m spotring.metadata"
    answers = on_each(nodes, lambda node: ssh.run(node, probe, check=False))
    return {node.id: answer.stdout.decode(errors="replace").strip()
            for node, answer in zip(nodes, answers, strict=True) if answer.returncode == 0}
