"""cluster=local for real: network namespaces with their own addresses, an sshd in each,
ssh checked against the run's known_hosts, and the documented `make launch NODES=2
CLUSTER=local ...`, typed as a user types it, training MNIST with horovodrun across them,
then nothing left on this machine."""

from __future__ import annotations

import json
import math
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from spotring.checkpoint import folder_name, manifest_name, newest_valid
from spotring.launch import config
from spotring.launch.local import netns
from spotring.launch.local.provider import LocalCluster
from spotring.launch.rundir import RunDir
from spotring.launch.ssh import RemoteError, Ssh, new_key, scan_host_keys
from tests.conftest import QUICK, REPO, run_trainer
from tests.launcher import (
    Followed,
    launch_without_replacements,
    launcher,
    leftovers,
    netns_unavailable,
    notice_node_1,
    processes,
    run_dir_of,
    steps_on_node_0,
)

WHY_NOT = netns_unavailable()
pytestmark = pytest.mark.skipif(WHY_NOT is not None, reason=WHY_NOT or "")


def test_local_nodes_are_machines_of_their_own(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the default runs_dir (runs/launch) is relative to it
    cfg = config.compose(["cluster=local", "nodes=1"])
    config.validate(cfg)
    run = RunDir.planned(cfg.runs_dir)
    assert run.path == tmp_path / "runs/launch" / run.id
    run.create(cfg)
    new_key(run.key, "test")
    cluster = LocalCluster(cfg.cluster, run)
    cluster.check()
    try:
        (node,) = cluster.create(1)
        # The node's sshd, as the check at the end would see one left behind.
        assert [p for p in processes(run.id) if f"-f {run.path}/nodes/node-0/" in p] != []
        run.save_nodes([node])
        scan_host_keys([node], run.known_hosts, timeout_s=10)
        ssh = Ssh("root", run.key, run.known_hosts)
        out = ssh.run(node, f"hostname; hostname -I; echo mine > {cluster.workdir}/file; "
                            "ls ~/.ssh | wc -l").stdout.decode().split()
        assert out == ["node-0", node.address, "0"]  # its own name, address and ~/.ssh
        assert (run.path / "nodes/node-0/work/file").read_text() == "mine\n"
        assert not (Path(cluster.workdir) / "file").exists()  # not this machine's

        (new,) = cluster.replace([node])
        assert new.id.endswith("-1") and new.address != node.address
        assert leftovers(run.id) == [new.id, cluster.names.bridge, cluster.names.veth(1)]
        # Its host key is not in known_hosts yet: ssh refuses it rather than trust it.
        with pytest.raises(RemoteError, match="Host key verification failed"):
            ssh.run(new, "true")
        scan_host_keys([new], run.known_hosts, timeout_s=10)
        assert ssh.run(new, "hostname").stdout == b"node-1\n"
    finally:
        done = cluster.destroy()
    assert done[0].startswith(f"deleted node {new.id} (stopped pids ")
    assert leftovers(run.id) == [] and processes(run.id) == []


# The local cluster's command as README.md and docs/launching.md show it, run as typed from the
# repository root, with the default runs_dir (runs/launch): shortened only by its ARGS.
README_COMMAND = 'make launch NODES=2 CLUSTER=local ARGS="train.max_steps=120"'
README_ARGS = next(w for w in shlex.split(README_COMMAND) if w.startswith("ARGS="))[5:].split()


@pytest.mark.parametrize("page", ["README.md", "docs/launching.md"])
def test_the_docs_show_the_command_the_test_runs(page):
    assert README_COMMAND in (REPO / page).read_text()


@pytest.fixture(scope="module")
def uninterrupted():
    proc = subprocess.run(README_COMMAND, shell=True, cwd=REPO, capture_output=True, text=True,
                          timeout=900)
    run = run_dir_of(proc.stdout)
    yield proc, run
    if run is not None:  # the test's run, in the checkout's runs/launch: not the user's
        shutil.rmtree(run.path)


@pytest.mark.slow
def test_the_documented_make_launch_trains_mnist_across_two_local_nodes(uninterrupted):
    proc, run = uninterrupted
    out = proc.stdout
    assert proc.returncode == 0, out[-5000:] + proc.stderr[-3000:]
    assert run.path.parent == REPO / "runs/launch"  # the default runs_dir

    # up: the hostfile from the namespaces' own addresses, their host keys.
    nodes = run.nodes()
    assert [n.address for n in nodes] == [f"{nodes[0].address[:-3]}.{10 + i}" for i in range(2)]
    assert run.hosts.read_text() == "".join(f"{n.address} slots=1\n" for n in nodes)
    assert [line.split()[0] for line in run.known_hosts.read_text().splitlines()] == [
        n.address for n in nodes]

    # run: the code copied into each node; rank 0 ran from node 0's copy and its output
    # streamed here; the results came back.
    for i in range(2):
        assert (run.path / f"nodes/node-{i}/work/trainer/__main__.py").is_file()
    assert (run.path / f"nodes/node-0/work/runs/{run.id}/summary.json").is_file()
    assert "[0]<stdout>:spotring: fast_convnet on mnist: test accuracy" in out
    summary = json.loads((run.job / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["steps"] == 120
    # The trainer's own engine under horovodrun, as under any launcher: its config's.
    assert summary["engine"] == "ddp" and summary["test_accuracy"] > 0.9
    assert sorted(p.name for p in (run.job / "checkpoints").iterdir()) == sorted(
        [folder_name(120), manifest_name(120)])  # the final one only, whole
    assert newest_valid(run.job / "checkpoints").step == 120
    assert list((run.job / "tensorboard").glob("events.out.tfevents.*"))
    records = [json.loads(line) for line in (run.job / "metrics.jsonl").read_text().splitlines()]
    assert records[-1]["kind"] == "test" and records[-1]["step"] == 120

    # down: nothing of the run on this machine; again, nothing to do.
    assert f"down: done; nothing of run {run.id} is left" in out
    assert f"cost: run {run.id}: 2 nodes" in out
    assert leftovers(run.id) == [] and processes(run.id) == []
    again = launcher("down", f"run_id={run.id}")
    assert f"nothing of run {run.id} was left to delete" in again.stdout


@pytest.mark.slow
def test_a_preempted_node_and_a_vanished_one_are_replaced_and_billed(tmp_path, uninterrupted):
    """One launch, two restarts of different causes, each within its own budget: a spot
    notice on node 1 (its metadata service, as EC2 serves one) that stays up, as it does
    until EC2 takes the node (or for good, where it stops it instead): one preemption,
    and the launcher takes node 1 down and replaces it at once, rather than resume on a
    node under notice; later the replacement vanishes without notice. The ledger bills
    every node at cluster.price for its own seconds. With engine=horovod, whose ranks
    notice a lost peer their own way (the uninterrupted run's is DDP, the trainer's
    default under horovodrun too)."""
    price, on_demand = 0.25, 1.006
    proc = subprocess.Popen(
        [sys.executable, "-m", "spotring.launch", "launch", "nodes=2", "cluster=local",
         "cluster.max_preemptions=1", "cluster.max_restarts=1", "cluster.notice_poll_s=1",
         f"cluster.price={price}", f"+cluster.on_demand_prices={{netns: {on_demand}}}",
         f"runs_dir={tmp_path}", "--", *README_ARGS, "checkpoint.every_steps=20",
         "preemption.poll_seconds=1", "engine=horovod"],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    followed = Followed(proc)
    run, names, noticed_at, metadata = notice_node_1(followed, trained=30)
    try:
        followed.wait_for(lambda: steps_on_node_0(run) >= 70)
    finally:
        metadata.close()
    # The replacement vanishes as a node does without notice: every process gone at once.
    vanished = time.time()
    netns.delete_namespace(names.ns(2), stops=((signal.SIGKILL, 5.0),))
    followed.wait_for(lambda: followed.text.count("run: the job exited with code") == 2)
    reached = steps_on_node_0(run)  # rank 0 took no step without its peer

    code, out = followed.end()
    assert code == 0, out[-6000:]
    # Node 1's rank saw the notice; every rank stopped at the same step; the launcher saw
    # the notice still up and took the node down.
    assert re.search(r"\[1\]<stderr>:.* spot terminate notice for \S+", out)
    assert f"recover: node {names.ns(1)} announces a spot interruption notice" in out
    noticed = int(re.search(r"\[0\]<stdout>:.* preempted \(.*\) at step (\d+)", out).group(1))
    resumed = [int(s) for s in re.findall(r"\[0\]<stdout>:.* resumed at step (\d+)", out)]
    assert len(resumed) == 2 and resumed[0] == noticed  # the notice's checkpoint: none lost
    assert 60 <= resumed[1] <= reached < 120  # a periodic checkpoint: the steps since, lost
    assert ("recover: the run spent 1 of 1 preemptions (cluster.max_preemptions), 1 of 1 "
            "failures (cluster.max_restarts)") in out
    assert [n.id for n in run.nodes()] == [names.ns(0), names.ns(3)]
    summary = json.loads((run.job / "summary.json").read_text())
    assert (summary["steps"], summary["world_size"], summary["engine"]) == (120, 2, "horovod")
    baseline = json.loads((uninterrupted[1].job / "summary.json").read_text())
    # Two resumes, each on fresh ranks: the same samples, within float noise of the
    # uninterrupted run (0.0022 apart seen).
    assert abs(summary["test_accuracy"] - baseline["test_accuracy"]) <= 0.003
    assert leftovers(run.id) == [] and processes(run.id) == []

    # The ledger: each node's times as the provider gave them and as it left the run,
    # billed by the second (60 s at least) at the price it was launched at.
    ledger = json.loads(run.ledger.read_text())
    state = run.state()
    provided = {n["id"]: n for n in state["retired"] + state["nodes"]}
    assert [n["id"] for n in ledger["nodes"]] == [names.ns(i) for i in (1, 2, 0, 3)]
    ends = {names.ns(0): state["destroyed_at"], names.ns(3): state["destroyed_at"]}
    launched = {n["id"]: n["launched_at"] for n in ledger["nodes"]}
    assert launched[names.ns(0)] < launched[names.ns(1)] < noticed_at < launched[names.ns(2)] \
        < vanished < launched[names.ns(3)]
    for lost, (after, before) in {names.ns(1): (noticed_at, launched[names.ns(2)]),
                                  names.ns(2): (vanished, launched[names.ns(3)])}.items():
        ends[lost] = next(n["left_at"] for n in state["retired"] if n["id"] == lost)
        assert after < ends[lost] < before  # found lost, before its replacement came
    for n in ledger["nodes"]:
        assert n["launched_at"] == provided[n["id"]]["launched_at"]
        assert n["terminated_at"] == ends[n["id"]]
        seconds = max(60, math.ceil(ends[n["id"]] - n["launched_at"]))  # whole seconds
        assert n["usd"] == pytest.approx(price * seconds / 3600, rel=1e-9)
    total = sum(price * max(60, math.ceil(ends[i] - launched[i])) / 3600 for i in ends)
    assert ledger["totals"]["usd"] == pytest.approx(total, rel=1e-9)
    assert ledger["totals"]["on_demand_usd"] == pytest.approx(total * on_demand / price)
    assert ledger["totals"]["usd_per_1000_steps"] == pytest.approx(total / 120 * 1000)
    preemption, failure = ledger["restarts"]
    assert (preemption["cause"], preemption["exit"], preemption["lost_nodes"]) == (
        "preemption", 75, [names.ns(1)])
    assert (preemption["step"], preemption["steps_redone"]) == (noticed, 0)
    assert noticed_at <= preemption["noticed_at"] <= preemption["saved_at"]
    # No wait for the node to leave `running` (cluster.notice_wait_s, 150 s): its notice
    # was enough; the wait is the replacement's making.
    assert preemption["waited_s"] < 60
    assert (failure["cause"], failure["lost_nodes"]) == ("failure", [names.ns(2)])
    assert failure["exit"] not in (0, 75) and failure["noticed_at"] is None
    assert (failure["step"], failure["steps_redone"]) == (reached, reached - resumed[1])
    assert f"cost: ledger ({run.ledger}, times UTC):" in out


# A short MNIST run with its global batch given, in float64 so that 3 workers and 1 take
# the same steps to rounding; a train record every step, a checkpoint only at the notice.
KEPT = [*QUICK, "train.max_steps=30", "train.global_batch=96", "train.dtype=float64",
        "train.threads=1", "telemetry.log_every=1", "train.eval_samples=500",
        "preemption.poll_seconds=1"]


def train_losses(metrics) -> dict[int, float]:
    """Step -> the train loss (over the whole global batch) of its last record."""
    records = [json.loads(line) for line in metrics.read_text().splitlines()
               if line.endswith("}")]
    return {r["step"]: r["loss"] for r in records if r["kind"] == "train"}


@pytest.mark.slow
def test_a_node_lost_for_good_leaves_three_that_go_on_with_the_same_global_batch(tmp_path):
    """4 nodes of 1 slot with train.global_batch=96; a spot notice on node 1, and no
    replacement to be had: the launcher takes node 1 down and goes on with the 3 left, as
    it said at the start that it could (96 over 3 is 32 each). The steps after the loss
    are those of an uninterrupted run: the same train losses, step by step."""
    reference = train_losses(run_trainer(tmp_path / "reference", *KEPT).dir / "metrics.jsonl")
    proc = launch_without_replacements(
        "launch", "nodes=4", "cluster=local", "cluster.min_nodes=3", "cluster.max_preemptions=1",
        "cluster.notice_poll_s=1", f"runs_dir={tmp_path / 'runs'}", "--", *KEPT)
    followed = Followed(proc, timeout_s=800)
    run, names, _, metadata = notice_node_1(followed, trained=8)
    try:
        code, out = followed.end()
    finally:
        metadata.close()
    assert code == 0, out[-6000:]
    assert ("recover: the job runs on 4 nodes, 4 workers; with no replacement to be had it "
            "can go on with 3 nodes (cluster.min_nodes=3)") in out
    assert "going on with 3 node(s), 3 workers (cluster.min_nodes=3)" in out, out[-6000:]
    assert [n.id for n in run.nodes()] == [names.ns(i) for i in (0, 2, 3)]
    summary = json.loads((run.job / "summary.json").read_text())
    assert (summary["world_size"], summary["global_batch"], summary["steps"]) == (3, 96, 30)
    resumed = [int(s) for s in re.findall(r"\[0\]<stdout>:.* resumed at step (\d+)", out)]
    assert len(resumed) == 1 and 8 <= resumed[0] < 30, out[-6000:]
    losses = train_losses(run.job / "metrics.jsonl")
    after = range(resumed[0] + 1, 31)
    assert [losses[s] for s in after] == pytest.approx([reference[s] for s in after], rel=1e-9)
    assert leftovers(run.id) == [] and processes(run.id) == []

