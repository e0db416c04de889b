"""Recovery decisions that need no cluster: the command pinned at the first start and
the survivors going on only at a node count it can run on, when no replacement can be
had; a node announcing a spot notice lost at once; which exits and which lost nodes make
a restart. (The whole recovery, with a node really taken away, is in
tests/test_launch_local.py; the policy for every exit code in tests/test_exits.py.)"""

from __future__ import annotations

import dataclasses
import json
import logging

import pytest
from omegaconf import OmegaConf

from harness.recovery import node, supervised
from spotring.exits import EXIT_CONFIG, EXIT_DIVERGED, EXIT_PEER_LOST, EXIT_PREEMPTED
from spotring.launch.cost import after_run
from spotring.launch.provider import NoCapacity, Provider
from spotring.launch.recover import _replace
from spotring.launch.rundir import RunDir
from spotring.launch.ssh import RemoteError

# The trainer, as `spotring launch ... -- model=lenet` makes its command.
TRAINER = ["spotring", "train", "model=lenet", "train.batch_size=32"]


class NoSpotLeft(Provider):
    """A provider whose replacement hits a capacity error: what EC2 answers when the
    spot pool is empty (nothing real produces one here)."""

    name = "test"
    workdir = "/tmp"

    def replace(self, lost):
        raise NoCapacity("InsufficientInstanceCapacity in us-east-1a")

    plan = check = create = describe = destroy = None


def four_nodes(tmp_path, monkeypatch, command: list[str], min_nodes: int):
    run = RunDir(tmp_path / "run")
    run.path.mkdir()
    run.save_nodes([node(i) for i in range(4)])
    admitted = []
    monkeypatch.setattr("spotring.launch.recover.admit", lambda cfg, run, nodes, new:
                        admitted.append(([n.id for n in nodes], new)))
    cfg = OmegaConf.create({"cluster": {"min_nodes": min_nodes}, "job": {"command": command}})
    return run, cfg, admitted


def test_without_replacements_the_survivors_go_on_if_they_are_enough(tmp_path, monkeypatch):
    run, cfg, admitted = four_nodes(tmp_path, monkeypatch, ["python", "train.py"], 3)
    assert [n.id for n in _replace(cfg, run, NoSpotLeft(), [node(1)])] == ["n0", "n2", "n3"]
    assert admitted == [(["n0", "n2", "n3"], [])]  # hostfiles rewritten for the survivors
    # Billed until found lost, once: the lost node leaves the run's nodes for the retired.
    assert [n["id"] for n in run.state()["retired"]] == ["n1"]

    cfg.cluster.min_nodes = 4
    with pytest.raises(NoCapacity, match="3 left is below cluster.min_nodes=4"):
        _replace(cfg, run, NoSpotLeft(), [node(1)])


@pytest.mark.parametrize("global_batch, goes_on", [(384, True), (256, False)])
def test_the_survivors_go_on_only_where_the_job_can_split_its_global_batch(
        tmp_path, monkeypatch, global_batch, goes_on):
    """384 over the 3 left is 128 each; 256 does not split over 3: the trainer's own check
    (spotring.cli.check_command) says so, and the run stops rather than start a job that
    would refuse."""
    command = [*TRAINER, f"train.global_batch={global_batch}"]
    run, cfg, admitted = four_nodes(tmp_path, monkeypatch, command, 2)
    if goes_on:
        assert len(_replace(cfg, run, NoSpotLeft(), [node(1)])) == 3
        return
    with pytest.raises(NoCapacity, match="no replacement for 1 lost node.*a global batch of "
                                         "256 samples cannot be split over 3 workers"):
        _replace(cfg, run, NoSpotLeft(), [node(1)])
    assert admitted == [] and "retired" not in run.state()


def test_a_node_no_longer_listed_is_lost_and_replaced(tmp_path, monkeypatch):
    code, provider, run, _ = supervised(tmp_path, monkeypatch,
                                        [(EXIT_PEER_LOST, 30), (0, 100)], listed=[node(0)])
    assert code == 0
    assert provider.replaced == [["n1"]]
    assert [n.id for n in run.nodes()] == ["n0", "n9"]
    assert [(t["exit"], t["step"], t["restart"], t["lost"]) for t in run.tries()] == [
        (EXIT_PEER_LOST, 30, "failure", ["n1"]), (0, 100, None, [])]


