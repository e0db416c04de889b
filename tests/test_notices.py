"""Every cloud's spot notice, and how often the ranks vote on a stop.

The metadata services are the loopback stubs of tests/imds.py, each answering as its
cloud documents; every other cloud's service is pointed at a closed port, so that the
cloud found is the stub's whatever machine the tests run on (a CI runner on Azure has a
real Azure service at 169.254.169.254). The jobs are tests/user_script.py's train.py
under torchrun, 2 workers on Gloo.
"""

from __future__ import annotations

import json
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

import spotring
from spotring import metadata
from spotring.contract import RUN_DIR
from spotring.exits import EXIT_PREEMPTED
from spotring.launch.commands import local_environment
from spotring.preemption import NOTICE_SECONDS, Decision, Preemption, vote_interval
from tests import user_script
from tests.imds import AzureStub, GCPStub, MetadataStub
from tests.test_spot import Job, OneRank, next_decision

STUBS = {"ec2": MetadataStub, "gcp": GCPStub, "azure": AzureStub}
WINDOWS = {"ec2": 120, "gcp": 30, "azure": 30}  # each cloud's documented notice


def closed_port() -> str:
    """host:port where nothing listens: a connection is refused at once."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return "{}:{}".format(*s.getsockname())


def pointed_at(stub=None, *, others=None) -> dict[str, str]:
    """The variables that point every cloud's service at ``stub`` where it is that
    cloud's, else at ``others`` (host:port; default a closed port)."""
    elsewhere = others or closed_port()
    env = {cls.variable: elsewhere if cls is GCPStub else f"http://{elsewhere}"
           for cls in STUBS.values()}
    return env | (stub.env if stub is not None else {})


@pytest.fixture
def service(request, monkeypatch):
    """The stub of the cloud ``request.param`` names, the only service that answers."""
    stub = STUBS[request.param]()
    for name, value in pointed_at(stub).items():
        monkeypatch.setenv(name, value)
    yield stub
    stub.close()


# ------------------------------------------------------------------------ the services


@pytest.mark.parametrize("service", STUBS, indirect=True)
def test_auto_finds_the_cloud_that_answers_with_its_notice_and_window(service):
    found = metadata.detect(metadata.sources("auto"))
    assert (found.cloud, found.notice_seconds) == (service.cloud, WINDOWS[found.name])
    assert found.notice() is None and not found.rebalance()
    service.announce()
    assert found.notice().startswith(f"{service.cloud} ")


@pytest.mark.parametrize("cloud", STUBS)
def test_a_service_is_taken_for_its_own_cloud_only(monkeypatch, cloud):
    # The three clouds share 169.254.169.254: each source must refuse the others' answers.
    stub = STUBS[cloud]()
    try:
        for name, value in pointed_at(others=stub.host).items():
            monkeypatch.setenv(name, value)
        found = [s.cloud for s in metadata.sources("auto") if metadata.detect([s])]
    finally:
        stub.close()
    assert found == [stub.cloud]


def test_off_every_cloud_nothing_is_found_within_a_second(monkeypatch):
    for name, value in pointed_at().items():
        monkeypatch.setenv(name, value)
    started = time.monotonic()
    assert metadata.detect(metadata.sources("auto")) is None
    assert time.monotonic() - started < 1
    assert metadata.sources("none") == []
    assert [s.name for s in metadata.sources("gcp")] == ["gcp"]


def test_gcp_flags_preemption_and_refuses_an_answer_not_signed_google():
    stub = GCPStub()
    try:
        source = metadata.GCP(stub.url)
        assert source.notice() is None
        stub.announce()
        assert source.notice() == "GCP preemption notice"
        assert stub.requests == [GCPStub.PREEMPTED] * 2
    finally:
        stub.close()
    ec2 = MetadataStub()  # 401 to a GET without its token
    try:
        with pytest.raises(OSError, match="401"):
            metadata.GCP(ec2.url).notice()
    finally:
        ec2.close()


