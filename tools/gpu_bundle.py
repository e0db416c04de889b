"""The wheels a GPU machine lacks, in one folder: made here, installed there.

    make gpu-bundle                          # here, with the package index: gpu-bundle/
    .venv/bin/python tools/gpu_bundle.py DIR # the same into DIR

The folder holds spotring's own wheel, of the code that runs here (spotring.launch.wheel:
the same code gives the same bytes), and the wheels tools/gpu-bundle.txt names, at the
versions constraints.txt pins. Those are downloaded for CPython 3.12 on manylinux x86-64
(the offline GPU machine's Python, ../shared/DESIGN.md) without their dependencies: the
list is complete by itself. A package with no wheel on the index (antlr4-python3-runtime
4.9.3, which hydra-core 1.3 pins) is built into one here, and must then be pure Python to
run there. What travels to the GPU machine, the folder and the repository's tracked files
together, must fit in 64 MiB: the folder's size, the tracked files' and their sum are
printed, and more than that is an error (exit 1).

tools/gpu-check installs the folder there (tools/run_bundled.py: once per bundle, into a
cache) and refuses a bundle whose spotring is not the checkout's code: make it again after
changing the code, before the checkout travels.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

from spotring.launch import wheel

REPO = Path(__file__).resolve().parents[1]
LIST = REPO / "tools" / "gpu-bundle.txt"
CONSTRAINTS = REPO / "constraints.txt"
MIB = 2**20
TRAVEL_LIMIT = 64 * MIB  # the working tree and the carried folders, to the GPU machine
# pip download's words for the GPU machine's Python; pure-Python wheels are tagged "any".
GPU_PYTHON = ("--python-version", "3.12", "--implementation", "cp",
              "--platform", "manylinux2014_x86_64", "--platform", "manylinux_2_17_x86_64",
              "--platform", "any")


class BundleError(RuntimeError):
    """The bundle cannot be made; the message says why and what pip said."""


def requirements() -> list[str]:
    """The names in tools/gpu-bundle.txt, without comments."""
    lines = (line.split("#", 1)[0].strip() for line in LIST.read_text().splitlines())
    return [line for line in lines if line]


def _pip(*args: str | Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pip", *map(str, args)],
                          capture_output=True, text=True)


def _said(done: subprocess.CompletedProcess) -> str:
    return (done.stdout + done.stderr).strip()[-2000:]


def download(dest: Path, python: tuple[str, ...] = GPU_PYTHON) -> list[Path]:
    """Every wheel of the list into ``dest`` (emptied of wheels first, so that a changed
    pin leaves no second version behind), for the Python ``python`` names in pip
    download's options (() for this one). Returns the folder's wheels."""
    dest.mkdir(parents=True, exist_ok=True)
    for old in dest.glob("*.whl"):
        old.unlink()
    for name in requirements():
        done = _pip("download", "--quiet", "--no-deps", "--only-binary=:all:", *python,
                    "-c", CONSTRAINTS, "-d", dest, name)
        if done.returncode != 0:  # no wheel on the index: build one from the sdist
            before = set(dest.glob("*.whl"))
            done = _pip("wheel", "--quiet", "--no-deps", "-c", CONSTRAINTS, "-w", dest, name)
            built = set(dest.glob("*.whl")) - before
            if done.returncode == 0 and not all(w.name.endswith("-none-any.whl") for w in built):
                raise BundleError(f"{name} has no wheel for the GPU machine on the index, and "
                                  f"the one built here is not pure Python: "
                                  f"{', '.join(w.name for w in built)}")
        if done.returncode != 0:
            raise BundleError(f"{name}: no wheel, and none could be built:\n{_said(done)}")
    return sorted(dest.glob("*.whl"))


def make(dest: Path, python: tuple[str, ...] = GPU_PYTHON) -> list[Path]:
    """The bundle in ``dest``: download's wheels and spotring's own. Returns the wheels."""
    download(dest, python)
    wheel.build(dest)
    return sorted(dest.glob("*.whl"))


def tracked_bytes() -> int:
    """The size of the repository's tracked files as they are in the working tree."""
    listed = subprocess.run(["git", "ls-files", "-z"], cwd=REPO, capture_output=True,
                            check=True).stdout.decode()
    return sum(path.stat().st_size for path in (REPO / name for name in listed.split("\0")
                                                if name) if path.is_file())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tools/gpu_bundle.py",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("dir", nargs="?", type=Path, default=REPO / "gpu-bundle",
                        help="the folder (default: gpu-bundle/ in the checkout)")
    args = parser.parse_args(argv)
    try:
        wheels = make(args.dir)
    except BundleError as e:
        print(f"gpu-bundle: {e}", file=sys.stderr)
        return 1
    bundle, tracked = sum(w.stat().st_size for w in wheels), tracked_bytes()
    total = bundle + tracked
    print(f"{args.dir}: {len(wheels)} wheels, {bundle / MIB:.1f} MiB\n"
          f"the repository's tracked files: {tracked / MIB:.1f} MiB\n"
          f"together: {total / MIB:.1f} MiB of the {TRAVEL_LIMIT // MIB} MiB that travel to "
          "the GPU machine")
    if total > TRAVEL_LIMIT:
        print("gpu-bundle: too large to travel with the repository", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
