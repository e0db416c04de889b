"""What gradient averaging adds to a step, measured inside one 2-worker job.

    python -m benchmarks.step_split                       # every engine this host has
    python -m benchmarks.step_split --engines ddp horovod-gloo --batch-sizes 32 64 128

Why inside one job: two launches of the same 2-worker job differ here by 10-40% (where
the scheduler puts each process's threads, what else the VM runs), which is more than
what communication costs. The throughput benchmark's split (a 2-worker run against two
single workers launched apart) inherits that noise, and can even come out negative. Here
each rank alternates blocks of --block steps in three modes, ABC then CBA:

    sync      the model and optimizer as the engine prepares them for training: the
              gradient allreduce, then the trainer's per-step vote
    aligned   an unwrapped copy of the model with a plain optimizer, and the vote
    free      the unwrapped copy alone: each rank computes at its own pace

A block's time per step is its slowest rank's, and so is the CPU the engine's threads
took during it (other_threads_cores, per mode); each mode's figure is the median over
--cycles, and so is each difference, taken within a cycle (the VM's speed drifts from
one to the next): free is the compute; aligned - free is waiting for the slower rank
plus the vote; sync - aligned is the gradient allreduce as a step pays it; sync - free
is all that communication adds. The spread of free steps within a block is the jitter
benchmarks/predict.py needs. It predicts that addition from free's figures and the
transports' allreduce figures: its model, without launch-to-launch noise.

Engines are the trainer's own (trainer.engines, configured as `python -m trainer
engine=...` would be), started by the launcher benchmarks/runs.py uses for each: ddp
(Gloo, torchrun), ddp-mpi (DDP's buckets summed by the trainer's MPI comm hook, mpirun),
horovod-gloo (horovodrun) and horovod-mpi (mpirun). The vote is the trainer's too: each
step waits for the sum sent the step before and sends its own (trainer/preemption.py).
The network, per-worker batch, optimizer and loss are the plain loop's
(benchmarks/plain_loop.py), on a fixed batch of MNIST-shaped random data (no input
pipeline: the trainer's is in-memory indexing). One host only.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import time
from collections.abc import Callable

import torch

from benchmarks import record
from benchmarks.plain_loop import loss_of, network, sgd
from benchmarks.runs import ENGINES as RUNS
from benchmarks.runs import available_engines, gradient_of, json_line, run_together, shown
from launch.commands import local_command
from trainer import engines
from trainer.config import compose
from trainer.runtime import detect, other_threads_cpu

MODES = ("sync", "aligned", "free")
ENGINES = [name for name, e in RUNS.items() if e.program == "trainer"]
WORKERS = 2
LR = 0.01  # a small constant: steps take the same time at any LR


class Job:
    """This rank's part: the plain loop's network under the trainer's ``engine``."""

    def __init__(self, engine: str) -> None:
        cfg = compose(list(RUNS[engine].args))
        self.engine = engines.create(cfg.engine, detect(), torch.device("cpu"))
        free = network()
        synced = copy.deepcopy(free)
        self.models = {"free": (free, sgd(free, LR)),
                       "sync": self.engine.prepare(synced, sgd(synced, LR), 1)}
        self.pending: Callable[[], torch.Tensor] | None = None

    def step(self, mode: str, x: torch.Tensor, y: torch.Tensor) -> None:
        model, optimizer = self.models["sync" if mode == "sync" else "free"]
        loss = loss_of(model(x), y) * (self.engine.loss_scale if mode == "sync" else 1.0)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()  # as the trainer: to None (Horovod's takes no argument)
        if mode != "free":
            self.vote()

    def vote(self) -> None:
        """As trainer.preemption.Watch.decide: the sum sent last step, then this one's."""
        self.wait_for_vote()
        self.pending = self.engine.start_sum(torch.zeros(2), "preemption")

    def wait_for_vote(self) -> None:
        if self.pending is not None:
            self.pending()
            self.pending = None

    def together(self) -> None:
        """Every rank here, nothing in flight: the start of a block."""
        self.wait_for_vote()
        self.engine.all_gather_object(None)

    def slowest(self, *values: float) -> list[float]:
        """Each value's largest over the ranks (the slowest or busiest rank's), in one
        gather."""
        return [max(v) for v in zip(*self.engine.all_gather_object(values), strict=True)]

    def close(self) -> None:
        self.together()
        del self.models  # the engine frees what holds its process group (DDPEngine)
        self.engine.shutdown()

    def measure(self, batch: int, cycles: int, block: int) -> dict:
        x, y = torch.randn(batch, 1, 28, 28), torch.randint(0, 10, (batch,))
        for mode in MODES:  # warm-up
            for _ in range(block):
                self.step(mode, x, y)
        per_block: dict[str, list[float]] = {m: [] for m in MODES}
        others: dict[str, list[float]] = {m: [] for m in MODES}
        free_sd: list[float] = []
        for cycle in range(cycles):
            for mode in MODES if cycle % 2 == 0 else MODES[::-1]:
                self.together()
                times = []
                cpu, wall = other_threads_cpu(), time.perf_counter()
                for _ in range(block):
                    start = time.perf_counter()
                    self.step(mode, x, y)
                    times.append(time.perf_counter() - start)
                # The engine's threads' CPU over the block, in cores.
                cores = (other_threads_cpu() - cpu) / (time.perf_counter() - wall)
                mean, sd, cores = self.slowest(statistics.fmean(times),
                                               statistics.pstdev(times), cores)
                per_block[mode].append(1e3 * mean)
                others[mode].append(cores)
                if mode == "free":  # the spread of the busier rank, which the other waits for
                    free_sd.append(1e3 * sd)
        # The VM's speed drifts from cycle to cycle: differences are taken within a cycle.
        def added(mode: str, base: str) -> float:
            pairs = zip(per_block[mode], per_block[base], strict=True)
            return statistics.median([a - b for a, b in pairs])

        return {"batch": batch,
                **{f"{m}_ms": statistics.median(v) for m, v in per_block.items()},
                "wait_and_vote_ms": added("aligned", "free"),
                "gradient_allreduce_ms": added("sync", "aligned"),
                "communication_ms": added("sync", "free"),
                "free_sd_ms": statistics.median(free_sd), "per_block_ms": per_block,
                "other_threads_cores": {m: statistics.median(v) for m, v in others.items()}}


