"""Who am I: the launcher's environment, this rank's device, threads and seeds.

No flag says how a run was started; the environment does:

    launcher     variables read                                  rendezvous for engine=ddp
    torchrun     RANK WORLD_SIZE LOCAL_RANK MASTER_ADDR/PORT     torchrun's store
    horovodrun   HOROVOD_RANK HOROVOD_SIZE HOROVOD_LOCAL_RANK    rank 0 posts its store
                 HOROVOD_GLOO_RENDEZVOUS_ADDR/PORT               address to horovodrun's
                                                                 rendezvous server
    Open MPI     OMPI_COMM_WORLD_{RANK,SIZE,LOCAL_RANK,...}      mpi4py: rank 0 opens a
    MPICH/Hydra  PMI_RANK PMI_SIZE MPI_LOCALRANKID               store, broadcasts address
                                                                 and port
    SLURM srun   SLURM_PROCID SLURM_NTASKS SLURM_LOCALID         MASTER_ADDR or the step's
                 SLURM_STEP_TASKS_PER_NODE SLURM_NODEID          first node, MASTER_PORT or
                                                                 one derived from the job id
    (none)       a single process                                none (no process group)

Horovod does its own rendezvous (hvd.init); engine=horovod only reads the ranks.
"""

from __future__ import annotations

import ctypes
import logging
import os
import platform
import random
import socket
import subprocess
from dataclasses import dataclass

import torch

from spotring import torch_compat

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Launch:
    launcher: str  # torchrun | horovodrun | mpi | slurm | single
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int


def _ints(env: dict[str, str], *names: str) -> list[int] | None:
    if all(n in env for n in names):
        return [int(env[n]) for n in names]
    return None


def detect(env: dict[str, str] | None = None) -> Launch:
    """The launch this process belongs to, from environment variables alone."""
    env = dict(os.environ if env is None else env)
    if (v := _ints(env, "RANK", "WORLD_SIZE", "LOCAL_RANK")) is not None:
        local_world = int(env.get("LOCAL_WORLD_SIZE", v[1]))
        return Launch("torchrun", v[0], v[1], v[2], local_world)
    if (v := _ints(env, "HOROVOD_RANK", "HOROVOD_SIZE", "HOROVOD_LOCAL_RANK",
                   "HOROVOD_LOCAL_SIZE")) is not None:
        return Launch("horovodrun", *v)
    if (v := _ints(env, "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE",
                   "OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE")) is not None:
        return Launch("mpi", *v)
    if (v := _ints(env, "PMI_RANK", "PMI_SIZE")) is not None:
        local = _ints(env, "MPI_LOCALRANKID", "MPI_LOCALNRANKS") or [0, 1]
        return Launch("mpi", v[0], v[1], *local)
    # SLURM_STEP_ID: inside an srun step, not merely in the batch script of an allocation.
    if "SLURM_STEP_ID" in env and (v := _ints(env, "SLURM_PROCID", "SLURM_NTASKS",
                                               "SLURM_LOCALID")) is not None:
        return Launch("slurm", *v, _slurm_local_world_size(env, v[1]))
    return Launch("single", 0, 1, 0, 1)


def _slurm_local_world_size(env: dict[str, str], world_size: int) -> int:
    """This node's tasks in the step. SLURM_STEP_TASKS_PER_NODE counts them for each node
    of the step, compressed ("2(x3),1": 2, 2, 2, 1); SLURM_NODEID is this node's index.
    SLURM_NTASKS_PER_NODE is set only where --ntasks-per-node was asked for."""
    spec = env.get("SLURM_STEP_TASKS_PER_NODE") or env.get("SLURM_NTASKS_PER_NODE", "")
    counts = []
    for part in filter(None, spec.split(",")):
        count, _, times = part.partition("(x")
        counts += [int(count)] * int(times.rstrip(")") or 1)
    if not counts:
        return world_size
    return counts[min(int(env.get("SLURM_NODEID", 0)), len(counts) - 1)]


def env_rank() -> int:
    """This process's rank, readable before anything is initialised."""
    return detect().rank


