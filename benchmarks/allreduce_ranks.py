"""What every rank of the allreduce benchmark runs: time one transport's allreduce.

Started by benchmarks/allreduce.py, one launcher per transport:

    torchrun --standalone --nproc-per-node 2 -m benchmarks.allreduce_ranks gloo
    torchrun --standalone --nproc-per-node 2 -m benchmarks.allreduce_ranks nccl   (GPUs)
    mpirun -np 2 python -m benchmarks.allreduce_ranks mpi                          (mpi4py)
    mpirun -np 2 python -m benchmarks.allreduce_ranks trainer-mpi    (the trainer's MPI hook)
    horovodrun --gloo -np 2 -H localhost:2 python -m benchmarks.allreduce_ranks horovod
    HOROVOD_CPU_OPERATIONS=MPI mpirun -np 2 python -m benchmarks.allreduce_ranks horovod

Timing, as nccl-tests does it: a float32 sum of ``bytes`` in place; warm-up calls;
then timed loops whose length is agreed on by all ranks; a loop's time per call is the
slowest rank's average. Unlike nccl-tests, the --budget seconds are split into 5 loops
and the median loop counts: at 0.1 ms a call, one moment of the VM's CPU taken elsewhere
would otherwise decide a comparison of two transports (issue 6's target). Buffers hold
zeros, so sums never overflow into infinities. Rank 0 prints one JSON line: seconds per
call per size.

The trainer's own path (trainer-mpi) is also compared with the transport it goes over,
in the same process: each of its loops is followed by a loop of the same calls made
directly over that transport on the same buffer, and `of_transport` is the median of
the loops' ratios (transport's time / path's). On this VM a shared-memory allreduce
runs at one of two speeds, 4x apart, for tens of seconds at a time (738 KB: 0.095 or
0.40 ms, whole launches of raw mpi4py either way), so two launches minutes apart may
compare two speeds of the host rather than two paths.

Then every rank works as in training for --busy seconds: bursts of computation (matrix
products on its one thread, keeping its core busy), each followed by a small allreduce,
as a step's backward is followed by its gradients' allreduce. It reports the CPU the
process's other threads took during the bursts, in cores: what the transport's own
threads take from the computation. Horovod's background thread runs its negotiation
cycle every HOROVOD_CYCLE_TIME ms whether or not there is anything to reduce, and under
MPI it polls while it waits for the other ranks' cycles; Gloo's and MPI's threads sleep.
Every other burst also starts small allreduces part-way through without waiting for
them, as backward hands Horovod each gradient tensor (and DDP each bucket but the last),
and the trainer its vote: the CPU those bursts' other threads took beyond their plain
neighbours', per allreduce, is what one allreduce sent during the compute takes from it
(`response_cpu_seconds`; only for transports that can send without waiting: Gloo,
Horovod). The plain bursts give the cores. benchmarks/predict.py charges both to the
compute where the workers have no spare core (but t_r over MPI, where Horovod's thread
spins anyway: this_machine.SPINS). The busiest rank's figures are reported.

With --cold-bytes (the model's gradient size), each rank then times an allreduce of that
size after each of 20 bursts of 50 ms: cold, as a step's gradients are, where the
transport's threads have slept through the compute (Gloo's wake up; MPI's and Horovod's
poll). benchmarks/predict.py charges a step what this costs over a back-to-back call.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import time
from collections.abc import Callable

import numpy as np
import torch

from trainer.runtime import other_threads_cpu

WARMUP_CALLS = 3
LOOPS = 5
MAX_CALLS = 200  # per loop
MIN_CALLS = 2
COLD_BURSTS = 20  # --cold-bytes: allreduces timed, each after a burst of computing
COLD_BURST_SECONDS = 0.05
SENT_PER_BURST = 4  # allreduces started during every other burst of --busy


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

    def start_allreduce(self, buf: torch.Tensor, index: int) -> Callable[[], object]:
        return self.dist.all_reduce(buf, async_op=True).wait

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


class TrainerMPI(MPI):
    """engine=ddp engine.backend=mpi's own path, as its comm hook runs it on a gradient
    bucket: a torch tensor summed by trainer.engines.mpi.MPISums (a blocking MPI
    allreduce under the watchdog; the loss was divided by the world size instead)."""

    def __init__(self) -> None:
        super().__init__()
        from trainer.config import EngineConfig
        from trainer.engines.mpi import MPISums
        from trainer.exits import exit_peer_lost

        self.sums = MPISums(self.comm, EngineConfig.timeout_s, exit_peer_lost)  # the default

    def buffer(self, numel: int) -> torch.Tensor:
        return torch.zeros(numel, dtype=torch.float32)

    def allreduce(self, buf: torch.Tensor) -> None:
        self.sums.sum_(buf)

    def allreduce_transport(self, buf: torch.Tensor) -> None:
        """The same sum made directly over mpi4py, to compare with in the same process."""
        MPI.allreduce(self, buf.numpy())


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

    def start_allreduce(self, buf: torch.Tensor, index: int) -> Callable[[], object]:
        # Tensors in flight together need names of their own.
        handle = self.hvd.allreduce_async_(buf, op=self.hvd.Sum, name=f"bench.sent{index}")
        return lambda: self.hvd.synchronize(handle)

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
    "trainer-mpi": TrainerMPI,
    "horovod": Horovod,
}


def time_allreduce(transport, nbytes: int, budget: float) -> dict:
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
    direct = getattr(transport, "allreduce_transport", None)  # a trainer path's transport
    per_call, direct_per_call = [], []
    for _ in range(LOOPS):
        per_call.append(_loop_seconds(transport, transport.allreduce, buf, calls))
        if direct:
            direct_per_call.append(_loop_seconds(transport, direct, buf, calls))
    out = {"bytes": buf.nbytes, "seconds": statistics.median(per_call),
           "seconds_per_loop": per_call, "calls": calls * LOOPS}
    if direct:
        out["transport_seconds_per_loop"] = direct_per_call
        out["of_transport"] = statistics.median(
            [d / t for d, t in zip(direct_per_call, per_call, strict=True)])
    return out


def _loop_seconds(transport, allreduce, buf, calls: int) -> float:
    """One timed loop of ``calls`` allreduces: the slowest rank's seconds per call."""
    transport.max(0.0)  # line the ranks up before the clock starts
    start = time.perf_counter()
    for _ in range(calls):
        allreduce(buf)
    transport.wait()
    return transport.max((time.perf_counter() - start) / calls)


