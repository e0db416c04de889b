"""Start a script with a bundle's wheels installed first: how tools/gpu-check starts
tools/gpu_check.py on a machine whose Python has torch but not spotring (docs/gpu.md).

    python tools/run_bundled.py SCRIPT [ARGS...]    # ARGS may hold --bundle DIR

With ``--bundle DIR`` among ARGS (the folder `make gpu-bundle` made: spotring's wheel and
those its trainer needs beside torch), the wheels are installed once per bundle and Python
into a cache, $XDG_CACHE_HOME/spotring/bundles/KEY (default ~/.cache/...; KEY: a digest of
the wheels' names and bytes and of the Python), and that folder goes first on the path of
SCRIPT and of every process it starts (PYTHONPATH). The bundle's spotring must be the code
of the checkout this file is in (its modules and conf/'s files, against the wheel's
RECORD): otherwise the checks would prove code other than the one at hand. Then
``python SCRIPT ARGS`` replaces this process: the same pid, so that a signal sent to the
kit reaches it. ARGS go to SCRIPT whole, --bundle too (it records what it ran with).

Standard library only, run by its path: nothing of spotring can be imported before this has
run. A wheel is installed by unpacking it (as pip does for --target, without pip, which an
offline machine's Python may lack): its .data/purelib and platlib go beside the rest; its
scripts, headers and data are left out, nothing the kit runs needs them. Every process
started this way imports spotring from where it is installed, never from the directory
it runs in (PYTHONSAFEPATH): a checkout's spotring/ folder is only the base package.

Exit code 2, before anything starts, with what to do: a bundle with no wheels, a wheel for
another Python, a bundle without spotring or of other code than the checkout's, no
spotring at all.
"""

from __future__ import annotations

import base64
import csv
import hashlib
import importlib.util
import io
import os
import platform
import shutil
import sys
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CONF = "spotring/conf/"  # the configuration's files in the wheel: code, like the modules
SHOWN = 5  # stale files named in the message


class Unusable(Exception):
    """The bundle cannot be used here; the message says why and what to do."""


def bundle_of(args: list[str]) -> Path | None:
    """The folder after --bundle in ``args`` (``--bundle DIR`` or ``--bundle=DIR``)."""
    for i, arg in enumerate(args):
        if arg == "--bundle" and i + 1 < len(args):
            return Path(args[i + 1])
        if arg.startswith("--bundle="):
            return Path(arg.split("=", 1)[1])
    return None


def cache_root() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "spotring" / "bundles"


def install(bundle: Path) -> Path:
    """``bundle``'s wheels installed for this Python (once: an earlier install of the same
    wheels is reused); the folder to put on the path."""
    wheels = sorted(bundle.glob("*.whl"))
    foreign = [w.name for w in wheels if not supported(w)]
    if foreign:
        raise Unusable(f"{bundle}: {', '.join(foreign)} cannot run on this Python, "
                       f"{sys.executable} ({platform.python_implementation()} "
                       f"{platform.python_version()} on {platform.machine()}); the bundle is "
                       "made for CPython 3.12 on x86-64 Linux: give PYTHON=the python3.12 "
                       "that has torch")
    site = cache_root() / key(wheels)
    if site.is_dir():
        return site
    # Unpacked beside it, then renamed: an install cut off midway is never used.
    partial = site.with_name(f"{site.name}.partial-{os.getpid()}")
    shutil.rmtree(partial, ignore_errors=True)
    try:
        for wheel in wheels:
            unpack(wheel, partial)
        partial.rename(site)
    except OSError:
        if not site.is_dir():  # not another kit's install of the same bundle, just done
            raise
    finally:
        shutil.rmtree(partial, ignore_errors=True)
    return site


def key(wheels: list[Path]) -> str:
    """A digest of the wheels' names and bytes and of this Python."""
    digest = hashlib.sha256(f"{sys.implementation.cache_tag} {sys.executable}\n".encode())
    for wheel in wheels:
        digest.update(f"{wheel.name}\n".encode())
        digest.update(wheel.read_bytes())
    return digest.hexdigest()[:16]


def supported(wheel: Path) -> bool:
    """Whether this Python can run ``wheel``, by its file name's tags (PEP 427): the
    Python (py3, py3X, cp3X, or cp3Y with the stable ABI for Y at most X), and the
    platform (any, or a Linux tag of this machine's architecture)."""
    pythons, abi, platforms = wheel.name[:-len(".whl")].split("-")[-3:]
    minor = sys.version_info.minor
    cpython = sys.implementation.name == "cpython"

    def runs(tag: str) -> bool:
        if tag in ("py3", f"py3{minor}"):
            return True
        if not (cpython and tag.startswith("cp3") and tag[3:].isdigit()):
            return False
        return int(tag[3:]) == minor or abi == "abi3" and int(tag[3:]) <= minor

    machine = platform.machine()
    on_here = any(p == "any" or sys.platform == "linux" and "linux" in p
                  and p.endswith(f"_{machine}") for p in platforms.split("."))
    return any(map(runs, pythons.split("."))) and on_here