def pick_device(preference: str, local_rank: int) -> torch.device:
    """One process per GPU: the local rank picks the GPU. CPU where there is none."""
    if preference == "cpu" or (preference == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    if not torch.cuda.is_available():
        from spotring.exits import ConfigError

        raise ConfigError("device=cuda, but torch sees no GPU on this machine; valid here: "
                          "auto, cpu")
    device = torch.device("cuda", local_rank % torch.cuda.device_count())
    torch.cuda.set_device(device)
    return device


def pick_precision(preference: str, device: torch.device, dtype: str) -> str:
    """The precision ``preference`` (fp32, bf16, fp16 or auto) resolves to for a model of
    ``dtype`` (float32, float64...) on ``device``. auto: bf16 where ``device`` computes in
    bfloat16 natively (GPUs from Ampere on; CPUs with AVX512-BF16 or AMX), else fp32;
    always fp32 for float64. Where bf16 is emulated it is slower than fp32, so auto does
    not choose it."""
    if preference != "auto":
        return preference
    if dtype == "float64":
        return "fp32"
    if device.type == "cuda":
        native = torch.cuda.is_bf16_supported(including_emulation=False)
    else:
        native = bool({"avx512_bf16", "amx_bf16"} & torch_compat.cpu_features())
    return "bf16" if native else "fp32"


def set_threads(threads: int | None, local_world_size: int) -> int:
    """Split this machine's cores between its workers unless told otherwise."""
    if threads is None:
        threads = max(1, len(os.sched_getaffinity(0)) // max(1, local_world_size))
    torch.set_num_threads(threads)
    return threads


# glibc's mallopt(3) parameters, from <malloc.h>.
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
_MMAP_THRESHOLD_MAX = 32 * 2**20  # the largest glibc accepts on 64-bit


def keep_freed_memory() -> bool:
    """Stop glibc's malloc from handing each step's activations back to the kernel.

    A training step frees tens of MB of activations at its end and allocates them again
    in the next. glibc serves large blocks from fresh mmaps or the heap and trims the
    heap top whenever enough of it is free, adapting both thresholds as blocks come and
    go; depending on how they drifted, every step faults in and zero-fills thousands of
    fresh pages. On the default MNIST job (1 process, batch 128) that drift cost a
    quarter of the step time: 2.9 million page faults and 10 s of system time in 300
    steps, against 0.2 million (start-up alone) with fixed thresholds. Fixed thresholds
    keep freed memory in the process, as jemalloc and tcmalloc do: blocks up to 32 MiB
    come from the heap, which is never trimmed. Left alone where the user tuned malloc
    through its MALLOC_*_ variables, or the C library is not glibc. True if applied.
    """
    if platform.libc_ver()[0] != "glibc" or any(
            v in os.environ for v in ("MALLOC_TRIM_THRESHOLD_", "MALLOC_MMAP_THRESHOLD_")):
        return False
    libc = ctypes.CDLL(None)
    return bool(libc.mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD_MAX)
                and libc.mallopt(_M_TRIM_THRESHOLD, -1))  # -1: never trim


def seed_all(seed: int) -> None:
    random.seed(seed)
    torch.manual_seed(seed)  # also seeds every CUDA device


def rng_state() -> dict:
    state = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


# ------------------------------------------------------------------------- addresses


def outward_address() -> str:
    """An IPv4 address of this host that other hosts can reach (not loopback)."""
    try:
        addr = socket.gethostbyname(socket.gethostname())
        if not addr.startswith("127."):
            return addr
    except OSError:
        pass
    # The hostname maps to loopback (Debian's 127.0.1.1): ask the interfaces instead.
    try:
        out = subprocess.run(["hostname", "-I"], capture_output=True, text=True, timeout=5)
        for addr in out.stdout.split():
            if "." in addr and not addr.startswith("127."):
                return addr
    except (OSError, subprocess.SubprocessError):
        pass
    return "127.0.0.1"


def slurm_master_addr(env: dict[str, str]) -> str:
    """SLURM puts task 0 on the first node of the step: of the allocation only where
    the step spans all of it (an `srun -N 1` in a 2-node batch job does not)."""
    if "MASTER_ADDR" in env:
        return env["MASTER_ADDR"]
    nodes = env.get("SLURM_STEP_NODELIST") or env["SLURM_JOB_NODELIST"]
    out = subprocess.run(["scontrol", "show", "hostnames", nodes],
                         capture_output=True, text=True, check=True)
    return out.stdout.split()[0]