def test_the_command_is_pinned_at_the_first_start_and_every_restart_runs_it(
        tmp_path, monkeypatch, caplog):
    """The trainer's global batch on the first start's 2 workers (32 x 2) is written into
    its command once; the restart on other nodes runs the same
    words, and the trainer splits that batch over whatever workers it has."""
    caplog.set_level(logging.INFO, "launch")
    code, _, _, commands = supervised(tmp_path, monkeypatch, [(EXIT_PREEMPTED, 30), (0, 100)],
                                      listed=[node(0)], command=TRAINER)
    assert code == 0
    assert commands[0] == commands[1] == [*TRAINER, "train.global_batch=64"]
    assert "recover: the job runs on 2 nodes, 2 workers; with no replacement to be had it " \
           "can go on with no fewer nodes (cluster.min_nodes=2)" in caplog.text


def test_a_node_that_announces_a_notice_is_lost_at_once(tmp_path, monkeypatch, caplog):
    """Still `running`, its notice up (EC2 has not taken it, or stops it instead): doomed.
    notice_wait_s=3600: waiting for it to leave `running` would hang this test."""
    caplog.set_level(logging.INFO, "launch")
    code, provider, run, _ = supervised(tmp_path, monkeypatch, [(EXIT_PREEMPTED, 30), (0, 100)],
                                        listed=[node(0), node(1)], noticed={"n1"})
    assert code == 0 and provider.replaced == [["n1"]]
    assert "recover: node n1 announces a spot interruption notice" in caplog.text
    assert [t["lost"] for t in run.tries()] == [["n1"], []]


def test_without_preemptions_left_the_code_comes_back_at_once(tmp_path, monkeypatch, caplog):
    caplog.set_level(logging.INFO, "launch")
    # notice_wait_s=3600: waiting for the noticed node to go would hang this test.
    code, provider, _, _ = supervised(tmp_path, monkeypatch, [(EXIT_PREEMPTED, 30)],
                                      listed=[node(0), node(1)], max_preemptions=0)
    assert code == EXIT_PREEMPTED
    assert provider.replaced == []
    assert "no preemptions left (0 of cluster.max_preemptions=0 spent); stopping" in caplog.text


def test_a_second_preemption_beyond_the_budget_stops_the_run(tmp_path, monkeypatch, caplog):
    caplog.set_level(logging.INFO, "launch")
    code, provider, _, _ = supervised(tmp_path, monkeypatch,
                                      [(EXIT_PREEMPTED, 30), (EXIT_PREEMPTED, 60)],
                                      listed=[node(0)], max_preemptions=1, max_restarts=5)
    assert code == EXIT_PREEMPTED and provider.replaced == [["n1"]]
    assert "recover: preemption 1 of 1 (cluster.max_preemptions): exit 75 (SIGTERM) at step " \
           "30, lost n1" in caplog.text
    assert "recover: exit 75 (SIGTERM) at step 60: no preemptions left (1 of " \
           "cluster.max_preemptions=1 spent); stopping" in caplog.text
    assert caplog.messages[-1] == ("recover: the run spent 1 of 1 preemptions (cluster."
                                   "max_preemptions), 0 of 5 failures (cluster.max_restarts)")


def test_failures_and_preemptions_spend_budgets_of_their_own(tmp_path, monkeypatch, caplog):
    caplog.set_level(logging.INFO, "launch")
    code, provider, _, _ = supervised(
        tmp_path, monkeypatch, [(EXIT_PEER_LOST, 30), (EXIT_PREEMPTED, 60), (0, 100)],
        listed=[node(0)], max_preemptions=1, max_restarts=1)
    assert code == 0 and len(provider.replaced) == 2
    assert caplog.messages[-1] == ("recover: the run spent 1 of 1 preemptions (cluster."
                                   "max_preemptions), 1 of 1 failures (cluster.max_restarts)")
    # A failure beyond its budget stops the run, preemptions left or not.
    code, provider, _, _ = supervised(
        tmp_path / "again", monkeypatch, [(EXIT_PEER_LOST, 30), (EXIT_PEER_LOST, 60)],
        listed=[node(0)], max_preemptions=3, max_restarts=1)
    assert code == EXIT_PEER_LOST and len(provider.replaced) == 1
    assert "recover: exit 69 at step 60: no failures left (1 of cluster.max_restarts=1 " \
           "spent); stopping" in caplog.text


