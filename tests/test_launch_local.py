"""cluster=local for real: network namespaces with their own addresses, an sshd in each,
ssh checked against the run's known_hosts, and the documented `make launch NODES=2
CLUSTER=local ...`, typed as a user types it, training MNIST with horovodrun across them,
then nothing left on this machine: one launch, read by several tests. (A launch through
a notice and lost nodes: tests/test_launch_command.py.)"""

from __future__ import annotations

import json
import shlex
import shutil
import socket
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from harness.cores import cores
from harness.launcher import (
    launcher,
    leftovers,
    netns_unavailable,
    processes,
    run_dir_of,
)
from spotring.checkpoint.layout import folder_name, manifest_name, newest_valid
from spotring.launch import config
from spotring.launch.local import netns
from spotring.launch.local.provider import FIRST_HOST, LocalCluster
from spotring.launch.rundir import RunDir
from spotring.launch.ssh import RemoteError, Ssh, new_key, scan_host_keys
from tests.conftest import REPO

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


def test_the_other_nodes_reach_this_machine_at_once_after_a_node_is_deleted():
    """A node lost (or replaced) must not cut the others off from this machine, where the
    launcher's ssh to node 0 runs: the node deleted here is the one whose port on the
    bridge has the lowest MAC address, which a bridge without an address of its own would
    have taken, and changed when it went, leaving the others' ARP entries pointing
    nowhere for most of a minute."""
    names = netns.Names("test-bridge-" + uuid.uuid4().hex[:8])
    subnet = netns.free_subnet("10.213.0.0/16", names.bridge)
    host = str(subnet[1])
    try:
        netns.add_bridge(names.bridge, f"{host}/{subnet.prefixlen}")
        for i in (0, 1):
            netns.add_node(names.ns(i), names.veth(i), names.peer(i), names.bridge,
                           f"{subnet[FIRST_HOST + i]}/{subnet.prefixlen}")
        mac = {i: Path(f"/sys/class/net/{names.veth(i)}/address").read_text() for i in (0, 1)}
        lowest = min(mac, key=mac.get)
        with socket.create_server((host, 0)) as server:
            def connect(i: int) -> subprocess.CompletedProcess:
                return subprocess.run(
                    ["ip", "netns", "exec", names.ns(i), sys.executable, "-c",
                     f"import socket; socket.create_connection(({host!r}, "
                     f"{server.getsockname()[1]}), timeout=2)"], capture_output=True, text=True)
            survivor = 1 - lowest
            assert connect(survivor).returncode == 0  # its ARP entry for this machine, made
            netns.delete_namespace(names.ns(lowest))
            done = connect(survivor)
        assert done.returncode == 0, done.stderr
    finally:
        for ns in netns.namespaces(names.ns_prefix):
            netns.delete_namespace(ns)
        for link in netns.links(names.link_prefix):
            netns.delete_link(link)


# The local cluster's command as README.md and docs/launching.md show it, run as typed from the
# repository root, with the default runs_dir (runs/launch): shortened only by its ARGS.
README_COMMAND = 'make launch NODES=2 CLUSTER=local ARGS="train.max_steps=120"'
README_ARGS = next(w for w in shlex.split(README_COMMAND) if w.startswith("ARGS="))[5:].split()


@pytest.mark.parametrize("page", ["README.md", "docs/launching.md"])
def test_the_docs_show_the_command_the_test_runs(page):
    assert README_COMMAND in (REPO / page).read_text()


@pytest.fixture(scope="module")
def documented():
    """The documented command run to its end; its process and run, for the tests to read;
    then the run's directory, in the checkout's runs/launch, removed: it is the test's."""
    with cores():
        proc = subprocess.run(README_COMMAND, shell=True, cwd=REPO, capture_output=True,
                              text=True, timeout=900)
    run = run_dir_of(proc.stdout)
    try:
        assert proc.returncode == 0, proc.stdout[-5000:] + proc.stderr[-3000:]
        yield proc, run
    finally:
        if run is not None:
            shutil.rmtree(run.path)


@pytest.mark.slow
def test_up_writes_the_hostfile_and_known_hosts_from_the_nodes_own_addresses(documented):
    _, run = documented
    assert run.path.parent == REPO / "runs/launch"  # the default runs_dir
    nodes = run.nodes()
    assert [n.address for n in nodes] == [f"{nodes[0].address[:-3]}.{10 + i}" for i in range(2)]
    assert run.hosts.read_text() == "".join(f"{n.address} slots=1\n" for n in nodes)
    assert [line.split()[0] for line in run.known_hosts.read_text().splitlines()] == [
        n.address for n in nodes]


@pytest.mark.slow
def test_the_code_goes_to_each_node_and_rank_0s_output_and_results_come_back(documented):
    proc, run = documented
    for i in range(2):
        assert (run.path / f"nodes/node-{i}/work/trainer/__main__.py").is_file()
    assert (run.path / f"nodes/node-0/work/runs/{run.id}/summary.json").is_file()
    assert "[0]<stdout>:spotring: fast_convnet on mnist: test accuracy" in proc.stdout
    assert sorted(p.name for p in (run.job / "checkpoints").iterdir()) == sorted(
        [folder_name(120), manifest_name(120)])  # the final one only, whole
    assert newest_valid(run.job / "checkpoints").step == 120
    assert list((run.job / "tensorboard").glob("events.out.tfevents.*"))
    records = [json.loads(line) for line in (run.job / "metrics.jsonl").read_text().splitlines()]
    assert records[-1]["kind"] == "test" and records[-1]["step"] == 120


@pytest.mark.slow
def test_the_documented_make_launch_trains_mnist_across_two_local_nodes(documented):
    _, run = documented
    summary = json.loads((run.job / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["steps"] == 120
    # The trainer's own engine under horovodrun, as under any launcher: its config's.
    assert summary["engine"] == "ddp" and summary["test_accuracy"] > 0.9


@pytest.mark.slow(cores=1)
def test_down_leaves_nothing_and_says_so_when_asked_again(documented):
    proc, run = documented
    assert f"down: done; nothing of run {run.id} is left" in proc.stdout
    assert f"cost: run {run.id}: 2 nodes" in proc.stdout
    assert leftovers(run.id) == [] and processes(run.id) == []
    again = launcher("down", f"run_id={run.id}")
    assert f"nothing of run {run.id} was left to delete" in again.stdout
