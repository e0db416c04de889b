"""The launcher's ssh to many nodes at once (launch/ssh.py's on_each), in this process,
through the stand-in ssh of harness/aws.py. Each launcher's real ssh is in
test_launch_local.py; a launch stopped by Ctrl-C, in test_launch_aws.py."""

from __future__ import annotations

import os
import queue
import threading

import pytest

from harness.aws import stand_in_ssh
from spotring.launch.provider import Node
from spotring.launch.ssh import Ssh, on_each
from spotring.polling import poll


def test_once_one_node_fails_the_others_ssh_is_killed_and_no_more_starts(tmp_path,
                                                                         monkeypatch):
    # What lets Ctrl-C (or a node's error) end a command at once: a node's ssh that started
    # a moment after it, which the Ctrl-C did not reach, would otherwise run on, and
    # Python's exit would wait for it. Node 1's ssh hangs; node 0 fails once it runs;
    # node 2 tries its ssh only after that.
    called, failed, ended = tmp_path / "ssh-called", threading.Event(), queue.Queue()
    monkeypatch.setenv("PATH", f"{stand_in_ssh(tmp_path / 'bin')}:{os.environ['PATH']}")
    monkeypatch.setenv("STAND_IN_SSH_DELAY", "600")
    monkeypatch.setenv("STAND_IN_SSH_CALLED", str(called))
    ssh = Ssh("ubuntu", tmp_path / "key", tmp_path / "known_hosts")

    def work(node: Node) -> None:
        if node.id == "n0":
            poll(lambda: called.exists() or None, timeout_s=60, interval_s=0.05,
                 what="node 1's ssh")
            raise RuntimeError("node 0 broke")
        if node.id == "n2":
            failed.wait(timeout=60)
        try:
            ssh.run(node, f"work on {node.id}")
        except Exception as e:
            ended.put((node.id, type(e).__name__))
            raise

    nodes = [Node(id=f"n{i}", address=f"192.0.2.{i}", private_address=f"10.0.0.{i}",
                  slots=1, type="g5.xlarge", zone="us-east-1a", lifecycle="spot")
             for i in range(3)]
    with pytest.raises(RuntimeError, match="node 0 broke"):
        on_each(nodes, work)
    failed.set()
    assert sorted(ended.get(timeout=60) for _ in range(2)) == [("n1", "GivenUp"),
                                                               ("n2", "GivenUp")]
    assert called.read_text() == "work on n1\n"  # node 2's never started
