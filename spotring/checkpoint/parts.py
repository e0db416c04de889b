"""Every rank's part of a checkpoint, written and read through torch.distributed.checkpoint.

    comm = Comm(group, rank, world_size)          # the checkpoint's collectives
    files = write(state, folder, comm)            # this rank's files in folder
    staged = Stager(pinned).stage(state, comm)    # this rank's share, copied to CPU memory
    files = write(staged, folder, comm)           # ... and written later, on any thread
    read(state, store, folder, comm)              # in place, from any store

DCP (``torch.distributed.checkpoint``) plans a save across the ranks: a sharded tensor
(FSDP's DTensor) is written by the rank that holds each shard, and a tensor every rank
holds alike (DDP, Horovod) by one rank only, the planner spreading them so that each
rank writes about its share. Each rank writes one file, ``__RANK_0.distcp``, and the
coordinator (rank 0) the ``.metadata`` that says where every piece of every tensor is. A
reader of any world size and any engine asks the metadata for the pieces of its own
tensors and reads only those: resharding on load. ``load_whole`` reads a checkpoint
whole, in one process.

From a bucket store (S3, GCS, Azure Blob) the pieces are read as byte ranges of the parts
(spotring.torch_compat.store_reader), so a rank downloads what it needs, not the
checkpoint. What DCP does differently from one torch release to another, or that only its
private parts allow, is spotring/torch_compat.py's. The manager (manager.py) publishes the
parts this module writes; layout.py lists and verifies them.
"""

from __future__ import annotations

import contextlib
import io
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import CheckpointException, FileSystemReader
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.planner import SavePlan, WriteItem, WriteItemType

from spotring.checkpoint.layout import EXTRAS, SINGLE_FILE, Checkpoint
from spotring.stores import DirectoryStore, Store
from spotring.torch_compat import PartWriter, store_reader

__all__ = ["ALONE", "CheckpointException", "Comm", "Staged", "Stager", "failures",
           "load_whole", "read", "write"]

# DCP's global metadata file in a checkpoint's folder, written by rank 0.
METADATA = ".metadata"
# A part in a bucket store is read ahead in requests of this size: DCP reads a tensor's
# bytes in many small reads, each one request without it.
_READ_AHEAD_BYTES = 8 * 1024 * 1024


@dataclass(frozen=True)
class Comm:
    """The collectives of a checkpoint: over ``group`` (a torch.distributed process group
    of every rank; None with one process), this process being ``rank`` of ``world_size``."""

    group: Any = None
    rank: int = 0
    world_size: int = 1

    @property
    def alone(self) -> bool:
        return self.world_size == 1

    def all_gather(self, obj: Any) -> list[Any]:
        """Every rank's ``obj``, in rank order."""
        if self.alone:
            return [obj]
        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, obj, group=self.group)
        return out

    def broadcast(self, obj: Any) -> Any:
        """Rank 0's ``obj`` on every rank."""
        if self.alone:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=0, group=self.group)
        return box[0]


ALONE = Comm()


def write(state: dict[str, Any] | Staged, folder: Path, comm: Comm) -> list[str]:
    """Save ``state`` (a collective over ``comm``): every rank writes its part into
    ``folder`` (each host its own, where the ranks do not share a disk). ``state``: the
    tensors themselves, or this rank's share of them as a Stager copied it (the same
    plan: each rank writes what it copied). Returns the names, in ``folder``, of the files
    this rank wrote (rank 0's include .metadata)."""
    folder.mkdir(parents=True, exist_ok=True)
    # overwrite: a save killed before its manifest left parts of this step, which the
    # manifest will not list (and the next save removes).
    writer = PartWriter(folder, overwrite=True)
    planner = _StagedPlanner(state) if isinstance(state, Staged) else None
    with _alone_is_meant(comm):
        dcp.save({} if planner else state, storage_writer=writer, planner=planner,
                 process_group=comm.group, no_dist=comm.alone)
    return writer.written + ([METADATA] if comm.rank == 0 else [])


@dataclass(frozen=True)
class Staged:
    """This rank's share of a save, planned with the other ranks and copied: ``plan`` (the
    pieces this rank writes, as DCP's planner assigned them) and ``copies`` (each piece's
    tensor in CPU memory, or an object's bytes), by piece."""

    plan: SavePlan
    copies: dict[MetadataIndex, torch.Tensor | bytes]