def unpack(wheel: Path, site: Path) -> None:
    """``wheel``'s files into ``site``, its .data/purelib and platlib among them."""
    with zipfile.ZipFile(wheel) as archive:
        for member in archive.infolist():
            parts = member.filename.split("/")
            if parts[0].endswith(".data"):
                if parts[1:2] not in (["purelib"], ["platlib"]):
                    continue  # scripts, headers, data: nothing the kit runs
                parts = parts[2:]
            if member.is_dir() or not parts or ".." in parts or member.filename.startswith("/"):
                continue
            target = site.joinpath(*parts)
            target.parent.mkdir(parents=True, exist_ok=True)
            with archive.open(member) as source, open(target, "wb") as out:
                shutil.copyfileobj(source, out)
            if member.external_attr >> 16 & 0o111:
                target.chmod(0o755)


def spotring_wheel(bundle: Path) -> Path:
    """The bundle's wheel of spotring; raises where it has none (a bundle made before it
    held one)."""
    found = sorted(bundle.glob("spotring-*.whl"))
    if not found:
        raise Unusable(f"{bundle}: no wheel of spotring there; `make gpu-bundle` makes the "
                       "bundle with it")
    return found[-1]


def code(name: str) -> bool:
    """Whether a file of spotring's wheel is code: a module, or a file of conf/. (Not the
    .yaml of a run's .hydra/ folder under benchmarks/results, which git ignores.)"""
    return name.endswith(".py") or name.startswith(CONF) and name.endswith(".yaml")


def stale(wheel: Path, repo: Path) -> list[str]:
    """The code files (``code``) that ``wheel`` holds otherwise than the checkout ``repo``,
    that it lacks, or that the checkout lacks: each as 'PATH (changed|new|gone)'. The
    wheel's names map to the checkout's folders as pyproject.toml's package-dir says."""
    import tomllib  # Python 3.11 on; a bundle is for 3.12

    folders = tomllib.loads((repo / "pyproject.toml").read_text())["tool"]["setuptools"][
        "package-dir"]
    with zipfile.ZipFile(wheel) as archive:
        record = next(n for n in archive.namelist() if n.endswith(".dist-info/RECORD"))
        rows = csv.reader(io.TextIOWrapper(archive.open(record), encoding="utf-8"))
        held = {name: digest for name, digest, *_ in rows if code(name)}
    here = {}
    for package, folder in folders.items():
        for path in (repo / folder).rglob("*"):
            name = f"{package.replace('.', '/')}/{path.relative_to(repo / folder).as_posix()}"
            if code(name) and "__pycache__" not in path.parts and path.is_file():
                here[name] = path
    found = []
    for name in sorted(held.keys() | here.keys()):
        shown = _in_checkout(name, folders)
        if name not in here:
            found.append(f"{shown} (gone)")
        elif name not in held:
            found.append(f"{shown} (new)")
        elif held[name] != _sha256(here[name]):
            found.append(f"{shown} (changed)")
    return sorted(found)


def _in_checkout(name: str, folders: dict[str, str]) -> str:
    """A wheel's file name as the checkout's path: under the folder of the longest
    package that holds it."""
    parts = name.split("/")
    for n in range(len(parts) - 1, 0, -1):
        folder = folders.get(".".join(parts[:n]))
        if folder is not None:
            return Path(folder, *parts[n:]).as_posix()
    return name


def _sha256(path: Path) -> str:
    """As RECORD writes it: sha256=, urlsafe base64 without padding."""
    digest = base64.urlsafe_b64encode(hashlib.sha256(path.read_bytes()).digest())
    return "sha256=" + digest.rstrip(b"=").decode()


def environment(site: Path | None) -> dict[str, str]:
    """This environment, with ``site`` first on the path and no directory a process runs
    in put on its path."""
    env = dict(os.environ, PYTHONSAFEPATH="1")
    if site is not None:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(site), env.get("PYTHONPATH")]))
    return env


def prepare(args: list[str]) -> dict[str, str]:
    """The environment SCRIPT runs in: the bundle of ``args`` installed, if any, and
    spotring importable there; raises Unusable with what to do."""
    bundle = bundle_of(args)
    site = None
    if bundle is not None:
        if not list(bundle.glob("*.whl")):
            raise Unusable(f"{bundle}: no wheels there; `make gpu-bundle` makes them, where "
                           "the package index is reachable")
        if changed := stale(spotring_wheel(bundle), REPO):
            more = f" and {len(changed) - SHOWN} more" if len(changed) > SHOWN else ""
            raise Unusable(f"{bundle}: its spotring is not this checkout's code "
                           f"({', '.join(changed[:SHOWN])}{more}): run `make gpu-bundle` again "
                           "after changing the code, before the checkout travels")
        site = install(bundle)
        sys.path.insert(0, str(site))
    if importlib.util.find_spec("spotring") is None:
        raise Unusable(f"spotring is not installed for {sys.executable}: give --bundle DIR, "
                       "the folder `make gpu-bundle` makes (docs/gpu.md), or use a Python "
                       "where it is installed (a checkout's .venv)")
    return environment(site)


def main(argv: list[str]) -> int:
    if not argv:
        print("usage: python tools/run_bundled.py SCRIPT [ARGS...]", file=sys.stderr)
        return 2
    script, *args = argv
    try:
        env = prepare(args)
    except Unusable as e:
        print(f"cannot start {script}: {e}", file=sys.stderr)
        return 2
    sys.stdout.flush()
    os.execve(sys.executable, [sys.executable, script, *args], env)
    return 0  # not reached: execve replaced this process


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
