"""SLURM for real (issue 26): a controller, munge and a slurmd in each of 2 network
namespaces (tests/slurm.py), and the trainer started with srun across them."""

from __future__ import annotations

import subprocess
import sys

import pytest

from launch.commands import local_environment
from tests import slurm
from tests.conftest import PARITY, QUICK, REPO, Run, assert_close

WHY_NOT = slurm.unavailable()
pytestmark = pytest.mark.skipif(WHY_NOT is not None, reason=WHY_NOT or "")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    with slurm.running(tmp_path_factory.mktemp("slurm") / "cluster") as started:
        yield started


def test_a_step_runs_on_each_node_under_its_own_name_and_address(cluster):
    out = cluster.run("srun", "-N", "2", "--ntasks-per-node=1", "--label", "sh", "-c",
                      "echo $(hostname) $(hostname -I) $(getent hosts node-0)").stdout
    lines = sorted(out.splitlines())
    zero, one = cluster.nodes
    assert lines == [f"0: node-0 {zero.address} {zero.address} node-0",
                     f"1: node-1 {one.address} {zero.address} node-0"]


@pytest.mark.slow
def test_srun_across_two_nodes_takes_the_steps_of_torchrun(cluster, tmp_path, ddp_2x32):
    run_dir = tmp_path / "run"
    proc = subprocess.run(
        ["srun", "-N", "2", "--ntasks-per-node=1", sys.executable, "-m", "trainer",
         f"hydra.run.dir={run_dir}", *QUICK, *PARITY, "train.batch_size=32"],
        cwd=REPO, capture_output=True, text=True, timeout=120,
        env=local_environment(**cluster.env))
    run = Run(run_dir, proc)
    assert proc.returncode == 0, f"{run.output[-6000:]}\n{cluster.logs()}"
    # One rank in each namespace: rank 1 reached rank 0's store at node-0's address,
    # the only way out of its namespace.
    for node in cluster.nodes:
        assert "launch task StepId=" in (cluster.dir / f"{node.name}.log").read_text()
    assert run.summary["world_size"] == 2 and run.summary["global_batch"] == 64
    assert run.summary["steps"] == ddp_2x32.summary["steps"] == 20
    assert_close(run.params(), ddp_2x32.params(), rtol=1e-10)
