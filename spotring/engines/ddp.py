"""engine=ddp: PyTorch DistributedDataParallel over NCCL (GPUs) or Gloo (CPUs).

DDP averages gradients in buckets of ``bucket_mb`` (DDPOptions) as backward produces them,
overlapping the ring allreduce with the rest of backward. The process group is
joined through a TCPStore whose address comes from the launcher (runtime.py's
table); the same store later tells survivors of a failure which ranks are gone.

engine.backend=mpi (CPU, under mpirun): the gradient buckets are summed by MPI
through mpi4py instead of Gloo (a DDP communication hook; each rank's loss is divided by
the world size first, so the sum is the average), and so are the loop's small
sums (the per-step preemption vote, metrics); the process group stays Gloo for the
rest (object broadcasts, the final barrier). On one host MPI moves them through shared
memory, several times faster than Gloo's TCP (`spotring bench` measures both). The hook
waits until its bucket is reduced, so buckets do not overlap with the rest of backward:
worth it while a bucket's MPI allreduce is shorter than Gloo's. A watchdog holds MPI calls to
engine.timeout_s (engines/mpi.py), so a hung rank fails the others as under Gloo.
"""

from __future__ import annotations

import gc
import logging
import os
import socket
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.optim import Optimizer

from spotring.engines import register
from spotring.engines.base import Engine
from spotring.engines.mpi import MPISums, sum_hook
from spotring.exits import exit_peer_lost
from spotring.options import EngineOptions, positive
from spotring.polling import poll
from spotring.runtime import Launch, outward_address, slurm_master_addr

log = logging.getLogger(__name__)

# How long survivors of a failure wait for each other to report in.
_ROLL_CALL_SECONDS = 5.0
# The first bucket DDP fills holds this much; torch.compile's DDPOptimizer refuses later
# buckets smaller than it.
_FIRST_BUCKET_MB = 1.0


@dataclass
class DDPOptions(EngineOptions):
    """engine="ddp": PyTorch DistributedDataParallel (EngineOptions has the common fields).

    bucket_mb: megabytes of gradients per bucket: each bucket's allreduce starts as soon
        as backward has filled it, overlapping the rest of backward.
    sync_bn: BatchNorm layers become SyncBatchNorm, whose batch statistics span all
        workers (as one worker's over the whole global batch would).
    """

    name: str = "ddp"
    bucket_mb: float = 25.0
    sync_bn: bool = False

    def problems(self, prefix: str = "", *, compile: bool = False) -> list[str]:
        """EngineOptions.problems (``prefix``, ``compile``), and bucket_mb's."""
        found = super().problems(prefix, compile=compile) + positive(prefix,
                                                                     bucket_mb=self.bucket_mb)
        if compile and 0 < self.bucket_mb < _FIRST_BUCKET_MB:
            found.append(
                f"{prefix}bucket_mb={self.bucket_mb} with torch.compile: DDP's first bucket "
                f"holds {_FIRST_BUCKET_MB:g} MB, and torch.compile's DDPOptimizer refuses "
                f"later buckets smaller than that; valid with compile: {_FIRST_BUCKET_MB:g} "
                "or more")
        return found


def _tcp_store(addr: str, port: int, launch: Launch, is_server: bool,
               timeout: timedelta) -> dist.TCPStore:
    return dist.TCPStore(addr, port, launch.world_size, is_server, timeout=timeout,
                         wait_for_workers=False)


def _serve_store(launch: Launch, timeout: timedelta) -> dist.TCPStore:
    """Rank 0's store, on a free port (the server listens on every interface)."""
    return _tcp_store("127.0.0.1", 0, launch, True, timeout)


def _advertised(store: dist.TCPStore, all_local: bool, host: str | None) -> str:
    """The address other ranks reach rank 0's store at."""
    if all_local or not host or host == "localhost":
        host = "127.0.0.1" if all_local else outward_address()
    return f"{host}:{store.port}"


def _split(address: str) -> tuple[str, int]:
    host, port = address.rsplit(":", 1)
    return host, int(port)


