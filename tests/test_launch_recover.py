"""Recovery decisions that need no cluster: the global batch kept on fewer workers, and
going on with the survivors when no replacement can be had. (The whole recovery, with
a node really taken away, is in tests/test_launch_local.py.)"""

from __future__ import annotations

import pytest
from omegaconf import OmegaConf

from launch.provider import NoCapacity, Node, Provider
from launch.recover import _replace, _restart_args, keep_global_batch
from launch.rundir import RunDir


@pytest.mark.parametrize("before, workers, now, after", [
    ((64, 1), 2, 2, (64, 1)),  # the same workers: nothing changes
    ((32, 1), 2, 1, (32, 2)),  # half of them: twice the accumulation
    ((32, 1), 8, 4, (32, 2)),
    ((32, 1), 8, 5, None),  # 256 over 5 workers: no even split
    ((32, 2), 2, 4, (32, 1)),  # more workers again: less accumulation
    ((48, 1), 4, 3, (32, 2)),  # 192 = 3 x 64 does not fit; 3 x 32 x 2 does
])
def test_the_global_batch_is_kept_with_the_fewest_accumulation_steps(before, workers, now,
                                                                      after):
    if after is None:
        with pytest.raises(RuntimeError, match="global batch 256 cannot be split evenly over 5"):
            keep_global_batch(*before, workers, now)
        return
    assert keep_global_batch(*before, workers, now) == after


def test_restart_arguments_resume_and_keep_the_global_batch():
    args = ["train.max_steps=100", "resume=never", "train.batch_size=32", "model=lenet"]
    assert _restart_args(args, (32, 1), 2, 1) == [
        "train.max_steps=100", "model=lenet", "resume=auto", "train.batch_size=32",
        "train.accumulation=2"]


def node(i: int) -> Node:
    return Node(id=f"n{i}", address=f"10.0.0.{i}", private_address=f"10.0.0.{i}", slots=1,
                type="g5.xlarge", zone="us-east-1a", lifecycle="spot")


class NoSpotLeft(Provider):
    """A provider whose replacement hits a capacity error: what EC2 answers when the
    spot pool is empty (nothing real produces one here)."""

    name = "test"
    workdir = "/tmp"

    def replace(self, lost):
        raise NoCapacity("InsufficientInstanceCapacity in us-east-1a")

    plan = check = create = describe = destroy = None


def test_without_replacements_the_survivors_go_on_if_they_are_enough(tmp_path, monkeypatch):
    run = RunDir(tmp_path / "run")
    run.path.mkdir()
    run.save_nodes([node(0), node(1), node(2)])
    admitted = []
    monkeypatch.setattr("launch.recover.admit", lambda cfg, run, nodes, new:
                        admitted.append(([n.id for n in nodes], new)))
    cfg = OmegaConf.create({"cluster": {"min_nodes": 2}})
    assert [n.id for n in _replace(cfg, run, NoSpotLeft(), [node(1)])] == ["n0", "n2"]
    assert admitted == [(["n0", "n2"], [])]  # hostfiles rewritten for the survivors

    cfg.cluster.min_nodes = 3
    with pytest.raises(NoCapacity, match="2 left is below cluster.min_nodes=3"):
        _replace(cfg, run, NoSpotLeft(), [node(1)])