def test_a_crash_is_retried_but_not_when_it_repeats_at_the_same_step(tmp_path, monkeypatch,
                                                                    caplog):
    caplog.set_level(logging.INFO, "launch")
    every_node = [node(0), node(1)]
    code, provider, run, _ = supervised(tmp_path, monkeypatch, [(1, 40), (1, 40)],
                                        listed=every_node, max_restarts=5)
    assert code == 1 and provider.replaced == []
    assert "recover: failure 1 of 5 (cluster.max_restarts): exit 1 at step 40, lost no node " \
           "(every node still runs)" in caplog.text
    assert "recover: exit 1 at step 40: the same exit at the same step as the try before, " \
           "which looks like a bug in the job, not the machines: another try would fail " \
           "the same way; stopping" in caplog.text
    assert [t["restart"] for t in run.tries()] == ["failure", None]
    # At another step, or with another exit, it is a failure like any other.
    code, _, _, _ = supervised(tmp_path / "other", monkeypatch, [(1, 40), (1, 50), (0, 100)],
                               listed=every_node, max_restarts=5)
    assert code == 0


@pytest.mark.parametrize("verdict", [EXIT_CONFIG, EXIT_DIVERGED])
def test_the_jobs_own_verdict_is_not_retried(tmp_path, monkeypatch, verdict):
    code, provider, _, _ = supervised(tmp_path, monkeypatch, [(verdict, 0)],
                                      listed=[node(0)], max_restarts=5)
    assert code == verdict and provider.replaced == []


def test_ssh_failing_to_a_node_that_was_lost_is_a_restart(tmp_path, monkeypatch):
    error = RemoteError(node(1), "tar -xzmf -", 255, "Connection refused")
    code, provider, _, _ = supervised(tmp_path, monkeypatch, [error, (0, 100)],
                                      listed=[node(0)])
    assert code == 0
    assert provider.replaced == [["n1"]]
    with pytest.raises(RemoteError, match="Connection refused"):  # every node still runs
        supervised(tmp_path / "again", monkeypatch, [error], listed=[node(0), node(1)])


def test_a_lost_nodes_hours_stay_on_the_bill(tmp_path):
    run = RunDir(tmp_path / "run")
    run.path.mkdir()
    OmegaConf.save({"cluster": {"name": "aws_spot"}}, run.config)
    hour = 3600.0
    lost, kept, new = (dataclasses.replace(node(i), launched_at=t, price=1.0)
                       for i, t in ((1, 0.0), (0, 0.0), (9, hour)))
    run.save_nodes([kept, lost])
    run.retire([lost])
    run.save_nodes([kept, new])
    state = run.state()
    state["retired"][0]["left_at"] = hour  # lost after an hour
    run.save(retired=state["retired"], destroyed_at=2 * hour)
    run.job.mkdir()
    (run.job / "summary.json").write_text(json.dumps({
        "train_seconds": hour, "epochs": 4.0, "steps": 400, "steps_this_run": 200,
        "world_size": 2}))
    bill, training = after_run(run)[:2]
    # n0 2 h, n1 1 h until lost, n9 1 h since it came: 4 node-hours at $1.
    assert bill == f"cost: run {run.id}: 3 nodes (1 of them lost and replaced), " \
                   "4.0000 node-hours, $4.0000"
    # The last try: 1 h of 2 nodes for 2 epochs; the whole run: $4 over 4 epochs.
    assert training == ("cost: training: 3600.0 s for 2.000 epochs on 2 workers: $2.0000, "
                        "$1.0000/epoch; the whole run (start-up, restarts, idle): "
                        "$1.0000/epoch over 4.000 epochs")
