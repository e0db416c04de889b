"""What being ready for a lost node costs a job where none is lost: step time and memory
of the same DDP job, in place (spotring.init(in_place="auto") with a rendezvous store)
and not, side by side in one run:

    .venv/bin/python benchmarks/results/in-place-ready/measure.py [REPEATS]

Each repeat runs both modes, in turn (the order alternating): 2 ranks spawned as the
tests spawn them (harness/ranks.py), one thread each, a small convnet on MNIST-shaped
random data in memory, SGD, global batch 128, spotring's own vote interval, 300 steps;
rank 0 times steps 100 to 300 (after warm-up, and after the in-place vote has measured
its interval). Every rank reports its peak resident memory. Writes results.json beside
this file and prints a line per run and the medians.
"""

import json
import os
import re
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

import torch  # noqa: E402
from torch import nn  # noqa: E402

import spotring  # noqa: E402
from harness.ranks import Ranks  # noqa: E402
from spotring.launch.commands import BIN  # noqa: E402

STEPS, TIMED_FROM, GLOBAL_BATCH = 300, 100, 128


def convnet() -> nn.Module:
    return nn.Sequential(nn.Conv2d(1, 32, 3), nn.ReLU(), nn.Conv2d(32, 64, 3), nn.ReLU(),
                         nn.MaxPool2d(2), nn.Flatten(), nn.Linear(9216, 128), nn.ReLU(),
                         nn.Linear(128, 10))


def train(in_place: bool) -> None:
    """One rank's job: prints ``timed S`` (rank 0) and ``rss MB`` (every rank)."""
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(4096, 1, 28, 28, generator=g),
                                          torch.randint(0, 10, (4096,), generator=g))
    with spotring.init(seed=0, notices="none", **({"in_place": "auto"} if in_place else {})
                       ) as job:
        loader = job.loader(data, GLOBAL_BATCH)
        model, optimizer = job.wrap(convnet(), lambda p: torch.optim.SGD(p, lr=0.01))
        job.track(model=model, optimizer=optimizer, loader=loader)
        started = None
        for _ in loader.epochs(-(-STEPS // loader.steps_per_epoch)):
            for x, y in loader:
                loss = nn.functional.cross_entropy(model(x), y)
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
                job.should_stop()
                if job.step_count == TIMED_FROM:
                    started = time.perf_counter()
                if job.step_count >= STEPS:
                    break
            if job.step_count >= STEPS:
                break
        if job.is_main:
            print(f"timed {time.perf_counter() - started!r}", flush=True)
        print(f"rss {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.1f}",
              flush=True)


def run(tmp: Path, name: str, in_place: bool) -> dict:
    env = dict(os.environ)
    server = None
    if in_place:
        server = subprocess.Popen([str(BIN / "spotring"), "rendezvous", "--host",
                                   "127.0.0.1", "--port", "0"], stdout=subprocess.PIPE,
                                  text=True)
        env["SPOTRING_RENDEZVOUS"] = re.search(r"at (\S+)", server.stdout.readline())[1]
    try:
        with Ranks(tmp / name, 2, train, env=env, in_place=in_place) as job:
            codes = job.wait(900)
            output = job.output()
    finally:
        if server is not None:
            server.kill()
            server.wait()
    assert codes == [0, 0], output[-3000:]
    seconds = float(re.search(r"^timed (\S+)$", output, re.M)[1])
    return {"mode": "in place" if in_place else "off",
            "step_ms": 1000 * seconds / (STEPS - TIMED_FROM),
            "rss_mb": [float(m) for m in re.findall(r"^rss (\S+)$", output, re.M)]}


def main(repeats: int) -> None:
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(repeats):
            for in_place in ((False, True) if i % 2 == 0 else (True, False)):
                row = run(Path(tmp), f"{i}-{in_place}", in_place) | {"repeat": i}
                print(json.dumps(row), flush=True)
                rows.append(row)
    median = {mode: statistics.median(r["step_ms"] for r in rows if r["mode"] == mode)
              for mode in ("off", "in place")}
    ratios = [b["step_ms"] / a["step_ms"] for a, b in zip(
        [r for r in rows if r["mode"] == "off"], [r for r in rows if r["mode"] == "in place"],
        strict=True)]
    summary = {"median_step_ms": median, "ratio_by_repeat": ratios,
               "machine": os.uname().nodename, "torch": torch.__version__,
               "cpus": os.cpu_count(), "command": " ".join(sys.argv)}
    print(json.dumps(summary), flush=True)
    (Path(__file__).parent / "results.json").write_text(
        json.dumps({"runs": rows, "summary": summary}, indent=2) + "\n")


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 3)