def rendezvous(launch: Launch, timeout: timedelta) -> dist.Store:
    """The store every rank of this launch connects to, found the launcher's way."""
    env = os.environ
    if launch.launcher == "torchrun":
        # torchrun's agent already serves a store at MASTER_ADDR:MASTER_PORT.
        agent_store = env.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
        store = _tcp_store(env["MASTER_ADDR"], int(env["MASTER_PORT"]), launch,
                           launch.rank == 0 and not agent_store, timeout)
        # A restarted worker group must not see the keys of the attempt before it.
        return dist.PrefixStore(f"spotring/{env.get('TORCHELASTIC_RESTART_COUNT', '0')}", store)
    if launch.launcher == "mpi":
        from mpi4py import MPI

        comm = MPI.COMM_WORLD
        all_local = len(set(comm.allgather(socket.gethostname()))) == 1
        if launch.rank == 0:
            store = _serve_store(launch, timeout)
            comm.bcast(_advertised(store, all_local, env.get("MASTER_ADDR")), root=0)
            return store
        return _tcp_store(*_split(comm.bcast(None, root=0)), launch, False, timeout)
    if launch.launcher == "horovodrun":
        return _horovodrun_rendezvous(launch, timeout)
    if launch.launcher == "slurm":
        port = int(env.get("MASTER_PORT", 20000 + int(env["SLURM_JOB_ID"]) % 20000))
        return _tcp_store(slurm_master_addr(dict(env)), port, launch, launch.rank == 0, timeout)
    raise RuntimeError(f"no rendezvous for launcher {launch.launcher}")


def _horovodrun_rendezvous(launch: Launch, timeout: timedelta) -> dist.Store:
    """Under horovodrun, rank 0 opens a store and posts its address to horovodrun's
    own rendezvous server (an HTTP key-value store), where the other ranks read it."""
    env = os.environ
    url = (f"http://{env['HOROVOD_GLOO_RENDEZVOUS_ADDR']}:"
           f"{env['HOROVOD_GLOO_RENDEZVOUS_PORT']}/spotring/ddp_store")
    if launch.rank == 0:
        store = _serve_store(launch, timeout)
        # The name horovodrun reached this host by is one the other hosts can use.
        address = _advertised(store, launch.local_world_size == launch.world_size,
                              env.get("HOROVOD_HOSTNAME"))
        request = urllib.request.Request(url, data=address.encode(), method="PUT")
        urllib.request.urlopen(request, timeout=30).close()
        return store

    def posted() -> str | None:
        try:
            with urllib.request.urlopen(url, timeout=30) as response:
                return response.read().decode()
        except urllib.error.HTTPError as e:
            if e.code != 404:
                raise
            return None  # rank 0 has not posted yet

    address = poll(posted, timeout_s=timeout.total_seconds(), interval_s=0.1,
                   what=f"rank 0's store address at horovodrun's rendezvous server {url} "
                        "(engine.timeout_s)")
    return _tcp_store(*_split(address), launch, False, timeout)


def backend_of(options: EngineOptions, device: torch.device) -> str:
    """The transport the backend option names: auto is NCCL on GPUs, Gloo on CPUs."""
    if options.backend == "auto":
        return "nccl" if device.type == "cuda" else "gloo"
    return str(options.backend)


class SingleProcess(Engine):
    """engine=ddp with one process. Nothing to average, so no process group (its Gloo
    thread would wake 100 times a second and take turns with the compute threads on
    the cores), no DDP wrapper (its bucket copies), and every collective is the
    identity."""

    name = "ddp"

    def __init__(self, options: DDPOptions, launch: Launch, device: torch.device) -> None:
        self.rank, self.world_size, self.local_rank = 0, 1, launch.local_rank
        self.device, self.backend = device, backend_of(options, device)

    def prepare(self, model: nn.Module, optimizer: Optimizer,
                accumulation: int) -> tuple[nn.Module, Optimizer]:
        return model, optimizer

    def all_reduce_sum(self, tensor: torch.Tensor, name: str) -> torch.Tensor:
        return tensor

    def broadcast_object(self, obj: Any) -> Any:
        return obj

    def all_gather_object(self, obj: Any) -> list[Any]:
        return [obj]

    def shutdown(self) -> None:
        pass


