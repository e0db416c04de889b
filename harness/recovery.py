"""A launch's recovery driven without a cluster (tests/test_launch_recover.py,
tests/test_exits.py): ``supervised`` runs spotring.launch.recover.supervise over jobs
that end as a test says, on nodes made by ``node``, with a ``Fleet`` standing in for
EC2's describe and replacements (tests/test_launch_aws.py covers those against moto)."""

from __future__ import annotations

import json
import time

from omegaconf import OmegaConf

from spotring.exits import EXIT_PREEMPTED, PREEMPTED
from spotring.launch.provider import Node, Provider
from spotring.launch.recover import supervise
from spotring.launch.rundir import RunDir


def node(i: int) -> Node:
    return Node(id=f"n{i}", address=f"10.0.0.{i}", private_address=f"10.0.0.{i}", slots=1,
                type="g5.xlarge", zone="us-east-1a", lifecycle="spot")


class Fleet(Provider):
    """A provider whose nodes EC2 has stopped listing once terminated (as it does after
    a while), and which has replacements to give: it stands in for EC2's describe and
    create_fleet, which tests/test_launch_aws.py covers against moto."""

    name = "test"
    workdir = "/tmp"

    def __init__(self, listed):
        self.listed, self.replaced = listed, []

    def describe(self):
        return self.listed

    def replace(self, lost):
        self.replaced.append([n.id for n in lost])
        return [node(9)]

    plan = check = create = destroy = None


def supervised(tmp_path, monkeypatch, tries, listed, max_restarts=1, max_preemptions=1,
               command=("python", "train.py"), noticed=(), notice_wait_s=3600.0):
    """supervise() over jobs that end as ``tries`` say in turn: (exit code, the step its
    last train record names), or an exception to raise. A job that exits 75 leaves rank
    0's note at that step, as the trainer does. ``noticed``: the nodes whose metadata
    service announces a spot notice (asked over ssh on real nodes: launch/notice.py)."""
    run = RunDir(tmp_path / "run")
    run.path.mkdir(parents=True)
    run.save_nodes([node(0), node(1)])
    tries = iter(tries)
    commands = []

    def job(cfg, run, provider):
        commands.append(list(cfg.job.command))
        end = next(tries)
        if isinstance(end, Exception):
            raise end
        code, step = end
        run.job.mkdir(exist_ok=True)
        with open(run.job / "metrics.jsonl", "a") as metrics:
            metrics.write(json.dumps({"time": time.time(), "kind": "train", "step": step}) + "\n")
        (run.job / PREEMPTED).unlink(missing_ok=True)
        if code == EXIT_PREEMPTED:
            (run.job / PREEMPTED).write_text(json.dumps({"reason": "SIGTERM", "step": step}))
        return code

    monkeypatch.setattr("spotring.launch.recover.run_job", job)
    monkeypatch.setattr("spotring.launch.recover.admit", lambda cfg, run, nodes, new:
                        run.save_nodes(nodes))
    monkeypatch.setattr("spotring.launch.notice.noticed", lambda ssh, nodes, workdir: {
        n.id: '{"action": "terminate"}' for n in nodes if n.id in noticed})
    cfg = OmegaConf.create({"job": {"command": list(command), "launcher": "torchrun"},
                            "checkpoint": {"uri": None},
                            "cluster": {"min_nodes": 2, "max_restarts": max_restarts,
                                        "max_preemptions": max_preemptions, "ssh_user": "root",
                                        "notice_wait_s": notice_wait_s,
                                        "notice_poll_s": 0.01}})
    provider = Fleet(listed)
    code = supervise(cfg, run, provider)
    return code, provider, run, commands
