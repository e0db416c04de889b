"""The torch.distributed process group that engine=ddp and engine=fsdp join, and what
they do over it alike: the small sums, the object broadcasts, naming lost ranks, leaving.

The group is joined through a TCPStore whose address comes from the launcher (runtime.py's
table); the same store later tells survivors of a failure which ranks are gone. Every
collective gives up after engine.timeout_s.
"""

from __future__ import annotations

import gc
import os
import socket
import urllib.error
import urllib.request
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from spotring.engines.base import Engine
from spotring.options import EngineOptions
from spotring.polling import poll
from spotring.runtime import Launch, outward_address, slurm_master_addr

# How long survivors of a failure wait for each other to report in.
_ROLL_CALL_SECONDS = 5.0


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
    if launch.launcher == "single":
        return dist.HashStore()  # a group of one: nobody else to reach
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


class ProcessGroupEngine(Engine):
    """An engine over the default torch.distributed group, joined in the constructor
    with the ``options`` (EngineOptions: backend, timeout_s) on the ``launch``'s ranks,
    this one on ``device``. Subclasses prepare the model; the collectives, the roll call
    of a failure and leaving are here."""

    def __init__(self, options: EngineOptions, launch: Launch, device: torch.device) -> None:
        self.options = options
        self.rank, self.world_size = launch.rank, launch.world_size
        self.local_rank, self.device = launch.local_rank, device
        self.backend = backend_of(options, device)
        self.timeout = timedelta(seconds=options.timeout_s)
        self.store = rendezvous(launch, self.timeout)
        dist.init_process_group(
            # engine.backend=mpi: the group is Gloo, and DDP sums the gradients over MPI.
            "gloo" if self.backend == "mpi" else self.backend,
            store=dist.PrefixStore("pg", self.store), rank=self.rank,
            world_size=self.world_size, timeout=self.timeout,
            device_id=device if device.type == "cuda" else None,
        )
        # Who runs where, for error messages about lost ranks.
        self.ranks = self.all_gather_object(f"{socket.gethostname()} pid {os.getpid()}")

    def all_reduce_sum(self, tensor: torch.Tensor, name: str) -> torch.Tensor:
        dist.all_reduce(tensor)
        return tensor

    def start_sum(self, tensor: torch.Tensor, name: str) -> Callable[[], torch.Tensor]:
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
