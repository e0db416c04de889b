"""The torch.distributed process group that engine=ddp and engine=fsdp join, and what
they do over it alike: the small sums, the object broadcasts, naming lost ranks, leaving.

The group is joined through a TCPStore whose address comes from the launcher (runtime.py's
table); the same store later tells survivors of a failure which ranks are gone. Every
collective gives up after engine.timeout_s.

In place (spotring/elastic/), the group is a ``Group`` of the job's rendezvous store
instead, formed anew (``regroup``) as workers leave and join; a collective that fails
then does not raise: the engine keeps the failure (``failure``) for the job to act on at
its next step boundary, and the sum comes back as this rank's own values. A collective
in flight is given up (``give_up``) once the job hears of a failure elsewhere, through
its rendezvous store: with a worker lost, a rank can wait in a collective for a peer
that waits in another, until engine.timeout_s, however soon the others know.
"""

from __future__ import annotations

import gc
import itertools
import os
import socket
import threading
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.optim import Optimizer

from spotring.engines import is_collective_failure
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


@dataclass(frozen=True)
class Group:
    """A process group to join in place: through ``store`` (prefixed for this group
    alone), as ``rank`` of ``world_size``."""

    store: dist.Store
    rank: int
    world_size: int


def _end(held: list[Any]) -> None:
    """Let go of the group ``held`` holds, and of what cycles still hold it, here."""
    held.clear()
    gc.collect()


def backend_of(options: EngineOptions, device: torch.device) -> str:
    """The transport the backend option names: auto is NCCL on GPUs, Gloo on CPUs."""
    if options.backend == "auto":
        return "nccl" if device.type == "cuda" else "gloo"
    return str(options.backend)


