"""A sharded checkpoint of about 1 GB from 2 workers, to each store's emulator on
127.0.0.1: seconds and MB/s from the save's start to every part written, read back,
uploaded and the manifest published, as spotring logs them.

    .venv/bin/python benchmarks/results/checkpoint-stores/measure.py [GB] [REPEATS]

Two ranks (harness/ranks.py: spawned here, torchrun's environment), engine=ddp, a model of
float32 Linear layers of GB gigabytes (10^9 bytes) in all, no optimizer: DCP spreads the
layers so that each rank writes about half. One blocking save per repeat (default 3),
the first of a run excluded as warm-up, to the checkpoint directory alone and with
checkpoint.uri on moto (S3), the GCS emulator and Azurite (harness/stores.py). These are
emulators on a shared 2-core VM, not clouds: what they say is that every store's path
works at this size, and how the clients and emulators compare here, side by side in one
run. Prints a row per store and writes results.json beside this file.
"""

import json
import os
import re
import statistics
import sys
import tempfile
from contextlib import ExitStack
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

from harness import ranks  # noqa: E402
from harness.stores import (  # noqa: E402
    environment,
    running_azurite,
    running_gcs_emulator,
    running_moto,
)

RUNNING = {"s3": running_moto, "gs": running_gcs_emulator, "az": running_azurite}
WIDTH = 4096  # a layer of 4096 x 4096 float32 weights: 67 MB


def saves(gigabytes: float, repeats: int) -> None:
    """A rank's workload: the model, then ``repeats`` blocking saves of it."""
    import torch

    import spotring

    layers = max(1, round(gigabytes * 1e9 / (WIDTH * WIDTH * 4)))
    with spotring.init(seed=0, notices="none") as job:
        model = torch.nn.Sequential(*(torch.nn.Linear(WIDTH, WIDTH, bias=False)
                                      for _ in range(layers)))
        model, _ = job.wrap(model, torch.optim.SGD(model.parameters(), lr=0.1))
        job.track(model=model)
        for _ in range(repeats):
            job.should_stop()  # a step taken: each save is of its own step
            job.save(background=False)
        job.finish()


def main(gigabytes: float, repeats: int) -> None:
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for kind in ("directory", *RUNNING):
            with ExitStack() as stack:
                env = {}
                if kind != "directory":
                    emulator = stack.enter_context(RUNNING[kind](Path(tempfile.mkdtemp(dir=tmp))))
                    stack.enter_context(environment(emulator.env()))
                    env = {"SPOTRING_CHECKPOINT_URI": emulator.uri(f"measure-{os.getpid()}")}
                output = ranks.run(Path(tmp) / kind, 2, saves, env=env, timeout=3600,
                                   gigabytes=gigabytes, repeats=repeats + 1)
            # "checkpoint DIR, 1073.7 MB in 4 parts (at most 536.9 MB from one rank): DIR
            # in 2.10 s (511.3 MB/s), gs://b/p in 20.5 s (52.4 MB/s)"
            lines = re.findall(r"checkpoint \S+, ([\d.]+) MB in \d+ parts .*?: (.*)$", output,
                               re.M)[1:]
            seconds = [float(re.findall(r" in ([\d.]+) s \(", stores)[-1])
                       for _, stores in lines]
            mb = float(lines[0][0])
            row = {"store": kind, "mb": mb, "seconds": seconds,
                   "median_seconds": statistics.median(seconds),
                   "mb_per_second": mb / statistics.median(seconds)}
            rows.append(row)
            print(f"{kind:<10} {mb:>8.1f} MB  {row['median_seconds']:>6.2f} s  "
                  f"{row['mb_per_second']:>7.1f} MB/s  (each save: "
                  f"{', '.join(f'{s:.2f}' for s in seconds)} s)", flush=True)
    load = [round(x, 2) for x in os.getloadavg()]
    print(f"load average {load}")
    (Path(__file__).with_name("results.json")).write_text(json.dumps(
        {"gigabytes": gigabytes, "repeats": repeats, "workers": 2, "load_average": load,
         "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main(float(sys.argv[1]) if len(sys.argv) > 1 else 1.0,
         int(sys.argv[2]) if len(sys.argv) > 2 else 3)
