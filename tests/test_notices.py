"""Every cloud's spot notice, and how often the ranks vote on a stop.

The metadata services are the loopback stubs of harness/imds.py, each answering as its
cloud documents; every other cloud's service is pointed at a closed port, so that the
cloud found is the stub's whatever machine the tests run on (a CI runner on Azure has a
real Azure service at 169.254.169.254). Each cloud's notice stopping the ranks of a job
at one step: tests/test_resume.py.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import re
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from urllib.parse import parse_qs, urlsplit

import pytest

import spotring
from harness.imds import STUBS, AzureStub, GCPStub, MetadataStub, pointed_at
from harness.watcher import OneRank, next_decision
from spotring import metadata
from spotring.launch.commands import local_environment
from spotring.polling import poll
from spotring.preemption import NOTICE_SECONDS, Decision, Preemption, vote_interval

WINDOWS = {"ec2": 120, "gcp": 30, "azure": 30}  # each cloud's documented notice


@pytest.fixture
def only(monkeypatch) -> Iterator[Callable]:
    """only(stub): ``stub``, made the only service that answers, and closed after the
    test."""
    stubs = []

    def serve(stub):
        for name, value in pointed_at(stub).items():
            monkeypatch.setenv(name, value)
        stubs.append(stub)
        return stub

    yield serve
    for stub in stubs:
        stub.close()


@pytest.fixture
def service(request, only):
    """The stub of the cloud ``request.param`` names, the only service that answers."""
    return only(STUBS[request.param]())


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


@contextlib.contextmanager
def watching(**options) -> Iterator[Preemption]:
    """Local rank 0's watcher, with PreemptionOptions ``options``, once it has found the
    service that answers."""
    watcher = Preemption(spotring.PreemptionOptions(**options), OneRank(), local_rank=0)
    try:
        # Nothing about the window before the source is found: the watcher's thread may
        # have found it already (test_the_window_is_ec2s_until_a_service_answers).
        deadline = time.monotonic() + 30
        while watcher.source is None:
            assert time.monotonic() < deadline, "no metadata service found in 30 s"
            time.sleep(0.01)
        yield watcher
    finally:
        watcher.close()
        watcher.restore_signals()


class HeldGCPStub(GCPStub):
    """GCP's server, answering nothing until the test opens it: the watcher's probes
    time out (and are tried again) until then."""

    def __init__(self) -> None:
        self.asked, self.opened = threading.Event(), threading.Event()
        super().__init__()

    def answer(self, method, path, headers):
        self.asked.set()
        self.opened.wait(60)
        return super().answer(method, path, headers)

    def close(self) -> None:
        self.opened.set()  # the held requests end, and the server with them
        super().close()


def test_the_window_is_ec2s_until_a_service_answers(only, monkeypatch):
    # Only while no service can have answered is the window the watcher starts with
    # observable: its thread looks for the service from the moment it is made.
    monkeypatch.setattr("spotring.preemption._FIND_SECONDS", 60)  # however slow the probes
    stub = only(HeldGCPStub())
    with contextlib.ExitStack() as stack:
        watcher = Preemption(spotring.PreemptionOptions(notices="gcp", poll_seconds=0.05),
                             OneRank(), local_rank=0)
        stack.callback(watcher.restore_signals)
        stack.callback(watcher.close)
        assert stub.asked.wait(30), "the watcher's probe never came"
        assert watcher.source is None and watcher.notice_seconds == NOTICE_SECONDS
        stub.opened.set()
        poll(lambda: watcher.source, timeout_s=30, interval_s=0.01,
             what="the watcher to find GCP's server once it answers")
        assert watcher.notice_seconds == WINDOWS["gcp"]
    # Where none answers, and on a rank that does not watch, it stays EC2's.
    for name, value in pointed_at().items():
        monkeypatch.setenv(name, value)
    for local_rank in (0, 1):
        watcher = Preemption(spotring.PreemptionOptions(), OneRank(), local_rank=local_rank)
        try:
            assert watcher.notice_seconds == NOTICE_SECONDS
        finally:
            watcher.close()
            watcher.restore_signals()


@pytest.mark.parametrize("service", STUBS, indirect=True)
def test_the_watcher_sees_each_clouds_notice_within_a_second_and_knows_its_window(service):
    with watching() as watcher:  # the defaults: EC2 and Azure polled every 0.5 s
        assert watcher.notice_seconds == WINDOWS[watcher.source.name]
        if isinstance(service, GCPStub):
            service.until_held()
        announced = time.time()
        service.announce()
        assert next_decision(watcher).stop.startswith(f"{service.cloud} ")
    assert 0 < watcher.noticed_at - announced < 1


def test_the_watchers_lines_are_logged_by_the_training_thread_at_its_next_step(only,
                                                                            caplog):
    # From the watcher's own thread, a line could land inside one that the script prints;
    # but the notice is said at once, the one live sign of it while a step holds the
    # training thread.
    caplog.set_level(logging.INFO, "spotring")
    stub = only(GCPStub("refused"))  # the source has a line of its own to say, too
    with watching(notices="gcp", poll_seconds=0.05) as watcher:
        stub.announce()
        poll(lambda: None if "spot-notice-watcher" in [t.name for t in threading.enumerate()]
             else True, timeout_s=30, interval_s=0.01, what="the watcher to end at the notice")
        assert [(r.threadName, r.levelname, r.getMessage()) for r in caplog.records] == [
            ("spot-notice-watcher", "WARNING", "GCP preemption notice")]
        caplog.clear()
        assert next_decision(watcher).stop == "GCP preemption notice"
    assert {r.threadName for r in caplog.records} == {"MainThread"}
    said = [(r.levelname, r.getMessage()) for r in caplog.records]
    assert said[0] == ("INFO", f"watching GCP's metadata service at {stub.url} for spot "
                               "notices with requests it holds until its notice changes")
    assert said[1][0] == "INFO" and said[1][1].startswith(
        f"GCP's metadata server at {stub.url} failed a request held until its preempted "
        "flag changes (HTTP 400 Bad Request")


def test_gcp_answers_a_held_request_the_moment_the_flag_rises(only, caplog):
    caplog.set_level(logging.INFO, "spotring")
    stub = only(GCPStub())
    unchanged = stub.etag
    # A poll every 30 s could not see the flag within a second: only a held request.
    with watching(notices="gcp", poll_seconds=30) as watcher:
        stub.until_held()
        announced = stub.announce()
        assert next_decision(watcher).stop == "GCP preemption notice"
    probe, (held, came, answered) = stub.exchanges
    assert probe[0] == GCPStub.PREEMPTED  # a plain request first: the flag and its ETag
    assert came < announced <= answered < announced + 1
    assert urlsplit(held).path == GCPStub.PREEMPTED and parse_qs(urlsplit(held).query) == {
        "wait_for_change": ["true"], "last_etag": [unchanged],
        "timeout_sec": [str(metadata.GCP.HOLD_SECONDS)]}
    assert f"watching GCP's metadata service at {stub.url} for spot notices with " \
           "requests it holds until its notice changes" in caplog.text


def test_gcp_answers_at_once_a_change_made_between_two_requests():
    # last_etag names what the watcher saw last: a held request without it would wait
    # for the next change, and miss this one.
    stub = GCPStub()
    try:
        source = metadata.GCP(stub.url)
        assert source.notice() is None and source.holds
        stub.announce()
        assert source.wait() == "GCP preemption notice"
    finally:
        stub.close()
    held, came, answered = stub.exchanges[-1]
    assert "wait_for_change=true" in held and answered - came < 1


def test_gcp_answers_at_once_a_flag_up_before_the_first_request():
    # The probe saw it (a VM preempted as the job starts): no request waits for a change.
    stub = GCPStub()
    try:
        stub.announce()
        source = metadata.GCP(stub.url)
        source.probe()
        assert not source.holds and source.wait() == "GCP preemption notice"
    finally:
        stub.close()
    assert stub.requests == [GCPStub.PREEMPTED] * 2


@pytest.mark.parametrize("wait_for_change", ["ignored", "refused"])
def test_a_gcp_server_that_will_not_hold_a_request_is_polled(only, caplog, monkeypatch,
                                                             wait_for_change):
    caplog.set_level(logging.INFO, "spotring")
    stub = only(GCPStub(wait_for_change))
    poll = 0.05
    asks = []  # when the watcher asked (its clock), and how many requests the stub had had
    wait = metadata.GCP.wait

    def asking(source):
        asks.append((time.monotonic(), len(stub.requests)))
        return wait(source)

    monkeypatch.setattr(metadata.GCP, "wait", asking)
    with watching(notices="gcp", poll_seconds=poll) as watcher:
        deadline = time.monotonic() + 30
        while len(stub.requests) < 10:  # polled a while
            assert time.monotonic() < deadline, stub.requests
            time.sleep(0.01)
        stub.announce()
        assert next_decision(watcher).stop == "GCP preemption notice"
    # One request an interval, not one after the other as fast as they are answered:
    # timed where the watcher asks. (Where the stub receives them, a request that a busy
    # machine delayed past its interval is followed at once, rightly, by the next.)
    asked = [t for t, _ in asks]
    assert min(b - a for a, b in itertools.pairwise(asked)) > poll / 2, asked
    # One request an ask (the first: two where the held one was refused); the watcher's
    # thread has ended, so the stub has had them all.
    had = [n for _, n in asks] + [len(stub.requests)]
    assert [b - a for a, b in itertools.pairwise(had)] == \
        [2 if wait_for_change == "refused" else 1] + [1] * (len(asks) - 1), stub.requests
    if wait_for_change == "refused":  # tried once, then plain requests
        assert sum("wait_for_change" in path for path in stub.requests) == 1, stub.requests
        assert f"GCP's metadata server at {stub.url} failed a request held until its " \
               "preempted flag changes (HTTP 400 Bad Request" in caplog.text


def test_close_ends_a_held_request_at_once(only):
    stub = only(GCPStub())
    with watching(notices="gcp") as watcher:
        stub.until_held()
        started = time.monotonic()
        watcher.close()  # while the server holds its request, for up to a minute
        took = time.monotonic() - started
    assert "spot-notice-watcher" not in [t.name for t in threading.enumerate()]
    assert took < 1
    assert stub.holding == 1 and not stub.preempted  # nothing answered it


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
