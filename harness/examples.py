"""examples/ run as their users start them (tests/test_examples.py, and srun's in
tests/test_slurm.py): a small image folder two classes apart (``write_images``), an
example script under a launcher in a session of its own (``started``), to its end
(``run``), and the weights it saved (``weights``). In float64, so that runs on any
number of workers agree to 1e-10 (tests/test_equivalence.py says why)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import torch
from PIL import Image

from harness import REPO
from harness.cores import cores
from spotring.launch.commands import BIN, local_environment

EXAMPLES = REPO / "examples"
# 2 classes x 48 training images: 6 steps of 16 per epoch, 18 in all; every global batch
# splits over 1, 2 and 4 workers.
PER_CLASS, TEST_PER_CLASS, GLOBAL_BATCH, EPOCHS, SEED = 48, 16, 16, 3, 5
STEPS_PER_EPOCH = 2 * PER_CLASS // GLOBAL_BATCH
ARGS = ["--epochs", str(EPOCHS), "--batch-size", str(GLOBAL_BATCH), "--dtype", "float64",
        "--seed", str(SEED), "--lr", "0.05"]
TIMEOUT = 120  # seconds for one run; they take 3 to 15 here


def command(launcher: str, nproc: int, script: str, *args: str) -> list[str]:
    """launch.commands.local_command's launchers, running an example script as users do;
    srun: ``nproc`` nodes of one task each, of the cluster $SLURM_CONF names."""
    python = [sys.executable, str(EXAMPLES / script), *args]
    return {
        "single": python,
        "torchrun": [str(BIN / "torchrun"), "--standalone", "--nproc-per-node", str(nproc),
                     *python[1:]],
        "mpirun": [str(BIN / "mpirun"), "-np", str(nproc), "--oversubscribe", *python],
        "horovodrun": [str(BIN / "horovodrun"), "-np", str(nproc), "-H", f"localhost:{nproc}",
                       *python],
        "srun": ["srun", "-N", str(nproc), "--ntasks-per-node=1", *python],
    }[launcher]


@contextlib.contextmanager
def started(launcher: str, nproc: int, data: Path, out: Path, *extra: str,
            script: str = "train.py") -> Iterator[subprocess.Popen]:
    """An example running in a session of its own, whose processes all end with the
    ``with`` (killed if need be: a failed assertion leaves no rank behind)."""
    args = ["--data", str(data), "--out", str(out), *ARGS, *extra]
    proc = subprocess.Popen(command(launcher, nproc, script, *args), cwd=REPO, text=True,
                            env=local_environment(), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, start_new_session=True)
    try:
        yield proc
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)


def run(launcher: str, nproc: int, data: Path, out: Path, *extra: str,
        script: str = "train.py") -> Path:
    """Run an example to its end (exit 0); returns its weights.pt."""
    with cores(nproc), started(launcher, nproc, data, out, *extra, script=script) as proc:
        output, _ = proc.communicate(timeout=TIMEOUT)
    assert proc.returncode == 0, f"exit {proc.returncode}\n{output[-6000:]}"
    return out / "weights.pt"


def weights(path: Path) -> dict[str, torch.Tensor]:
    return torch.load(path, weights_only=True)


def write_images(root: Path) -> None:
    """Grey 8x8 PNGs a small CNN tells apart: class "dark" and class "light" differ by
    100 grey levels, on noise of 156."""
    generator = torch.Generator().manual_seed(0)
    for split, count in (("train", PER_CLASS), ("test", TEST_PER_CLASS)):
        for offset, name in ((0, "dark"), (100, "light")):
            (root / split / name).mkdir(parents=True)
            for i in range(count):
                pixels = torch.randint(0, 156, (8, 8), generator=generator) + offset
                Image.fromarray(pixels.to(torch.uint8).numpy(), mode="L").save(
                    root / split / name / f"{i:03d}.png")
