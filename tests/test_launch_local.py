"""cluster=local for real: network namespaces with their own addresses, an sshd in each,
ssh checked against the run's known_hosts, and the documented `make launch NODES=2
CLUSTER=local ...`, typed as a user types it, training MNIST with horovodrun across them,
then nothing left on this machine."""

from __future__ import annotations

import json
import re
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from launch import config
from launch.local import netns
from launch.local.provider import LocalCluster
from launch.rundir import RunDir
from launch.ssh import RemoteError, Ssh, new_key, scan_host_keys
from tests.conftest import REPO
from tests.launcher import launcher, leftovers, netns_unavailable, processes

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


def run_dir_of(output: str) -> RunDir | None:
    first = [line for line in output.splitlines() if line.startswith("spotring: run ")]
    if not first:
        return None
    return RunDir(Path(re.fullmatch(r"spotring: run \S+ in (\S+)", first[0]).group(1)))


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
    assert "[0]<stdout>:spotring: convnet on mnist: test accuracy" in out
    summary = json.loads((run.job / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["steps"] == 120
    assert summary["engine"] == "horovod" and summary["test_accuracy"] > 0.9
    assert sorted(p.name for p in (run.job / "checkpoints").iterdir()) == [
        "ckpt-000000120.json", "ckpt-000000120.pt"]  # the final one only
    assert list((run.job / "tensorboard").glob("events.out.tfevents.*"))
    records = [json.loads(line) for line in (run.job / "metrics.jsonl").read_text().splitlines()]
    assert records[-1]["kind"] == "test" and records[-1]["step"] == 120

    # down: nothing of the run on this machine; again, nothing to do.
    assert f"down: done; nothing of run {run.id} is left" in out
    assert f"cost: run {run.id}: 2 nodes" in out
    assert leftovers(run.id) == [] and processes(run.id) == []
    again = launcher("down", f"run_id={run.id}")
    assert f"nothing of run {run.id} was left to delete" in again.stdout


def steps_on_node_0(run: RunDir) -> int:
    metrics = run.path / f"nodes/node-0/work/runs/{run.id}/metrics.jsonl"
    lines = metrics.read_text().splitlines() if metrics.exists() else []
    return max((json.loads(line)["step"] for line in lines if line.endswith("}")), default=0)


@pytest.mark.slow
def test_a_node_vanishes_mid_run_and_the_launcher_recovers(tmp_path, uninterrupted):
    proc = subprocess.Popen(
        [sys.executable, "-m", "launch", "launch", "nodes=2", "cluster=local",
         "cluster.max_restarts=1", f"runs_dir={tmp_path}", "--", *README_ARGS,
         "checkpoint.every_steps=20"],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: list[str] = []
    threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True).start()
    deadline = time.monotonic() + 300
    while not any(line.startswith("spotring: run ") for line in lines):
        assert proc.poll() is None and time.monotonic() < deadline, "".join(lines)
        time.sleep(0.1)
    run = run_dir_of("".join(lines))
    while steps_on_node_0(run) < 45:
        assert proc.poll() is None and time.monotonic() < deadline, "".join(lines)
        time.sleep(0.1)
    # Node 1 vanishes as a reclaimed spot instance does: no notice, every process gone.
    # Its namespace goes only once they have exited and their connections are closed, so
    # how soon rank 0 learns of it does not hang on a race with the kernel (a peer that
    # never answers again is the collective timeout's case, tests/test_failures.py).
    lost = netns.Names(run.id).ns(1)
    netns.delete_namespace(lost, stops=((signal.SIGKILL, 5.0),))

    assert proc.wait(timeout=400) == 0, "".join(lines)[-6000:]
    time.sleep(0.2)
    out = "".join(lines)
    assert "recover: restart 1 of 1: exit" in out and f"lost {lost}" in out
    resumed = int(re.search(r"resumed at step (\d+)", out).group(1))
    assert 40 <= resumed < 120  # the checkpoint of step 40 or a later one: little lost
    nodes = run.nodes()
    assert [n.id for n in nodes] == [netns.Names(run.id).ns(0), netns.Names(run.id).ns(2)]
    assert run.hosts.read_text() == "".join(f"{n.address} slots=1\n" for n in nodes)
    summary = json.loads((run.job / "summary.json").read_text())
    assert summary["steps"] == 120 and summary["world_size"] == 2
    baseline = json.loads((uninterrupted[1].job / "summary.json").read_text())
    assert abs(summary["test_accuracy"] - baseline["test_accuracy"]) <= 0.002
    assert leftovers(run.id) == [] and processes(run.id) == []