class Stager:
    """Copies of each rank's share of a state, for a save that writes them while training
    goes on. The ranks plan the save first (a collective: DCP's plan of who writes what),
    so that each copies only the pieces it will write: about 1/W of a state every rank
    holds alike (DDP, Horovod), its own shards under FSDP. The copies' buffers are kept
    from one save to the next (a fresh copy of a large state costs as much again in page
    faults); ``pinned`` (GPUs): in page-locked memory, so the copy runs at the bus's
    speed."""

    def __init__(self, pinned: bool) -> None:
        self.pinned = pinned
        self._buffers: dict[MetadataIndex, torch.Tensor] = {}

    def stage(self, state: dict[str, Any], comm: Comm) -> Staged:
        """This rank's share of ``state`` (a collective over ``comm``), copied."""
        planner = DefaultSavePlanner()
        planner.set_up_planner(state, is_coordinator=comm.rank == 0)
        local = planner.create_local_plan()
        # Every rank plans every rank's share as the coordinator will: the same plans in,
        # the same assignment out.
        mine = {item.index for item in planner.create_global_plan(
            comm.all_gather(local))[0][comm.rank].items}
        plan = SavePlan([item for item in local.items if item.index in mine],
                        planner_data=local.planner_data)
        copies = {item.index: self._copy(item, planner.resolve_data(item))
                  for item in plan.items}
        if self.pinned:  # the copies from the GPU were asynchronous
            torch.cuda.synchronize()
        self._buffers = {i: c for i, c in copies.items() if isinstance(c, torch.Tensor)}
        return Staged(plan, copies)

    def _copy(self, item: WriteItem, data: torch.Tensor | io.BytesIO) -> torch.Tensor | bytes:
        if item.type == WriteItemType.BYTE_IO:
            return data.getvalue()
        buffer = self._buffers.get(item.index)
        if buffer is None or buffer.shape != data.shape or buffer.dtype != data.dtype:
            buffer = torch.empty(data.shape, dtype=data.dtype, device="cpu",
                                 pin_memory=self.pinned)
        return buffer.copy_(data.detach(), non_blocking=self.pinned)


class _StagedPlanner(DefaultSavePlanner):
    """DCP's planner for a share a Stager copied: this rank's plan and data are the
    copies, so the save never reads the live tensors training goes on changing."""

    def __init__(self, staged: Staged) -> None:
        super().__init__()
        self.staged = staged

    def set_up_planner(self, state_dict, storage_meta=None, is_coordinator=False) -> None:
        self.is_coordinator = is_coordinator

    def create_local_plan(self) -> SavePlan:
        self.plan = self.staged.plan
        return self.plan

    def resolve_data(self, write_item: WriteItem) -> torch.Tensor | io.BytesIO:
        data = self.staged.copies[write_item.index]
        return io.BytesIO(data) if isinstance(data, bytes) else data


def read(state: dict[str, Any], store: Store, folder: str, comm: Comm) -> None:
    """Load the checkpoint in ``folder`` of ``store`` into ``state``'s tensors, in place (a
    collective over ``comm``): each rank reads the pieces its own tensors hold, from any
    world size."""
    reader = (FileSystemReader(store.path / folder) if isinstance(store, DirectoryStore)
              else store_reader(store, folder, _READ_AHEAD_BYTES))
    with _alone_is_meant(comm):
        dcp.load(state, storage_reader=reader, process_group=comm.group, no_dist=comm.alone)


@contextlib.contextmanager
def _alone_is_meant(comm: Comm) -> Iterator[None]:
    """Without DCP's warning that one process "assumes" it is alone: here it is."""
    with warnings.catch_warnings():
        if comm.alone:
            warnings.filterwarnings("ignore", "torch.distributed is disabled")
        yield


def failures(error: BaseException, rank: int) -> dict[int, BaseException]:
    """What failed on which rank: a CheckpointException's own (DCP gathers every rank's
    into one, with its traceback), else ``error`` on ``rank``."""
    if isinstance(error, CheckpointException):
        return {r: failure[0] for r, failure in error.failures.items()}
    return {rank: error}


def load_whole(checkpoint: Checkpoint) -> dict[str, Any]:
    """The whole of ``checkpoint``, in this one process, as plain tensors on the CPU:
    {tracked name: state_dict, ..., "spotring": {step, rng, ...}}. For readers outside a
    job (tests, tools) and a rank 0 that sends the others their parts; a job's ranks each
    read their own part (``read``). Format 1 is one .pt; format 2 DCP's parts, read where
    they lie (a directory) or fetched to a temporary folder first (a bucket store), and
    rank 0's spotring.pt beside them."""
    import tempfile

    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    store = checkpoint.store
    if checkpoint.format == SINGLE_FILE:
        data = store.read(next(iter(checkpoint.parts())))
        # weights_only: a checkpoint holds tensors and containers, nothing to execute.
        return torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "parts"
        if isinstance(store, DirectoryStore):
            folder = store.path / checkpoint.folder
        else:
            folder.mkdir()
            for name in checkpoint.parts():
                (folder / name.split("/", 1)[1]).write_bytes(store.read(name))
        whole = Path(tmp) / "whole.pt"
        with _alone_is_meant(ALONE):
            dcp_to_torch_save(folder, whole)
        loaded = torch.load(whole, map_location="cpu", weights_only=True)
        loaded.update(torch.load(folder / EXTRAS, map_location="cpu", weights_only=True))
    return loaded