class DDPEngine(Engine):
    name = "ddp"

    def __init__(self, options: DDPOptions, launch: Launch, device: torch.device) -> None:
        self.options = options
        self.rank, self.world_size = launch.rank, launch.world_size
        self.local_rank, self.device = launch.local_rank, device
        self.backend = backend_of(options, device)
        timeout = timedelta(seconds=options.timeout_s)
        self.store = rendezvous(launch, timeout)
        dist.init_process_group(
            "gloo" if self.backend == "mpi" else self.backend,
            store=dist.PrefixStore("pg", self.store), rank=self.rank,
            world_size=self.world_size, timeout=timeout,
            device_id=device if device.type == "cuda" else None,
        )
        # Who runs where, for error messages about lost ranks.
        self.ranks = self.all_gather_object(f"{socket.gethostname()} pid {os.getpid()}")
        if self.backend == "mpi":
            from mpi4py import MPI

            self._mpi_sums = MPISums(MPI.COMM_WORLD, options.timeout_s, self._mpi_timed_out)
            self.loss_scale = 1 / self.world_size  # the hook sums; this makes it the mean

    def prepare(self, model: nn.Module, optimizer: Optimizer,
                accumulation: int) -> tuple[nn.Module, Optimizer]:
        if self.options.sync_bn:
            # The new SyncBatchNorm modules keep the same Parameter objects, so the
            # optimizer built over the old ones still steps them.
            model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
        # DDP's constructor broadcasts rank 0's parameters and buffers to all ranks;
        # rank 0 loaded the checkpoint on resume, so everyone resumes from it.
        ddp = DistributedDataParallel(
            model,
            device_ids=[self.device.index] if self.device.type == "cuda" else None,
            bucket_cap_mb=self.options.bucket_mb,
            gradient_as_bucket_view=True,
        )
        if self.backend == "mpi":
            ddp.register_comm_hook(self._mpi_sums, sum_hook)
        self._broadcast_optimizer_state(optimizer)
        return ddp, optimizer

    def _broadcast_optimizer_state(self, optimizer: Optimizer) -> None:
        # DDP syncs the module, not the optimizer: momentum buffers come from rank 0 too.
        optimizer.load_state_dict(self.broadcast_object(optimizer.state_dict()))

    def no_sync(self, model: nn.Module):
        if isinstance(model, DistributedDataParallel):
            return model.no_sync()
        return super().no_sync(model)

    def all_reduce_sum(self, tensor: torch.Tensor, name: str) -> torch.Tensor:
        if self.backend == "mpi":  # the per-step vote: microseconds over MPI, ms over Gloo
            return self._mpi_sums.sum_(tensor)
        dist.all_reduce(tensor)
        return tensor

    def start_sum(self, tensor: torch.Tensor, name: str) -> Callable[[], torch.Tensor]:
        if self.backend == "mpi":
            return super().start_sum(tensor, name)
        work = dist.all_reduce(tensor, async_op=True)
        return lambda: (work.wait(), tensor)[1]

    def broadcast_object(self, obj: Any) -> Any:
        box = [obj]
        dist.broadcast_object_list(box, src=0, device=self._object_device)
        return box[0]

    def all_gather_object(self, obj: Any) -> list[Any]:
        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, obj)
        return out

    @property
    def _object_device(self) -> torch.device | None:
        return self.device if self.backend == "nccl" else None

    def _mpi_timed_out(self, message: str) -> None:
        """The MPI watchdog's verdict (on its thread, while this rank is stuck in MPI)."""
        exit_peer_lost(self.describe_failure(dist.DistBackendError(message)))

    def describe_failure(self, error: BaseException) -> str:
        missing = self._roll_call()
        if missing is None:
            lost = ("rank 0, which serves the rendezvous store, is unreachable "
                    f"({self.ranks[0]})")
        elif missing:
            lost = "lost " + ", ".join(f"rank {r} ({self.ranks[r]})" for r in missing)
        else:
            lost = "every rank is still alive"
        return f"rank {self.rank}: a collective failed: {lost}. Cause: {error}"

    def _roll_call(self) -> list[int] | None:
        """Ranks that do not report in to the store within a few seconds (None: the
        store itself is gone). A dead or hung rank never reports."""
        try:
            self.store.set_timeout(timedelta(seconds=_ROLL_CALL_SECONDS))
            self.store.set(f"alive/{self.rank}", "1")

            def missing() -> list[int]:
                return [r for r in range(self.world_size)
                        if not self.store.check([f"alive/{r}"])]

            try:
                poll(lambda: True if not missing() else None, timeout_s=_ROLL_CALL_SECONDS,
                     interval_s=0.2, what="the roll call")
                return []
            except TimeoutError:
                return missing()
        except Exception:  # any store failure means its server (rank 0 or the agent) is gone
            return None

    def shutdown(self) -> None:
        """Leave together, then free the process group while the interpreter is whole.

        The barrier keeps a rank from closing its connections while another still
        finishes its last collective. The collection frees what reference cycles still
        hold the wrapped model, whose reducer holds the Gloo process group: left to
        interpreter exit, Gloo's threads may need the GIL while Python is finalizing,
        which aborts the process (SIGABRT, "terminate called without an active
        exception") after a run that succeeded; seen in CI, see pytorch/pytorch#179291.
        """
        if dist.is_initialized():
            dist.barrier(device_ids=[self.device.index] if self.backend == "nccl" else None)
            dist.destroy_process_group()
        gc.collect()


def _create(options: DDPOptions, launch: Launch, device: torch.device) -> Engine:
    return (SingleProcess if launch.world_size == 1 else DDPEngine)(options, launch, device)


register("ddp", DDPOptions, create=_create)
