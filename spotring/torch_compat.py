"""torch's moving parts: every use spotring makes of a torch API that is private, or that
differs between the releases it supports (spotring/versions.py: 2.8 to 2.14), each with
its reason. Nothing else in spotring names a private part of torch (tests/test_versions.py
greps for them), so a new torch release is checked here, and tests at both ends of the
range (make test) cover every branch below.

    PartWriter        DCP's file writer, remembering the files this rank wrote
    store_reader      DCP's file reader over a spotring Store (S3, GCS, Azure Blob)
    cpu_features      the CPU's instruction sets, as torch names them
    compile_problem   why torch.compile cannot run on a device here, or None
    compiled_graphs   the graphs torch.compile has compiled in this process
    no_buffer_sync_in_forward   DDP's keyword for it, renamed in 2.14
"""

from __future__ import annotations

import contextlib
import inspect
import io
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.filesystem import FileSystemBase, FileSystemReader

from spotring.stores import Store

# ----------------------------------------------------------- distributed checkpoint


class PartWriter(dcp.FileSystemWriter):
    """DCP's file writer, remembering the names of the files this rank wrote
    (``written``). DCP reports them only in each write result's ``storage_data``, a
    private _StorageInfo whose ``relative_path`` is the file's name in the folder (the
    same from 2.8 to 2.14)."""

    written: list[str] = []

    def write_data(self, plan, planner):
        future = super().write_data(plan, planner)
        self.written = sorted({r.storage_data.relative_path for r in future.wait()})
        return future


def store_reader(store: Store, folder: str, read_ahead: int) -> FileSystemReader:
    """DCP's reader of the checkpoint in ``folder`` of ``store``, each piece read as a
    byte range of its part (``read_ahead`` bytes a request at least: DCP reads a tensor in
    many small reads). DCP reads through its reader's file system object, ``fs``, at
    ``path``: both private attributes, which no public way sets (its FsspecReader would
    need an fsspec file system per store, and s3fs pins botocore apart from boto3's)."""
    reader = FileSystemReader(folder)
    reader.fs = _StoreFiles(store, read_ahead)
    reader.path = folder
    return reader


class _StoreObject(io.RawIOBase):
    """An object of a store read as a seekable file, each read one ranged GET."""

    def __init__(self, store: Store, name: str) -> None:
        self.store, self.name, self.position = store, name, 0
        self._size: int | None = None

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.position

    def seek(self, offset: int, whence: int = os.SEEK_SET) -> int:
        if whence == os.SEEK_END:
            if self._size is None:
                self._size = self.store.size(self.name)
            offset += self._size
        elif whence == os.SEEK_CUR:
            offset += self.position
        self.position = offset
        return offset

    def readinto(self, buffer) -> int:
        data = self.store.read_range(self.name, self.position, len(buffer))
        buffer[: len(data)] = data
        self.position += len(data)
        return len(data)


class _StoreFiles(FileSystemBase):
    """What DCP's FileSystemReader asks of its file system, answered from a store
    (reads only)."""

    def __init__(self, store: Store, read_ahead: int) -> None:
        self.store, self.read_ahead = store, read_ahead

    @contextlib.contextmanager
    def create_stream(self, path: str | os.PathLike, mode: str) -> Iterator[io.IOBase]:
        if mode != "rb":
            raise io.UnsupportedOperation(f"a store's parts are read here, not written "
                                          f"({mode})")
        yield io.BufferedReader(_StoreObject(self.store, str(path)), self.read_ahead)

    def concat_path(self, path: str | os.PathLike, suffix: str) -> str:
        return f"{path}/{suffix}"

    def init_path(self, path: str | os.PathLike) -> str:
        return str(path)

    def _read_only(self, *args: Any) -> Any:
        raise io.UnsupportedOperation("a store's parts are read here, not written")

    rename = mkdir = rm_file = _read_only

    def exists(self, path: str | os.PathLike) -> bool:
        return str(path) in self.store.sizes(str(path))

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        return False


# ------------------------------------------------------------------------ the CPU


def cpu_features() -> set[str]:
    """The instruction sets this CPU has, by the names torch and Linux give them
    ("avx512_bf16", "amx_bf16", ...). torch.cpu.get_capabilities tells from torch 2.9 on;
    on 2.8, Linux's /proc/cpuinfo does (empty elsewhere)."""
    if hasattr(torch.cpu, "get_capabilities"):
        return {name for name, has in torch.cpu.get_capabilities().items() if has is True}
    return cpuinfo_flags()


def cpuinfo_flags(path: Path = Path("/proc/cpuinfo")) -> set[str]:
    """The first processor's flags in Linux's /proc/cpuinfo; empty where there is none."""
    try:
        with path.open() as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.partition(":")[2].split())
    except OSError:
        pass
    return set()


# ----------------------------------------------------------------- torch.compile


def compile_problem(device: torch.device) -> str | None:
    """Why torch.compile (its default backend, inductor) cannot run on ``device`` here, or
    None. torch says so only by failing at the first compiled call; its own checks are
    private: dynamo's platform check, inductor's search for a C++ compiler (CPUs), and
    whether Triton is installed (GPUs)."""
    import torch._dynamo

    try:
        torch._dynamo.eval_frame.check_if_dynamo_supported()
    except Exception as e:
        return f"torch.compile does not run on this platform ({e})"
    if device.type == "cpu":
        from torch._inductor import config as inductor_config
        from torch._inductor import cpp_builder

        try:  # the search inductor itself makes: $CXX, else g++
            cpp_builder.get_cpp_compiler()
        except RuntimeError:
            names = ", ".join(c for c in inductor_config.cpp.cxx if c)
            return (f"inductor compiles C++ for the CPU and finds no C++ compiler here "
                    f"(looked for {names}; set CXX or install g++)")
    else:
        from torch.utils._triton import has_triton

        if not has_triton():
            return "inductor needs Triton for GPU kernels, and it is not installed"
    return None


def compiled_graphs() -> int:
    """How many graphs torch.compile has compiled in this process so far (dynamo's own
    counter: torch has no public one)."""
    from torch._dynamo.utils import counters

    return counters["stats"]["unique_graphs"]


def no_buffer_sync_in_forward() -> dict[str, bool]:
    """DDP's keyword that keeps its forward from broadcasting buffers: forward_sync_buffers
    where torch has it (2.14: broadcast_buffers warns, deprecated), else broadcast_buffers."""
    parameters = inspect.signature(torch.nn.parallel.DistributedDataParallel).parameters
    key = "forward_sync_buffers" if "forward_sync_buffers" in parameters else "broadcast_buffers"
    return {key: False}