def test_azure_acts_on_a_preempt_event_naming_this_vm_only():
    stub = AzureStub()
    try:
        source = metadata.Azure(stub.url)
        source.probe()
        stub.schedule("Freeze")  # a pause of seconds for maintenance: no notice
        stub.schedule("Preempt", vm="spot-vm_4")  # a neighbour's, in the same scale set
        assert source.notice() is None
        stub.announce()
        event = stub.events[-1]
        assert source.notice() == \
            f"Azure Preempt event {event['EventId']} not before {event['NotBefore']}"
        # The VM's name is asked once; the events at every poll.
        assert [r.split("?")[0] for r in stub.requests] == [
            "/metadata/instance/compute/name"] + ["/metadata/scheduledevents"] * 2
    finally:
        stub.close()


@pytest.mark.parametrize("service", STUBS, indirect=True)
def test_python_m_spotring_metadata_exits_0_printing_the_notice_else_1(service):
    # What `spotring launch` runs on a node over ssh (launch/notice.py): no torch loaded.
    def ask() -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-X", "importtime", "-m", "spotring.metadata"],
                              env=local_environment(), capture_output=True, text=True,
                              timeout=30)

    quiet = ask()
    service.announce()
    doomed = ask()
    assert (quiet.returncode, quiet.stdout) == (1, ""), quiet.stderr[-3000:]
    assert doomed.returncode == 0 and doomed.stdout.startswith(f"{service.cloud} "), \
        doomed.stdout + doomed.stderr[-3000:]
    assert not re.search(r"\| +torch\b", doomed.stderr)


def test_an_unknown_source_is_refused_naming_the_valid_ones():
    assert spotring.PreemptionOptions(notices="aws").problems("preemption.") == [
        "preemption.notices=aws: unknown; valid: auto, ec2, gcp, azure, none"]


@pytest.mark.parametrize("service", ["gcp", "azure"], indirect=True)
def test_the_watcher_stops_on_the_clouds_notice_and_knows_its_window(service):
    watcher = Preemption(spotring.PreemptionOptions(poll_seconds=0.05), OneRank(),
                         local_rank=0)
    try:
        assert watcher.notice_seconds == NOTICE_SECONDS  # EC2's, until a service answers
        deadline = time.monotonic() + 10
        while watcher.source is None and time.monotonic() < deadline:
            time.sleep(0.01)
        assert watcher.notice_seconds == 30
        service.announce()
        assert next_decision(watcher).stop.startswith(f"{service.cloud} ")
    finally:
        watcher.close()
        watcher.restore_signals()


# ------------------------------------------------------------------- notices in a job


def start(tmp_path, env: dict[str, str], *args: str) -> Job:
    """train.py of tests/user_script.py under torchrun, 2 workers, with ``args``; its
    run directory tmp_path/run."""
    project = user_script.write_project(tmp_path / "project")
    run_dir = tmp_path / "run"
    return Job(run_dir, [], {RUN_DIR: str(run_dir), **env}, launcher="torchrun",
               command=[sys.executable, "train.py", "--save-every", "100000", *args],
               cwd=project)


def stopped_at(run) -> int:
    """The one step both ranks stopped at, exiting 75 (the reason of the rank without the
    notice: the others' vote)."""
    steps = set(re.findall(rf"preempted \(.*\) at step (\d+); exit {EXIT_PREEMPTED}",
                           run.output))
    assert len(steps) == 1 and "another rank received a notice" in run.output, \
        run.output[-6000:]
    assert f"exitcode  : {EXIT_PREEMPTED}" in run.output, run.output[-6000:]  # torchrun's
    return int(steps.pop())


@pytest.mark.slow
@pytest.mark.parametrize("service", ["gcp", "azure"], indirect=True)
def test_a_notice_stops_every_rank_at_one_step_with_a_checkpoint_and_exit_75(
        tmp_path, service):
    job = start(tmp_path, pointed_at(service), "--steps", "3000", "--sleep", "0.005",
                "--poll-seconds", "0.1")
    job.wait_for_step(20)
    announced = time.time()
    service.announce()
    run = job.finish()
    step = stopped_at(run)
    note = json.loads((run.dir / "preempted.json").read_text())
    assert note["step"] == step and note["reason"].startswith(f"{service.cloud} "), note
    assert f"ckpt-{step:09d}" in note["checkpoint"] and Path(note["checkpoint"]).exists()
    assert f"watching {service.cloud}'s metadata service at {service.url}" in run.output
    assert f"spotring: {note['reason']}\n" in run.output, run.output[-6000:]  # the watcher's
    assert 0 < note["noticed_at"] - announced < 5, note  # polled every 0.1 s


