"""A wheel of the spotring that is running, for the nodes to install: the user's exact
version, whether it came from a wheel (site-packages) or is a checkout installed in
editable mode (pip install -e).

It holds the distribution's package (spotring, with its parts spotring.trainer,
spotring.launch... beneath it) as Python imports it here, with every file under it that a
project would send (launch/project.py's files: in a checkout, git's files; never __pycache__/ or
*.pyc), so package data such as conf/*.yaml and launch/node/ comes along; and a
.dist-info with the installed METADATA (or PKG-INFO) and entry_points.txt (so `pip
install` makes the `spotring` command), top_level.txt, WHEEL and the RECORD computed here.
The same code gives the same bytes (sorted names, fixed times, modes 644 or 755): the
launcher keys the nodes' environments by them (launch/node_env.py).
"""

from __future__ import annotations

import base64
import hashlib
import importlib.metadata
import importlib.util
import json
import zipfile
from pathlib import Path
from urllib.parse import unquote, urlparse

from spotring.launch import project

DISTRIBUTION = "spotring"
WHEEL = "Wheel-Version: 1.0\nGenerator: spotring (launch/wheel.py)\nRoot-Is-Purelib: true\n" \
        "Tag: py3-none-any\n"
EPOCH = (1980, 1, 1, 0, 0, 0)  # the earliest time a zip holds


def build(dest: Path) -> Path:
    """``dest``/spotring-<version>-py3-none-any.whl of the running spotring (replaced if
    there); returns its path."""
    dist = importlib.metadata.distribution(DISTRIBUTION)
    version = dist.version.replace("-", "_")
    info = f"{DISTRIBUTION}-{version}.dist-info"
    packages = _top_level(dist)
    files = {name: path for package in [*packages, *_mapped_elsewhere(dist)]
             for name, path in _files_of(package).items()}
    members = {name: path.read_bytes() for name, path in files.items()}
    # PKG-INFO: an .egg-info's, where Python finds a checkout's first (run from its root).
    metadata = dist.read_text("METADATA") or dist.read_text("PKG-INFO")
    members[f"{info}/METADATA"] = metadata.encode()
    members[f"{info}/WHEEL"] = WHEEL.encode()
    members[f"{info}/top_level.txt"] = "".join(f"{p}\n" for p in packages).encode()
    entry_points = dist.read_text("entry_points.txt")
    if entry_points is not None:
        members[f"{info}/entry_points.txt"] = entry_points.encode()
    members[f"{info}/RECORD"] = _record(members, f"{info}/RECORD")
    dest.mkdir(parents=True, exist_ok=True)
    wheel = dest / f"{DISTRIBUTION}-{version}-py3-none-any.whl"
    partial = wheel.with_suffix(".partial")
    with zipfile.ZipFile(partial, "w", zipfile.ZIP_DEFLATED) as archive:
        for name in sorted(members):
            entry = zipfile.ZipInfo(name, EPOCH)
            executable = name in files and files[name].stat().st_mode & 0o111
            entry.external_attr = (0o755 if executable else 0o644) << 16
            entry.compress_type = zipfile.ZIP_DEFLATED
            archive.writestr(entry, members[name])
    partial.replace(wheel)  # never half a wheel under the name the launcher hashes
    return wheel


def _top_level(dist: importlib.metadata.Distribution) -> list[str]:
    """The distribution's top-level packages and modules: top_level.txt where it has one
    (setuptools writes it, also for an editable install), else the first part of each
    path its RECORD lists."""
    listed = dist.read_text("top_level.txt")
    if listed is not None:
        return sorted({line.strip() for line in listed.splitlines() if line.strip()})
    names = {Path(str(f)).parts[0].removesuffix(".py") for f in dist.files or []}
    return sorted(n for n in names if n.isidentifier() and not n.startswith("__"))


def _mapped_elsewhere(dist: importlib.metadata.Distribution) -> list[str]:
    """The packages a checkout maps to folders of their own (its trainer/ is
    spotring.trainer: pyproject.toml's package-dir), which a walk of the top-level
    package's folder does not find; none for an install from a wheel."""
    root = _checkout(dist)
    if root is None:
        return []
    pyproject = project.read_toml(root / "pyproject.toml")
    mapping = pyproject["tool"]["setuptools"]["package-dir"]
    return sorted(name for name, folder in mapping.items()
                  if Path(folder).parts != tuple(name.split(".")))


def _checkout(dist: importlib.metadata.Distribution) -> Path | None:
    """The checkout spotring runs from: an editable install's (direct_url.json, PEP 610),
    or the one whose .egg-info Python finds first when run from its root."""
    direct = json.loads(dist.read_text("direct_url.json") or "{}")
    if direct.get("dir_info", {}).get("editable"):
        return Path(unquote(urlparse(direct["url"]).path))
    root = Path(str(dist.locate_file("")))
    return root if (root / "pyproject.toml").is_file() else None


def _files_of(name: str) -> dict[str, Path]:
    """Name in the wheel -> file here, of the top-level package or module ``name`` where
    Python imports it from (through an editable install's finder too)."""
    spec = importlib.util.find_spec(name)
    if spec is None or spec.origin is None and not spec.submodule_search_locations:
        raise RuntimeError(f"spotring's package {name} cannot be imported here: the "
                           "installation is broken; reinstall spotring")
    if not spec.submodule_search_locations:  # a module of one file
        return {Path(spec.origin).name: Path(spec.origin)}
    root = Path(list(spec.submodule_search_locations)[0])
    inside = name.replace(".", "/")
    return {f"{inside}/{file}": path for file, path in project.files(root).items()}


def _record(members: dict[str, bytes], record: str) -> bytes:
    """RECORD's text: each member's sha256 (urlsafe base64, unpadded) and size; none for
    ``record``, RECORD itself."""
    lines = []
    for name in sorted(members):
        digest = base64.urlsafe_b64encode(hashlib.sha256(members[name]).digest())
        lines.append(f"{name},sha256={digest.rstrip(b'=').decode()},{len(members[name])}\n")
    return "".join([*lines, f"{record},,\n"]).encode()
