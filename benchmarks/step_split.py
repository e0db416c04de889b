"""What gradient averaging adds to a step, measured inside one 2-worker job.

    python -m benchmarks.step_split                       # Gloo and MPI, batch 64
    python -m benchmarks.step_split --transports gloo --batch-sizes 32 64 128 --cycles 20

Why inside one job: two launches of the same 2-worker job differ here by 10-20% (where
the scheduler puts each process's threads, what else the VM runs), which is more than
what communication costs. The throughput benchmark's split (a 2-worker run against two
single workers launched apart) inherits that noise, and can even come out negative. Here
each rank alternates blocks of --block steps in three modes, ABC then CBA:

    sync      DDP as in training: the gradient allreduce, then the trainer's 1-value vote
    aligned   DDP's no_sync: no gradient allreduce, the vote alone
    free      no_sync and no vote: each rank computes at its own pace

A block's time per step is its slowest rank's; each mode's figure is the median over
--cycles, and so is each difference, taken within a cycle (the VM's speed drifts from
one to the next): free is the compute; aligned - free is waiting for the slower rank
plus the vote; sync - aligned is the gradient allreduce as a step pays it; sync - free
is all that communication adds. The spread of free steps within a block is the jitter
benchmarks/predict.py needs. It predicts that addition from free's figures and the
transports' allreduce figures: its model, without launch-to-launch noise.

Transports: gloo (torch.distributed, the path of engine=ddp and the plain loop), started
by torchrun; mpi (engine=ddp engine.backend=mpi's path: DDP's buckets summed by the
trainer's own comm hook, trainer.engines.mpi), started by mpirun. The network, per-worker
batch, optimizer and loss are the plain loop's (benchmarks/plain_loop.py), on a fixed
batch of MNIST-shaped random data (no input pipeline: the trainer's is in-memory
indexing). One host only.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import statistics
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel

from benchmarks import record
from benchmarks.plain_loop import network
from benchmarks.runs import run_together, shown
from launch.commands import local_command
from trainer.config import EngineConfig
from trainer.engines.ddp import rendezvous
from trainer.exits import exit_peer_lost
from trainer.runtime import detect

MODES = ("sync", "aligned", "free")
TRANSPORTS = {"gloo": "torchrun", "mpi": "mpirun"}  # and the launcher that starts it
# The engine whose gradient path each transport is (benchmarks/predict.py's names).
ENGINES = {"gloo": "ddp", "mpi": "ddp-mpi"}
WORKERS = 2


class Job:
    """This rank's part: the plain loop's network under DDP over ``transport``."""

    def __init__(self, transport: str) -> None:
        # The trainer's own rendezvous (torchrun's store, or one rank 0 serves under
        # mpirun) and collective timeout. DDP needs a Gloo group even when a hook sums.
        launch = detect()
        timeout = timedelta(seconds=EngineConfig.timeout_s)
        dist.init_process_group("gloo", store=rendezvous(launch, timeout), rank=launch.rank,
                                world_size=launch.world_size, timeout=timeout)
        self.model = DistributedDataParallel(network(), gradient_as_bucket_view=True)
        self.vote, self.loss_scale = dist.all_reduce, 1.0
        if transport == "mpi":
            from mpi4py import MPI

            from trainer.engines.mpi import MPISums, sum_hook

            sums = MPISums(MPI.COMM_WORLD, EngineConfig.timeout_s, exit_peer_lost)
            self.model.register_comm_hook(sums, sum_hook)
            self.vote = sums.sum_
            self.loss_scale = 1 / launch.world_size  # the hook sums: this makes it the mean
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=0.01, momentum=0.9,
                                         nesterov=True, weight_decay=5e-4)
        self.tick = torch.zeros(1)

    def step(self, mode: str, x: torch.Tensor, y: torch.Tensor) -> None:
        with contextlib.nullcontext() if mode == "sync" else self.model.no_sync():
            loss = F.cross_entropy(self.model(x), y, label_smoothing=0.1)
            (loss * self.loss_scale).backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        if mode != "free":
            self.vote(self.tick)

    def close(self) -> None:
        """As trainer.engines.ddp.DDPEngine.shutdown, for the same reason: left to
        interpreter exit, the model's reducer's Gloo threads abort the process."""
        dist.barrier()
        del self.model, self.optimizer
        dist.destroy_process_group()
        gc.collect()

    def slowest(self, value: float) -> float:
        t = torch.tensor([value], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return t.item()

    def measure(self, batch: int, cycles: int, block: int) -> dict:
        x, y = torch.randn(batch, 1, 28, 28), torch.randint(0, 10, (batch,))
        for _ in range(block):  # warm-up
            self.step("sync", x, y)
        per_block: dict[str, list[float]] = {m: [] for m in MODES}
        free_sd: list[float] = []
        for cycle in range(cycles):
            for mode in MODES if cycle % 2 == 0 else MODES[::-1]:
                dist.barrier()  # every mode's block starts with the ranks together
                times = []
                for _ in range(block):
                    start = time.perf_counter()
                    self.step(mode, x, y)
                    times.append(time.perf_counter() - start)
                per_block[mode].append(1e3 * self.slowest(statistics.fmean(times)))
                if mode == "free":  # the spread of the busier rank, which the other waits for
                    free_sd.append(1e3 * self.slowest(statistics.pstdev(times)))
        # The VM's speed drifts from cycle to cycle: differences are taken within a cycle.
        def added(mode: str, base: str) -> float:
            pairs = zip(per_block[mode], per_block[base], strict=True)
            return statistics.median([a - b for a, b in pairs])

        return {"batch": batch,
                **{f"{m}_ms": statistics.median(v) for m, v in per_block.items()},
                "wait_and_vote_ms": added("aligned", "free"),
                "gradient_allreduce_ms": added("sync", "aligned"),
                "communication_ms": added("sync", "free"),
                "free_sd_ms": statistics.median(free_sd), "per_block_ms": per_block}


def gradient_bytes() -> int:
    return sum(4 * p.numel() for p in network().parameters())


def measure(transports: list[str], batches: list[int], cycles: int, block: int) -> dict:
    rows, commands = [], {}
    for transport in transports:
        command = local_command(TRANSPORTS[transport], WORKERS,
                                [transport, "--batch-sizes", *map(str, batches),
                                 "--cycles", str(cycles), "--block", str(block)],
                                module="benchmarks.step_split")
        commands[transport] = shown(command)
        (stdout,) = run_together([command])
        line = next(x for x in reversed(stdout.splitlines()) if x.startswith("{"))
        for row in json.loads(line)["rows"]:
            rows.append({"transport": transport, "engine": ENGINES[transport], **row})
            print(f"{transport}, batch {row['batch']}: "
                  + ", ".join(f"{m} {row[m + '_ms']:.1f}" for m in MODES) + " ms per step",
                  flush=True)
    return {"workers": WORKERS, "cycles": cycles, "block": block,
            "gradient_bytes": gradient_bytes(), "rows": rows, "commands": commands}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("rank_side", nargs="?", choices=list(TRANSPORTS),
                   help="(what the launcher starts on every rank)")
    p.add_argument("--transports", nargs="+", default=list(TRANSPORTS),
                   choices=list(TRANSPORTS))
    p.add_argument("--batch-sizes", nargs="+", type=int, default=[64], help="per worker")
    p.add_argument("--cycles", type=int, default=12, help="of the three modes' blocks")
    p.add_argument("--block", type=int, default=10, help="steps per block")
    record.add_name_argument(p, "step-split")
    args = p.parse_args()
    if args.cycles < 1 or args.block < 2:
        p.error(f"--cycles {args.cycles} --block {args.block}: at least 1 cycle of "
                "blocks of 2 steps")
    if args.rank_side is None:
        record.write(args.name, "step-split", lambda folder: {"step_split": measure(
            args.transports, args.batch_sizes, args.cycles, args.block)})
        return
    torch.set_num_threads(1)
    torch.manual_seed(0)
    job = Job(args.rank_side)
    rows = [job.measure(batch, args.cycles, args.block) for batch in args.batch_sizes]
    if dist.get_rank() == 0:
        print(json.dumps({"rows": rows}), flush=True)
    job.close()


if __name__ == "__main__":
    main()