@pytest.mark.slow
def test_automatic_votes_grow_apart_on_fast_steps_and_a_sigterm_stops_both_at_one_step(
        tmp_path):
    job = start(tmp_path, pointed_at(), "--steps", "200000")
    job.wait_for_step(400)  # the interval has grown from 1 with the measures
    ranks = subprocess.run(["pgrep", "-P", str(job.proc.pid)], capture_output=True,
                           text=True, timeout=10).stdout.split()
    assert len(ranks) == 2, ranks
    signalled = job.steps_done()
    subprocess.run(["kill", "-TERM", ranks[-1]], check=True)  # one rank, as the OS does
    run = job.finish()
    step = stopped_at(run)
    interval = int(re.search(r"the ranks agreed to stop \(votes every (\d+) steps\)",
                             run.output).group(1))
    assert interval > 1, run.output[-6000:]
    print(f"\nvotes every {interval} steps; SIGTERM after step {signalled}, stopped at {step}")
    assert signalled <= step and json.loads((run.dir / "preempted.json").read_text())["step"] \
        == step


# ------------------------------------------------------------------ the vote's interval


@pytest.mark.parametrize("step_ms, vote_ms, interval", [
    (16, 0.8, 5),      # the CPU step: a vote each step cost 5%, every 5th 1%
    (200, 1, 1),       # a GPU step: every step costs 0.5% already
    (1, 0.5, 50),
    (10, 200, 100),    # a vote that costs 20 steps: one a second all the same
    (2000, 1, 1),      # steps longer than a second: every one
    (0, 0.1, 10**7),   # two calls within the clock's resolution: no division by zero
])
def test_the_interval_keeps_the_vote_near_1_percent_within_a_second(step_ms, vote_ms,
                                                                     interval):
    assert vote_interval(step_ms / 1000, vote_ms / 1000) == interval


class TwoRanks:
    """Two ranks' engines in one process: the n-th sum of each rank is the sum of both
    ranks' n-th tensors, as a collective's; rank r's sends take ``send_ms[r]``."""

    def __init__(self, *send_ms: float) -> None:
        self.sent: list[list] = [[], []]
        self.send_ms = send_ms

    def engine(self, rank: int):
        pair = self

        class Engine(OneRank):
            world_size = 2

            def start_sum(self, tensor, name):
                time.sleep(pair.send_ms[rank] / 1000)
                n = len(pair.sent[rank])
                pair.sent[rank].append(tensor.clone())
                return lambda: pair.sent[0][n] + pair.sent[1][n]
        return Engine()


def test_ranks_that_measure_apart_vote_at_the_same_steps_and_stop_at_one():
    pair = TwoRanks(0.4, 0.2)
    ranks = [Preemption(spotring.PreemptionOptions(notices="none"), pair.engine(r),
                        local_rank=1) for r in (0, 1)]
    try:
        intervals, decisions = [], []
        for step in range(1, 5000):  # to the stop, a vote interval after the notice
            if step == 500:
                ranks[1]._notice("SIGTERM")
            decisions.append([rank.decide() for rank in ranks])
            intervals.append([rank.interval for rank in ranks])
            time.sleep(0.0005)  # a fast step
            if decisions[-1][0].stop:
                break
    finally:
        for rank in reversed(ranks):
            rank.close()
            rank.restore_signals()
    assert len(pair.sent[0]) == len(pair.sent[1])  # every vote was both ranks'
    assert all(a == b for a, b in intervals) and max(a for a, _ in intervals) > 1
    stop = len(decisions)
    assert decisions[-1] == [Decision("another rank received a notice", False),
                             Decision("SIGTERM", False)]
    assert 500 < stop <= 500 + intervals[499][0] + 1, (stop, intervals[499])
    # A decision is never undone: the next calls answer the same, with no more votes.
    assert [rank.decide().stop for rank in ranks] == [d.stop for d in decisions[-1]]
