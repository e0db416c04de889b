"""How long a spot notice takes to stop a job, per cloud, against the loopback stubs of
harness/imds.py, and what watching for one costs:

    .venv/bin/python benchmarks/results/notice-gap/measure.py [REPEATS] [CPU_SECONDS]

The gap: 2 ranks of harness/workloads.py's residual (harness/ranks.py; steps of about 10 ms,
the ranks voting at spotring's automatic interval) with one cloud's stub the only
service that answers, PreemptionOptions' defaults; once rank 0 watches it, the notice is
announced at a random moment of a poll interval. Each run gives the seconds from the
announcement to rank 0's watcher seeing it (preempted.json's noticed_at) and to rank 0's
"the ranks agreed to stop" line (its log read every millisecond). REPEATS runs per
cloud (default 5), and as many of GCP polled every 5 s, as the watcher did before it
held requests (the stub ignoring wait_for_change, poll_seconds=5).

The cost: one watcher (spotring.preemption.Preemption, local rank 0) on each stub for
CPU_SECONDS (default 60), its thread's CPU time (CLOCK_THREAD_CPUTIME_ID) and the
requests it made, per hour.

Prints a line per figure; writes results.json beside this file.
"""

import json
import os
import random
import sys
import tempfile
import threading
import time
from pathlib import Path
from unittest import mock

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

import spotring  # noqa: E402
from spotring.preemption import Preemption  # noqa: E402
from harness import workloads  # noqa: E402
from harness.imds import STUBS, GCPStub, pointed_at  # noqa: E402
from harness.ranks import Ranks  # noqa: E402
from harness.watcher import OneRank  # noqa: E402

POLL_SECONDS = spotring.PreemptionOptions().poll_seconds
AGREED = "spotring: the ranks agreed to stop"


def gap(stub, root: Path, cloud: str, poll_seconds: float) -> dict:
    """One run of 2 ranks stopped by ``stub``'s notice: the seconds to rank 0's watcher
    seeing it and to the ranks' agreement."""
    run_dir = root / f"{cloud}-{time.monotonic_ns()}"
    with Ranks(run_dir, 2, workloads.residual, env=pointed_at(stub), steps=10**6,
               save_every=10**6, sleep=0.01, poll_seconds=poll_seconds) as job:
        assert job.until(lambda: f"watching {stub.cloud}'s" in job.output(0),
                         "the watcher's first line", timeout=120)
        assert job.until(lambda: job.step() >= 200, "step 200")  # the votes' interval settled
        time.sleep(random.uniform(0, poll_seconds))  # any moment of a poll interval
        announced = time.time()
        stub.announce()
        while AGREED not in job.output(0):
            assert job.running() == [0, 1], job.output()[-5000:]
            time.sleep(0.001)
        agreed = time.time()
        codes = job.wait()
        assert codes == [75, 75], job.output()[-5000:]
    note = json.loads((run_dir / "preempted.json").read_text())
    return {"cloud": cloud, "poll_seconds": poll_seconds, "step": note["step"],
            "seen_s": note["noticed_at"] - announced, "agreed_s": agreed - announced}


def cost(stub, cloud: str, seconds: float) -> dict:
    """The watcher's CPU seconds and requests per hour on ``stub``, over ``seconds``."""
    with mock.patch.dict(os.environ, pointed_at(stub)):
        watcher = Preemption(spotring.PreemptionOptions(notices=cloud), OneRank(),
                             local_rank=0)
    try:
        while watcher.source is None:
            time.sleep(0.01)
        thread = next(t for t in threading.enumerate() if t.name == "spot-notice-watcher")
        clock = time.pthread_getcpuclockid(thread.ident)
        cpu, asked, started = time.clock_gettime(clock), len(stub.requests), time.monotonic()
        time.sleep(seconds)
        cpu = time.clock_gettime(clock) - cpu
        asked = len(stub.requests) - asked
        elapsed = time.monotonic() - started
    finally:
        watcher.close()
        watcher.restore_signals()
    return {"cloud": cloud, "seconds": elapsed, "cpu_s_per_hour": cpu * 3600 / elapsed,
            "requests_per_hour": asked * 3600 / elapsed}


def measured(make, measure, *args) -> dict:
    """``measure(stub, *args)`` of a new stub from ``make()``, closed after."""
    stub = make()
    try:
        return measure(stub, *args)
    finally:
        stub.close()


def main(repeats: int, cpu_seconds: float) -> None:
    results: dict = {"gap": [], "cost": []}
    runs = [(cloud, cls, POLL_SECONDS) for cloud, cls in STUBS.items()]
    runs.append(("gcp, polled every 5 s", lambda: GCPStub("ignored"), 5.0))
    with tempfile.TemporaryDirectory() as tmp:
        for cloud, make, poll_seconds in runs:
            for _ in range(repeats):
                row = measured(make, gap, Path(tmp), cloud, poll_seconds)
                print(json.dumps(row), flush=True)
                results["gap"].append(row)
    for cloud, cls in STUBS.items():
        row = measured(cls, cost, cloud, cpu_seconds)
        print(json.dumps(row), flush=True)
        results["cost"].append(row)
    (Path(__file__).parent / "results.json").write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 5,
         float(sys.argv[2]) if len(sys.argv) > 2 else 60.0)