class ProcessGroupEngine(Engine):
    """An engine over the default torch.distributed group, joined in the constructor
    with the ``options`` (EngineOptions: backend, timeout_s) on the ``launch``'s ranks,
    this one on ``device``; or, in place, on ``group``'s. Subclasses prepare the model;
    the collectives, the roll call of a failure, forming the group anew and leaving are
    here."""

    def __init__(self, options: EngineOptions, launch: Launch, device: torch.device,
                 group: Group | None = None) -> None:
        self.options = options
        self.local_rank, self.device = launch.local_rank, device
        self.backend = backend_of(options, device)
        self.timeout = timedelta(seconds=options.timeout_s)
        self.in_place = group is not None
        self.failure: BaseException | None = None  # in place: this step's failed collective
        # In place: the collectives in flight, each given up on a failure (give_up).
        self._in_flight: dict[int, Callable[[], None]] = {}
        self._in_flight_lock, self._keys = threading.Lock(), itertools.count()
        # In place: which of this process's groups is the current one (regroup counts
        # them): a failure met by a collective of a group dropped since is not this one's.
        self.group_number = 0
        self._join(group or Group(rendezvous(launch, self.timeout), launch.rank,
                                  launch.world_size))

    def _join(self, group: Group) -> None:
        self.store, self.rank, self.world_size = group.store, group.rank, group.world_size
        dist.init_process_group(
            # engine.backend=mpi: the group is Gloo, and DDP sums the gradients over MPI.
            "gloo" if self.backend == "mpi" else self.backend,
            store=dist.PrefixStore("pg", self.store), rank=self.rank,
            world_size=self.world_size, timeout=self.timeout,
            device_id=self.device if self.device.type == "cuda" else None,
        )
        # Who runs where, for error messages about lost ranks.
        self.ranks = self.all_gather_object(f"{socket.gethostname()} pid {os.getpid()}")

    def drop_group(self) -> None:
        """In place: leave the process group now. Its end is left to a thread of its own:
        Gloo ends a group once the work queued in it has, and with a worker lost that
        work can wait for a peer until engine.timeout_s (the peers give up their own
        waits as the rendezvous store tells them of the failure: give_up)."""
        if not dist.is_initialized():
            return
        broken = [dist.group.WORLD]
        dist.destroy_process_group()  # its last reference is in ``broken`` now
        threading.Thread(target=_end, args=(broken,), name="spotring-group-end",
                         daemon=True).start()

    def regroup(self, group: Group) -> None:
        """In place: leave the process group (drop_group) and join ``group``."""
        self.drop_group()
        with self._in_flight_lock:
            self.group_number += 1
            self.failure = None
        self._join(group)

    @property
    def replica_size(self) -> int:
        """In place: the workers that hold one whole copy of the model's state between
        them (every one alone; FSDPEngine: its group). Workers leave and join by copies."""
        return 1

    def send_model(self, model: nn.Module, source: int) -> None:
        """In place: rank ``source``'s parameters and buffers on every rank (a collective):
        the copies are one again."""
        with torch.no_grad():
            for tensor in [*model.parameters(), *model.buffers()]:
                dist.broadcast(tensor.data, src=source)

    def send_optimizer(self, optimizer: Optimizer, source: int) -> None:
        """In place: rank ``source``'s ``optimizer`` state and hyperparameters on every
        rank (a collective)."""
        box = [optimizer.state_dict()]
        dist.broadcast_object_list(box, src=source)
        optimizer.load_state_dict(box[0])

    def failed(self, error: BaseException, group_number: int | None = None) -> None:
        """In place: a collective of this step failed with ``error`` (a lost worker): kept
        for the job's next step boundary (the first such error of the step). No other
        collective of the group is started: with a worker gone, one could wait for a peer
        that waits elsewhere, until engine.timeout_s. (Called from DDP's hook too, on a
        Gloo thread, with the ``group_number`` its collective was started in: the work
        of a group dropped since fails as that group ends, which is no failure of the
        current one. The group is dropped from the training thread, at once after.)"""
        with self._in_flight_lock:
            if group_number in (None, self.group_number):
                # Kept without its traceback, whose frames hold the group the collective
                # failed in (DDP's own, at the second forward after a regroup): dropped,
                # that group must close its connections at once, so that the peers still
                # waiting in it go on, not at its timeout.
                self.failure = self.failure or error.with_traceback(None)

    def give_up(self, error: BaseException) -> None:
        """In place: a worker is lost (another rank met it: ``error`` says so); every
        collective of this rank in flight ends now, as failed (from any thread)."""
        self.failed(error)
        with self._in_flight_lock:
            ends, self._in_flight = list(self._in_flight.values()), {}
        for end in ends:
            end()

    @property
    def waiting(self) -> bool:
        """In place: whether a collective of this rank is in flight (in_flight)."""
        return bool(self._in_flight)

    def in_flight(self, end: Callable[[], None]) -> Callable[[], None]:
        """In place: a collective started, which ``end`` ends as failed where it is
        given up; returns what to call once it ended by itself."""
        with self._in_flight_lock:
            key = next(self._keys)
            self._in_flight[key] = end

        def landed() -> None:
            with self._in_flight_lock:
                self._in_flight.pop(key, None)

        return landed

    def _sum(self, tensor: torch.Tensor, group: Any = None,
             drop: bool = True) -> Callable[[], torch.Tensor]:
        """In place: start the sum of ``tensor`` over ``group`` (default all ranks); the
        returned function waits for it and returns it, or this rank's own values where
        the collective failed or was given up (the engine's ``failure`` says which), the
        group then dropped where ``drop`` (else at the optimizer's step: FSDP's backward
        goes on in the groups that stand)."""
        if self.failure is not None:  # the group is broken: no collective can complete
            return lambda: tensor
        ended = threading.Event()
        landed = self.in_flight(ended.set)
        try:
            future = dist.all_reduce(tensor, group=group, async_op=True).get_future()
        except Exception as e:
            if not is_collective_failure(e):
                raise
            self.failed(e)
            ended.set()
            future = None
        else:
            future.add_done_callback(lambda f: ended.set())

        def done() -> torch.Tensor:
            ended.wait()
            landed()
            if future is not None and future.done() and self.failure is None:
                try:
                    future.wait()
                except Exception as e:
                    if not is_collective_failure(e):
                        raise
                    self.failed(e)
            if self.failure is not None and drop:
                self.drop_group()
            return tensor

        return done

    def all_reduce_sum(self, tensor: torch.Tensor, name: str) -> torch.Tensor:
        if self.in_place:
            return self._sum(tensor)()
        dist.all_reduce(tensor)
        return tensor

    def start_sum(self, tensor: torch.Tensor, name: str) -> Callable[[], torch.Tensor]:
        if self.in_place:
            return self._sum(tensor)
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

    def leave(self) -> None:
        """In place: leave the job at once, without the others (who go on, or have
        formed a group of their own already): no barrier at ``shutdown``."""
        if dist.is_initialized():
            dist.destroy_process_group()
        self._let_go()

    def _let_go(self) -> None:
        """Free what reference cycles still hold of this process's group while the
        interpreter is whole (shutdown says why). A broken group's end is not waited for:
        with a peer gone silent it waits for engine.timeout_s, and its thread holds it."""
        gc.collect()

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
        self._let_go()
