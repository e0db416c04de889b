"""The command lines that start N ranks on this machine, one per launcher, in one place:
of the trainer (python -m spotring.trainer ARGS), or of a command of the user's own (CMD).

    torchrun    torchrun --standalone --nproc-per-node N -m spotring.trainer ARGS (--no-python CMD)
    mpirun      mpirun -np N --oversubscribe python -m spotring.trainer ARGS     (CMD)
    horovodrun  horovodrun -np N -H localhost:N python -m spotring.trainer ARGS  (CMD)
    single       python -m spotring.trainer ARGS                                    (CMD)
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from pathlib import Path

LAUNCHERS = ("single", "torchrun", "mpirun", "horovodrun")
BIN = Path(sys.executable).parent


def local_command(launcher: str, nproc: int, args: list[str], module: str = "spotring.trainer",
                  command: Sequence[str] = ()) -> list[str]:
    """Start ``nproc`` ranks of ``python -m module ARGS``, or of ``command`` where one is
    given, on this machine."""
    python = list(command) or [sys.executable, "-m", module, *args]
    if launcher == "single":
        return python
    if launcher == "torchrun":
        program = ["--no-python", *command] if command else ["-m", module, *args]
        return [str(BIN / "torchrun"), "--standalone", "--nproc-per-node", str(nproc),
                *program]
    if launcher == "mpirun":
        # --oversubscribe: more ranks than cores is fine for CPU tests and benchmarks.
        return [str(BIN / "mpirun"), "-np", str(nproc), "--oversubscribe", *python]
    if launcher == "horovodrun":
        # --gloo: Horovod's Gloo controller, whose rendezvous server also carries DDP's
        # store address, so both engines run under it (mpirun covers the MPI controller).
        return [str(BIN / "horovodrun"), "--gloo", "-np", str(nproc), "-H", f"localhost:{nproc}",
                *python]
    raise ValueError(f"launcher {launcher!r}: valid: {', '.join(LAUNCHERS)}")


# Open MPI refuses root unless told (containers, CI and the local cluster run as root).
AS_ROOT = {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"}
# What every launcher gets, here and on cluster nodes (launch.job_command): the consent
# to root, and unbuffered output so that rank 0's lines stream as they are printed.
LAUNCHER_ENV = {**AS_ROOT, "PYTHONUNBUFFERED": "1"}


def local_environment(**extra: str) -> dict[str, str]:
    """This environment, with the venv's launchers first and Open MPI allowed as root."""
    env = dict(os.environ)
    env.update(PATH=f"{BIN}:{env.get('PATH', '')}", **LAUNCHER_ENV)
    env.update(extra)
    return env
