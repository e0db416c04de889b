"""What every rank of the allreduce benchmark runs: time one transport's allreduce.

    torchrun --standalone --nproc-per-node 2 -m spotring.benchmarks.allreduce_ranks gloo
    mpirun -np 2 python -m spotring.benchmarks.allreduce_ranks mpi     (benchmarks/allreduce.py)

Timing, as nccl-tests does it: a float32 sum of ``bytes`` in place; warm-up calls; then
timed loops whose length all ranks agree on; a loop's time per call is the slowest rank's
average. Unlike nccl-tests, the --budget seconds are split into LOOPS loops and the median
loop counts, so that one moment of a shared CPU taken elsewhere does not decide a size.
Buffers hold zeros, so sums never overflow. Rank 0 prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import time

import numpy as np
import torch

WARMUP_CALLS = 3
LOOPS = 5
MAX_CALLS = 200  # per loop
MIN_CALLS = 2


class TorchDistributed:
    """torch.distributed: Gloo on CPU tensors, NCCL on this rank's GPU."""

    def __init__(self, backend: str) -> None:
        import torch.distributed as dist

        self.dist = dist
        self.device = torch.device("cpu")
        if backend == "nccl":
            self.device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
            torch.cuda.set_device(self.device)
        dist.init_process_group(backend)
        self.rank, self.size = dist.get_rank(), dist.get_world_size()

    def buffer(self, numel: int) -> torch.Tensor:
        return torch.zeros(numel, dtype=torch.float32, device=self.device)

    def allreduce(self, buf: torch.Tensor) -> None:
        self.dist.all_reduce(buf)

    def wait(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def max(self, value: float) -> float:
        t = torch.tensor([value], dtype=torch.float64, device=self.device)
        self.dist.all_reduce(t, op=self.dist.ReduceOp.MAX)
        return t.item()

    def close(self) -> None:
        self.dist.destroy_process_group()


class MPI:
    """mpi4py on numpy buffers: Open MPI's own allreduce (shared memory on one host)."""

    def __init__(self) -> None:
        from mpi4py import MPI as mpi

        self.mpi, self.comm = mpi, mpi.COMM_WORLD
        self.rank, self.size = self.comm.Get_rank(), self.comm.Get_size()

    def buffer(self, numel: int) -> np.ndarray:
        return np.zeros(numel, dtype=np.float32)

    def allreduce(self, buf: np.ndarray) -> None:
        self.comm.Allreduce(self.mpi.IN_PLACE, buf, op=self.mpi.SUM)

    def wait(self) -> None:
        pass

    def max(self, value: float) -> float:
        return self.comm.allreduce(value, op=self.mpi.MAX)

    def close(self) -> None:
        pass


class Horovod:
    """Horovod's allreduce on CPU tensors, over Gloo or MPI (HOROVOD_CPU_OPERATIONS),
    through its background thread, negotiation and fusion buffer as in training."""

    def __init__(self) -> None:
        import horovod.torch as hvd

        hvd.init()
        self.hvd, self.rank, self.size = hvd, hvd.rank(), hvd.size()

    def buffer(self, numel: int) -> torch.Tensor:
        return torch.zeros(numel, dtype=torch.float32)

    def allreduce(self, buf: torch.Tensor) -> None:
        self.hvd.allreduce_(buf, op=self.hvd.Sum, name="bench")

    def wait(self) -> None:
        pass

    def max(self, value: float) -> float:
        t = torch.tensor([value], dtype=torch.float64)
        return self.hvd.allreduce(t, op=self.hvd.Max, name="bench.max").item()

    def close(self) -> None:
        self.hvd.shutdown()


TRANSPORTS = {
    "gloo": lambda: TorchDistributed("gloo"),
    "nccl": lambda: TorchDistributed("nccl"),
    "mpi": MPI,
    "horovod": Horovod,
}


def time_allreduce(transport, nbytes: int, budget: float) -> dict:
    """Seconds per allreduce of ``nbytes``: the median of LOOPS timed loops."""
    buf = transport.buffer(max(1, nbytes // 4))
    for _ in range(WARMUP_CALLS):
        transport.allreduce(buf)
    transport.wait()
    start = time.perf_counter()
    transport.allreduce(buf)
    transport.wait()
    # Every rank must make the same number of calls: agree on the slowest first call.
    once = transport.max(time.perf_counter() - start)
    calls = min(MAX_CALLS, max(MIN_CALLS, math.ceil(budget / LOOPS / max(once, 1e-9))))
    per_call = []
    for _ in range(LOOPS):
        transport.max(0.0)  # line the ranks up before the clock starts
        start = time.perf_counter()
        for _ in range(calls):
            transport.allreduce(buf)
        transport.wait()
        per_call.append(transport.max((time.perf_counter() - start) / calls))
    return {"bytes": buf.nbytes, "seconds": statistics.median(per_call),
            "seconds_per_loop": per_call, "calls": calls * LOOPS}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("transport", choices=list(TRANSPORTS))
    p.add_argument("--sizes", nargs="+", type=int, required=True, help="bytes")
    p.add_argument("--budget", type=float, default=0.2, help="seconds of timed calls per size")
    args = p.parse_args()
    torch.set_num_threads(1)
    transport = TRANSPORTS[args.transport]()
    results = [time_allreduce(transport, n, args.budget) for n in args.sizes]
    if transport.rank == 0:
        print(json.dumps({"transport": args.transport, "ranks": transport.size,
                          "loops": LOOPS, "results": results}), flush=True)
    transport.close()


if __name__ == "__main__":
    main()
