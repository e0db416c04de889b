"""What being ready for a lost node costs a job where none is lost: step time and memory
of the same DDP job, in place (spotring.init(in_place="auto") with a rendezvous store)
and not, side by side in one run:

    .venv/bin/python benchmarks/results/in-place-ready/measure.py [REPEATS] [--model M]

Each repeat runs both modes, in turn (the order alternating): 2 ranks spawned as the
tests spawn them (harness/ranks.py), one thread each, MNIST-shaped random data in memory,
SGD, global batch 128, spotring's own vote interval. ``--model convnet`` (the default:
1.2 M parameters, 300 steps, rank 0 timing steps 100 to 300, after warm-up and after
the in-place vote has measured its interval) is for step time; ``--model mlp`` (70.4 M
parameters, 282 MB, SGD with momentum, 20 steps) for memory, where a second copy of the
model's or the optimizer's state would show. Every rank reports its peak resident
memory. Writes results.json (results-mlp.json) beside this file and prints a line per
run and the medians.
"""

import argparse
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

GLOBAL_BATCH = 128


def convnet() -> nn.Module:
    return nn.Sequential(nn.Conv2d(1, 32, 3), nn.ReLU(), nn.Conv2d(32, 64, 3), nn.ReLU(),
                         nn.MaxPool2d(2), nn.Flatten(), nn.Linear(9216, 128), nn.ReLU(),
                         nn.Linear(128, 10))


def mlp() -> nn.Module:
    width = 4096
    hidden = [m for _ in range(4) for m in (nn.Linear(width, width), nn.ReLU())]
    return nn.Sequential(nn.Flatten(), nn.Linear(784, width), nn.ReLU(), *hidden,
                         nn.Linear(width, 10))


# model: (its maker, steps, the first step timed, SGD's momentum: a state as large as the
# model's, where the memory is measured)
MODELS = {"convnet": (convnet, 300, 100, 0.0), "mlp": (mlp, 20, 10, 0.9)}


def train(in_place: bool, name: str) -> None:
    """One rank's job: prints ``timed S`` (rank 0) and ``rss MB`` (every rank)."""
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(4096, 1, 28, 28, generator=g),
                                          torch.randint(0, 10, (4096,), generator=g))
    with spotring.init(seed=0, notices="none", **({"in_place": "auto"} if in_place else {})
                       ) as job:
        loader = job.loader(data, GLOBAL_BATCH)
        make, steps, timed_from, momentum = MODELS[name]
        model, optimizer = job.wrap(make(), lambda p: torch.optim.SGD(p, lr=0.01,
                                                                      momentum=momentum))
        job.track(model=model, optimizer=optimizer, loader=loader)
        started = None
        for _ in loader.epochs(-(-steps // loader.steps_per_epoch)):
            for x, y in loader:
                loss = nn.functional.cross_entropy(model(x), y)
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
                job.should_stop()
                if job.step_count == timed_from:
                    started = time.perf_counter()
                if job.step_count >= steps:
                    break
            if job.step_count >= steps:
                break
        if job.is_main:
            print(f"timed {(time.perf_counter() - started) / (steps - timed_from)!r}",
                  flush=True)
        print(f"rss {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.1f}",
              flush=True)


def run(tmp: Path, folder: str, in_place: bool, model: str) -> dict:
    env = dict(os.environ)
    server = None
    if in_place:
        server = subprocess.Popen([str(BIN / "spotring"), "rendezvous", "--host",
                                   "127.0.0.1", "--port", "0"], stdout=subprocess.PIPE,
                                  text=True)
        env["SPOTRING_RENDEZVOUS"] = re.search(r"at (\S+)", server.stdout.readline())[1]
    try:
        with Ranks(tmp / folder, 2, train, env=env, in_place=in_place, name=model) as job:
            codes = job.wait(900)
            output = job.output()
    finally:
        if server is not None:
            server.kill()
            server.wait()
    assert codes == [0, 0], output[-3000:]
    seconds = float(re.search(r"^timed (\S+)$", output, re.M)[1])
    return {"mode": "in place" if in_place else "off", "step_ms": 1000 * seconds,
            "rss_mb": [float(m) for m in re.findall(r"^rss (\S+)$", output, re.M)]}


def main(repeats: int, model: str) -> None:
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(repeats):
            for in_place in ((False, True) if i % 2 == 0 else (True, False)):
                row = run(Path(tmp), f"{i}-{in_place}", in_place, model) | {"repeat": i}
                print(json.dumps(row), flush=True)
                rows.append(row)
    median = {mode: statistics.median(r["step_ms"] for r in rows if r["mode"] == mode)
              for mode in ("off", "in place")}
    peak = {mode: [max(r["rss_mb"]) for r in rows if r["mode"] == mode]
            for mode in ("off", "in place")}
    ratios = [b["step_ms"] / a["step_ms"] for a, b in zip(
        [r for r in rows if r["mode"] == "off"], [r for r in rows if r["mode"] == "in place"],
        strict=True)]
    parameters = sum(p.numel() for p in MODELS[model][0]().parameters())
    summary = {"model": model, "parameters": parameters, "median_step_ms": median,
               "ratio_by_repeat": ratios, "peak_rss_mb_by_repeat": peak,
               "machine": os.uname().nodename, "torch": torch.__version__,
               "cpus": os.cpu_count(), "command": " ".join(sys.argv)}
    print(json.dumps(summary), flush=True)
    name = "results.json" if model == "convnet" else f"results-{model}.json"
    (Path(__file__).parent / name).write_text(
        json.dumps({"runs": rows, "summary": summary}, indent=2) + "\n")


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("repeats", type=int, nargs="?", default=3)
    p.add_argument("--model", choices=MODELS, default="convnet")
    args = p.parse_args()
    main(args.repeats, args.model)
