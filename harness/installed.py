"""spotring as a user has it after `pip install spotring`, for tests that run it so.

    checkout_wheel()        the wheel setuptools builds of this checkout (as pip would),
                            built once for the files as they are
    spotring_venv(dest)     a virtual environment at ``dest`` with that wheel installed,
                            and .venv's packages (torch and the rest) underneath

The new environment reads .venv's site-packages through a path line in a .pth file: a
path line does not run .venv's own .pth files, so not the editable install's finder
either, and spotring, trainer, launch, conf... come from the new environment's
site-packages alone (as long as neither the caller's cwd nor PYTHONPATH is the checkout).
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import time
from importlib.metadata import version
from pathlib import Path

from filelock import FileLock, Timeout

from harness import REPO
from harness.cores import cores
from spotring.launch import project

# The wheels built, one folder for each state of the files; shared by pytest-xdist's
# workers, the sessions that follow, and every user of this module.
CACHE = Path(tempfile.gettempdir()) / f"spotring-test-wheels-{os.getuid()}"
STALE_S = 24 * 3600  # a wheel no one took for this long is deleted
log = logging.getLogger(__name__)


def spotring_venv(dest: Path) -> Path:
    """``dest``, a new virtual environment with this checkout's wheel installed (about
    2 s, once the wheel is built)."""
    started = time.monotonic()
    python = Path(sys.executable)  # .venv's (`make test`)
    with cores(1):
        subprocess.run([python, "-m", "venv", "--without-pip", dest], check=True, timeout=120)
        site = Path(subprocess.run(
            [dest / "bin" / "python", "-c", "import sysconfig; print(sysconfig.get_paths()"
             "['purelib'])"], check=True, capture_output=True, text=True).stdout.strip())
        (site / "spotring-borrowed.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
        subprocess.run([python, "-m", "pip", "--python", dest / "bin" / "python", "install",
                        "--no-deps", "--force-reinstall", "-q", checkout_wheel()], check=True,
                       timeout=300)
    log.info("spotring_venv: %s in %.1f s", dest, time.monotonic() - started)
    return dest


@functools.cache
def checkout_wheel() -> Path:
    """spotring-<version>-py3-none-any.whl of the checkout as it is now, as `pip wheel`
    builds it, from a copy of the files git lists (less data/): setuptools would reuse,
    and race other builds on, the checkout's build/, which can hold modules deleted since.

    Built once for those files as they are: kept in CACHE under a hash of their names and
    contents and of the setuptools that builds them, behind a file lock, so that every
    pytest-xdist worker, and every session after, takes the one built first until a file
    changes. Wheels no one took for STALE_S are deleted."""
    files = {name: path for name, path in project.files(REPO).items()
             if not name.startswith("data/")}
    key = _key(files)
    CACHE.mkdir(exist_ok=True)
    folder = CACHE / key
    with FileLock(CACHE / f"{key}.lock"):
        if not folder.is_dir():
            _build(files, folder)
        os.utime(folder)  # taken now: not stale
    _delete_stale(but=key)
    return next(folder.glob("spotring-*.whl"))


def _key(files: dict[str, Path]) -> str:
    digest = hashlib.sha256(f"setuptools {version('setuptools')}\n".encode())
    for name, path in sorted(files.items()):
        digest.update(f"{name}\n{path.stat().st_mode & 0o111:o}\n".encode())
        digest.update(hashlib.sha256(path.read_bytes()).digest())
    return digest.hexdigest()[:20]


def _build(files: dict[str, Path], folder: Path) -> None:
    """The wheel of ``files`` into ``folder``, whole or not at all: built in a scratch
    folder beside it (what a killed build left there is cleared first), then renamed."""
    started = time.monotonic()
    scratch = folder.with_suffix(".building")
    shutil.rmtree(scratch, ignore_errors=True)
    src, out = scratch / "src", scratch / "wheels"
    for name, path in files.items():
        (src / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(path, src / name)
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                    "-q", "-w", out, src], check=True, timeout=300)
    out.rename(folder)
    shutil.rmtree(scratch)
    log.info("checkout_wheel: built %s in %.1f s", folder, time.monotonic() - started)


def _delete_stale(but: str) -> None:
    """Delete the wheels (and killed builds) no one took for STALE_S, each under its lock,
    where no one holds it: a session that takes one at the same time touches it first,
    and so keeps it."""
    for entry in CACHE.iterdir():
        key = entry.name.split(".")[0]
        if key == but or not entry.is_dir():
            continue
        try:
            with FileLock(CACHE / f"{key}.lock", timeout=0):
                if entry.is_dir() and time.time() - entry.stat().st_mtime > STALE_S:
                    shutil.rmtree(entry)
        except Timeout:
            continue  # in use