def measure(names: list[str], batches: list[int], cycles: int, block: int) -> dict:
    rows, commands = [], {}
    for name in names:
        command = local_command(RUNS[name].launcher, WORKERS,
                                [name, "--batch-sizes", *map(str, batches),
                                 "--cycles", str(cycles), "--block", str(block)],
                                module="benchmarks.step_split")
        commands[name] = shown(command)
        (stdout,) = run_together([command])
        for row in json_line(stdout, "rows")["rows"]:
            rows.append({"engine": name, **row})
            print(f"{name}, batch {row['batch']}: "
                  + ", ".join(f"{m} {row[m + '_ms']:.1f}" for m in MODES) + " ms per step",
                  flush=True)
    return {"workers": WORKERS, "cycles": cycles, "block": block,
            **gradient_of(network()), "rows": rows, "commands": commands}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("rank_side", nargs="?", choices=ENGINES,
                   help="(what the launcher starts on every rank)")
    p.add_argument("--engines", nargs="+", default=None, choices=ENGINES,
                   help="default: every engine this host has")
    p.add_argument("--batch-sizes", nargs="+", type=int, default=[64], help="per worker")
    p.add_argument("--cycles", type=int, default=12, help="of the three modes' blocks")
    p.add_argument("--block", type=int, default=10, help="steps per block")
    record.add_name_argument(p, "step-split")
    args = p.parse_args()
    if args.cycles < 1 or args.block < 2:
        p.error(f"--cycles {args.cycles} --block {args.block}: at least 1 cycle of "
                "blocks of 2 steps")
    if args.rank_side is None:
        names = args.engines or [e for e in ENGINES if e in available_engines()]
        record.write(args.name, "step-split", lambda folder: {"step_split": measure(
            names, args.batch_sizes, args.cycles, args.block)})
        return
    torch.set_num_threads(1)
    torch.manual_seed(0)
    job = Job(args.rank_side)
    rows = [job.measure(batch, args.cycles, args.block) for batch in args.batch_sizes]
    if job.engine.rank == 0:
        print(json.dumps({"rows": rows}), flush=True)
    job.close()


if __name__ == "__main__":
    main()
