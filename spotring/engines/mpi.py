"""engine.backend=mpi's sums: blocking MPI allreduces, watched against engine.timeout_s.

    sums = MPISums(MPI.COMM_WORLD, timeout_s, on_timeout)
    ddp.register_comm_hook(sums, sum_hook)    DDP sums each gradient bucket with it
    sums.sum_(votes)                          the loop's small sums (preemption vote, metrics)

The buckets are summed, not averaged: each rank's loss was already divided by the world
size (Engine.loss_scale), which is one scalar division instead of one per gradient
value.

MPI's collectives wait forever for a rank that hangs: mpirun ends the job only when a
rank exits. Gloo's and NCCL's calls give up after engine.timeout_s, and these must too.
Polling a non-blocking Iallreduce against the deadline does that, but on one host it
costs about twice a blocking Allreduce at gradient sizes through shared memory, the very
gap MPI is chosen for. So the call blocks, and a
watchdog thread checks a few times per timeout whether the call in progress has outlived
its deadline. A thread blocked inside MPI cannot be interrupted, and a collective that
half happened leaves no state to recover, so on_timeout is expected to end the process
(the engine reports which rank went missing and exits 69).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import torch

# How often the watchdog looks, at most: a hung call is noticed within this much of its
# deadline. Waking up costs nothing next to a training step.
_WATCH_INTERVAL_S = 1.0


class MPISums:
    def __init__(self, comm, timeout_s: float, on_timeout: Callable[[str], None]) -> None:
        from mpi4py import MPI

        self.comm, self.timeout_s, self._in_place = comm, timeout_s, MPI.IN_PLACE
        self._on_timeout = on_timeout
        # (start time, values) of the call in progress, or None. A fresh tuple per call,
        # so the watchdog can tell one long call from two short ones.
        self._call: tuple[float, int] | None = None
        threading.Thread(target=self._watch, name="mpi-watchdog", daemon=True).start()

    def sum_(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum a CPU tensor over every rank, in place (in the tensor's own memory)."""
        self._call = (time.monotonic(), tensor.numel())
        try:
            self.comm.Allreduce(self._in_place, tensor.numpy())  # releases the GIL
        finally:
            self._call = None
        return tensor

    def _watch(self) -> None:
        interval = min(_WATCH_INTERVAL_S, self.timeout_s / 10)
        while True:
            time.sleep(interval)
            call = self._call
            # Checked again last: still the same call, not one that just started.
            if call is not None and time.monotonic() - call[0] > self.timeout_s \
                    and self._call is call:
                self._on_timeout(f"MPI allreduce of {call[1]} values: timed out after "
                                 f"{self.timeout_s:g} s (engine.timeout_s)")
                return


def sum_hook(sums: MPISums, bucket):  # DDP checks no annotation here
    """A DDP communication hook: the sum of a gradient bucket (dist.GradBucket) over the
    ranks, by MPI, which is the average because every rank's loss was divided by the
    world size (the engine's loss_scale); returns a completed Future of the bucket's
    tensor."""
    future: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    future.set_result(sums.sum_(bucket.buffer()))
    return future
