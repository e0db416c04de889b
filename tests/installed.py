"""spotring as a user has it after `pip install spotring`, for tests that run it so.

    spotring_venv(dest)     a virtual environment at ``dest`` with spotring installed
                            from the wheel setuptools builds of this checkout (as pip
                            would), and .venv's packages (torch and the rest) underneath

The new environment reads .venv's site-packages through a path line in a .pth file: a
path line does not run .venv's own .pth files, so not the editable install's finder
either, and spotring, trainer, launch, conf... come from the new environment's
site-packages alone (as long as neither the caller's cwd nor PYTHONPATH is the checkout).
"""

from __future__ import annotations

import functools
import logging
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

from spotring.launch import project

REPO = Path(__file__).resolve().parents[1]
log = logging.getLogger(__name__)
_kept: list[tempfile.TemporaryDirectory] = []  # the wheel's folder, until the process ends


def spotring_venv(dest: Path) -> Path:
    """``dest``, a new virtual environment with this checkout's wheel installed (built
    once per process, about 1 s; each environment about 2 s more)."""
    started = time.monotonic()
    python = Path(sys.executable)  # .venv's (`make test`)
    subprocess.run([python, "-m", "venv", "--without-pip", dest], check=True, timeout=120)
    site = Path(subprocess.run(
        [dest / "bin" / "python", "-c", "import sysconfig; print(sysconfig.get_paths()"
         "['purelib'])"], check=True, capture_output=True, text=True).stdout.strip())
    (site / "spotring-borrowed.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    subprocess.run([python, "-m", "pip", "--python", dest / "bin" / "python", "install",
                    "--no-deps", "--force-reinstall", "-q", _wheel()], check=True, timeout=300)
    log.info("spotring_venv: %s in %.1f s", dest, time.monotonic() - started)
    return dest


@functools.cache
def _wheel() -> Path:
    """spotring-<version>-py3-none-any.whl of the checkout, as `pip wheel` builds it. From
    a copy of the files git lists (less data/): setuptools would reuse, and race other
    builds on, the checkout's build/, which can hold modules deleted since."""
    started = time.monotonic()
    scratch = tempfile.TemporaryDirectory(prefix="spotring-wheel-")
    _kept.append(scratch)
    src, out = Path(scratch.name) / "src", Path(scratch.name) / "wheels"
    for name, path in project.files(REPO).items():
        if not name.startswith("data/"):
            (src / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(path, src / name)
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                    "-q", "-w", out, src], check=True, timeout=300)
    wheel = next(out.glob("spotring-*.whl"))
    log.info("spotring_venv: built %s in %.1f s", wheel.name, time.monotonic() - started)
    return wheel
