"""Launch-environment detection: each launcher's variables, and none; the allocator
setting; what train.precision=auto resolves to."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from spotring import torch_compat
from spotring.runtime import Launch, detect, pick_precision

CASES = {
    "torchrun": ({"RANK": "3", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "4",
                  "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500"},
                 Launch("torchrun", 3, 8, 1, 4)),
    "horovodrun": ({"HOROVOD_RANK": "5", "HOROVOD_SIZE": "16", "HOROVOD_LOCAL_RANK": "1",
                    "HOROVOD_LOCAL_SIZE": "8"}, Launch("horovodrun", 5, 16, 1, 8)),
    "open mpi": ({"OMPI_COMM_WORLD_RANK": "2", "OMPI_COMM_WORLD_SIZE": "4",
                  "OMPI_COMM_WORLD_LOCAL_RANK": "0", "OMPI_COMM_WORLD_LOCAL_SIZE": "2"},
                 Launch("mpi", 2, 4, 0, 2)),
    "mpich": ({"PMI_RANK": "1", "PMI_SIZE": "2", "MPI_LOCALRANKID": "1",
               "MPI_LOCALNRANKS": "2"}, Launch("mpi", 1, 2, 1, 2)),
    "slurm srun": ({"SLURM_STEP_ID": "0", "SLURM_PROCID": "6", "SLURM_NTASKS": "8",
                    "SLURM_LOCALID": "2", "SLURM_NTASKS_PER_NODE": "4(x2)"},
                   Launch("slurm", 6, 8, 2, 4)),
    # srun -N 3 -n 5 with no --ntasks-per-node: this node's count, from the step's.
    "slurm srun uneven": ({"SLURM_STEP_ID": "0", "SLURM_PROCID": "4", "SLURM_NTASKS": "5",
                           "SLURM_LOCALID": "0", "SLURM_NODEID": "2",
                           "SLURM_STEP_TASKS_PER_NODE": "2(x2),1"}, Launch("slurm", 4, 5, 0, 1)),
    # The batch script of an allocation is not a rank of an srun step.
    "slurm batch script": ({"SLURM_PROCID": "0", "SLURM_NTASKS": "8", "SLURM_LOCALID": "0"},
                           Launch("single", 0, 1, 0, 1)),
    "nothing": ({}, Launch("single", 0, 1, 0, 1)),
}


@pytest.mark.parametrize("name", CASES)
def test_detects_the_launcher_from_its_variables(name):
    env, expected = CASES[name]
    assert detect(env) == expected


# Allocates a 20 MB "activation" and frees it; prints whether glibc served it from a
# fresh mmap (given back to the kernel on free, faulted in again on every step), and
# how many bytes of heap the free handed back to the kernel (mallinfo2, glibc >= 2.33).
ONE_ACTIVATION = """
import ctypes, sys, torch
from spotring import runtime
if sys.argv[1] == "keep":
    assert runtime.keep_freed_memory()
class Mallinfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in ("arena", "ordblks", "smblks", "hblks",
                "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]
libc = ctypes.CDLL(None)
libc.mallinfo2.restype = Mallinfo2
mapped_before = libc.mallinfo2().hblkhd
activation = torch.ones(5_000_000)
mmapped = libc.mallinfo2().hblkhd - mapped_before >= activation.nbytes
heap = libc.mallinfo2().arena
del activation
print(mmapped, heap - libc.mallinfo2().arena)
"""


@pytest.mark.parametrize("mode", ["keep", "glibc default"])
def test_freed_activations_stay_in_the_process(mode):
    """With keep_freed_memory() (the trainer's setting), a 20 MB activation comes from the
    heap and stays there when freed, ready for the next step. glibc's default serves it
    from a fresh mmap, unmapped on free and zero-filled again next time (the control)."""
    out = subprocess.run([sys.executable, "-c", ONE_ACTIVATION, mode.split()[0]],
                         capture_output=True, text=True, check=True)
    mmapped, returned = out.stdout.split()
    if mode == "keep":
        assert (mmapped, int(returned)) == ("False", 0)
    else:
        assert mmapped == "True"


@pytest.mark.parametrize("capabilities, expected", [
    ({"avx512_bf16": True, "amx_bf16": False}, "bf16"),
    ({"avx512_bf16": False, "amx_bf16": True}, "bf16"),
    ({"avx512_bf16": False, "amx_bf16": False}, "fp32"),  # bf16 only emulated: slower
])
def test_auto_precision_is_bf16_only_where_the_cpu_computes_in_bf16(monkeypatch, capabilities,
                                                                    expected):
    # The CPU's capabilities are faked: no one machine has all three kinds of CPU.
    monkeypatch.setattr(torch_compat, "cpu_features",
                        lambda: {name for name, has in capabilities.items() if has})
    assert pick_precision("auto", torch.device("cpu"), "float32") == expected


def test_float64_runs_and_explicit_choices_keep_their_precision():
    cpu = torch.device("cpu")
    assert pick_precision("auto", cpu, "float64") == "fp32"
    assert [pick_precision(p, cpu, "float32") for p in ("fp32", "bf16", "fp16")] == [
        "fp32", "bf16", "fp16"]