def transport_cpu(transport, seconds: float, burst: float = 0.025) -> dict:
    """What the transport's threads take from this process's computing, for about
    ``seconds``: bursts of ``burst`` seconds, each followed by a small allreduce, every
    other one also starting SENT_PER_BURST small allreduces part-way through (where the
    transport can). Returns the busiest rank's ``cores`` (the other threads' CPU over the
    plain bursts' time) and ``response_cpu_seconds`` (what the sending bursts' other
    threads took beyond the plain ones', per allreduce sent; None where it cannot send
    without waiting)."""
    a, buf = torch.ones(256, 256), transport.buffer(256)
    sent = [transport.buffer(256) for _ in range(SENT_PER_BURST)]
    start = getattr(transport, "start_allreduce", None)
    sends = SENT_PER_BURST if start else 0
    others = {0: 0.0, sends: 0.0}  # the other threads' CPU, by allreduces sent per burst
    plain = 0.0  # seconds computed in bursts that sent nothing
    pairs = max(1, round(seconds / burst / 2))
    for _ in range(pairs):
        for n in (0, sends):
            cpu, wall = other_threads_cpu(), time.perf_counter()
            waits = []
            while time.perf_counter() - wall < burst:
                if len(waits) < n and time.perf_counter() - wall > \
                        burst * (len(waits) + 1) / (n + 1):
                    waits.append(start(sent[len(waits)], len(waits)))
                torch.mm(a, a)
            while len(waits) < n:  # a burst cut short: every rank must send them all
                waits.append(start(sent[len(waits)], len(waits)))
            others[n] += max(0.0, other_threads_cpu() - cpu)
            if n == 0:
                plain += time.perf_counter() - wall
            for wait in waits:
                wait()
            transport.allreduce(buf)
    transport.wait()
    cores = transport.max(others[0] / plain)
    if not start:
        return {"cores": cores, "response_cpu_seconds": None}
    extra = (others[sends] - others[0]) / (pairs * sends)
    return {"cores": cores, "response_cpu_seconds": max(0.0, transport.max(extra))}


def cold_allreduce_seconds(transport, nbytes: int, bursts: int = COLD_BURSTS,
                           burst: float = COLD_BURST_SECONDS) -> float:
    """An allreduce of ``nbytes`` after each of ``bursts`` bursts of computation, as a
    step's gradients follow its backward: the transport's threads slept through the
    burst. Each call's time is the last-arriving rank's (it waits for no one); median."""
    a, buf = torch.ones(256, 256), transport.buffer(max(1, nbytes // 4))
    calls = []
    for _ in range(bursts):
        wall = time.perf_counter()
        while time.perf_counter() - wall < burst:
            torch.mm(a, a)
        start = time.perf_counter()
        transport.allreduce(buf)
        transport.wait()
        calls.append(-transport.max(start - time.perf_counter()))
    return statistics.median(calls)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("transport", choices=list(TRANSPORTS))
    p.add_argument("--sizes", nargs="+", type=int, required=True, help="bytes")
    p.add_argument("--budget", type=float, default=0.2, help="seconds of timed calls per size")
    p.add_argument("--busy", type=float, default=2.0,
                   help="seconds of computing, for the CPU the transport takes from it")
    p.add_argument("--cold-bytes", type=int, default=None,
                   help="also time an allreduce of this size after bursts of computing")
    args = p.parse_args()
    torch.set_num_threads(1)
    transport = TRANSPORTS[args.transport]()
    results = [time_allreduce(transport, n, args.budget) for n in args.sizes]
    cpu = transport_cpu(transport, args.busy)
    cold = (None if args.cold_bytes is None else
            {"bytes": args.cold_bytes,
             "seconds": cold_allreduce_seconds(transport, args.cold_bytes)})
    if transport.rank == 0:
        print(json.dumps({"transport": args.transport, "ranks": transport.size,
                          "results": results, "background_cpu_cores": cpu["cores"],
                          "response_cpu_seconds": cpu["response_cpu_seconds"],
                          "cold": cold}), flush=True)
    transport.close()


if __name__ == "__main__":
    main()
