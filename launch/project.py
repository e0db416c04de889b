"""The user's project: the directory a job is launched from, whose files go to the
nodes, and the command that runs there. Every check here runs before any node, job or
trial exists, and raises ConfigError (exit 2) naming what is wrong.

    files           what goes to the nodes: git's files, or every file but the ignored
    check_command   whether the command would start: the trainer's (any spotring
                    subcommand's) own check of its arguments, else its script is here
    check           all that the launcher refuses a project for, in one ConfigError
    requirements    what the nodes pip-install for it: requirements.txt, or
                    pyproject.toml's [project].dependencies (the project itself runs from
                    the workdir and is not installed)

Ignoring files: in a git work tree, what .gitignore ignores (and is not tracked) stays
here. Anywhere, a `.spotringignore` at the project's root names more, one pattern a line,
as in .gitignore but simpler: `#` starts a comment; a pattern without `/` matches a file's
or a directory's name at any depth (`*.ckpt`, `data`); one with a `/` inside matches the
path from the root (`data/raw/*`, where `*` also spans `/`); a trailing `/` matches only
directories (`cache/`); there is no `!`. Never sent: .git/, .venv/ (each node builds its
own), venv/, runs/ (the launcher's run directories), __pycache__/, *.pyc.
"""

from __future__ import annotations

import fnmatch
import os
import re
import shlex
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

from packaging.requirements import InvalidRequirement, Requirement

from spotring import cli
from spotring.exits import ConfigError

PYTHONS = ("python", "python3")
IGNORE_FILE = ".spotringignore"
NEVER_SENT = (".git/", ".venv/", "venv/", "runs/", "__pycache__/", "*.pyc")
REQUIREMENTS, PYPROJECT = "requirements.txt", "pyproject.toml"
LARGEST_SHOWN = 5

# pip's requirement-file options (pip/_internal/req/req_file.py): those on a line of
# their own, whether each takes a value, and the ones a requirement's line may carry.
_LINE_OPTIONS = {
    "-i": True, "--index-url": True, "--extra-index-url": True, "--no-index": False,
    "-c": True, "--constraint": True, "-r": True, "--requirement": True,
    "-e": True, "--editable": True, "-f": True, "--find-links": True,
    "--no-binary": True, "--only-binary": True, "--prefer-binary": False,
    "--require-hashes": False, "--pre": False, "--trusted-host": True, "--use-feature": True,
}
_REQUIREMENT_OPTIONS = ("--hash", "--config-settings", "--global-option")
_NESTED = {"-r", "--requirement", "-c", "--constraint"}  # a file, relative to this one
_URL = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://")
_ARCHIVES = (".whl", ".zip", ".tar.gz", ".tgz", ".tar.bz2", ".tar")
_COMMENT = re.compile(r"(^|\s+)#.*$")


def script_of(command: list[str]) -> str | None:
    """The file a command runs from the project, where it names one: `python X.py ...`
    (X.py), `./run.sh` (run.sh); None for `python -m pkg`, `bash -c ...` and the like."""
    if not command:
        return None
    first = command[0]
    if Path(first).name in PYTHONS or first.rsplit("/", 1)[-1].startswith("python3."):
        for word in command[1:]:
            if word in ("-m", "-c"):
                return None
            if not word.startswith("-"):
                return word
        return None
    return first if "/" in first and not first.startswith("/") else None


def check_command(root: Path, command: list[str], world_sizes: Sequence[int] = ()) -> None:
    """ConfigError where the command would not start: what a spotring subcommand says of
    its own arguments on each of ``world_sizes`` workers (spotring.cli.check_command: the
    trainer composes and validates its overrides), or, for any other command, that its
    script (script_of) is not a file of ``root``."""
    if cli.check_command(command, world_sizes):
        return
    script = script_of(command)
    if script is not None and not (root / script).is_file():
        raise ConfigError(
            f"{script}: no such file in the project directory {root} (the command "
            f"`{' '.join(command)}` runs from there, or from a copy of it on the nodes); run "
            "the launcher from the directory that holds the script, or give its path "
            "relative to there")


def files(root: Path) -> dict[str, Path]:
    """The project's files, name relative to ``root`` (with `/`) -> the file to read.

    In a git work tree (``root`` may be a directory inside one): what git lists under
    ``root``, tracked or new but not ignored, less files deleted since. Elsewhere, or
    where git lists nothing (``root`` is ignored): every file under ``root``. In both,
    less NEVER_SENT and the patterns of ``root``'s .spotringignore (the module
    docstring). A symbolic link to a file is sent as that file (its path here is the
    target); one to a directory, or a broken one, is skipped. So are git submodules."""
    root = root.resolve()
    ignored = NEVER_SENT + _patterns(root / IGNORE_FILE)
    # git lists nothing in a directory it ignores (a .venv's site-packages): not git's.
    names = _git_names(root) or _walk(root, ignored)
    found = {}
    for name in sorted(names):
        path = root / name
        if path.is_file() and not _ignored(name, ignored):
            found[name] = path.resolve() if path.is_symlink() else path
    return found


def check(root: Path, command: list[str], limit_mb: float) -> dict[str, Path]:
    """The project's files (``files``), or one ConfigError that names every reason the
    launcher refuses them: over ``limit_mb`` in all (job.max_project_mb); the command
    refusing its arguments (check_command), or its script missing, or not sent; a
    requirements.txt that cannot be read or has a line pip rejects (and so the -r/-c
    files it names); a pyproject.toml that is not TOML."""
    root = root.resolve()
    sent = files(root)
    problems = [*_size_problems(root, sent, limit_mb), *_script_problems(root, command, sent)]
    if (root / REQUIREMENTS).exists():
        problems += _requirement_problems(root, root / REQUIREMENTS, sent, set())
    if (root / PYPROJECT).exists():
        try:
            _dependencies(root / PYPROJECT)
        except ConfigError as e:
            problems.append(str(e))
    if problems:
        raise ConfigError("\n".join(problems))
    return sent


def requirements(root: Path) -> list[str]:
    """What the nodes install for the project, as pip's arguments: `-r requirements.txt`
    where there is one; else pyproject.toml's [project].dependencies; else none."""
    if (root / REQUIREMENTS).is_file():
        return ["-r", REQUIREMENTS]
    if (root / PYPROJECT).is_file():
        return _dependencies(root / PYPROJECT)
    return []


def _git_names(root: Path) -> list[str]:
    """git's files under ``root``, relative to it; none outside a work tree (or git)."""
    try:
        proc = subprocess.run(["git", "ls-files", "-z", "--cached", "--others",
                               "--exclude-standard"], cwd=root, capture_output=True)
    except FileNotFoundError:  # no git here: no work tree either
        return []
    if proc.returncode != 0:  # not in a work tree
        return []
    return [n for n in os.fsdecode(proc.stdout).split("\0") if n]


def _walk(root: Path, ignored: tuple[str, ...]) -> list[str]:
    names = []
    for top, dirs, found in os.walk(root):  # symbolic links to directories: not entered
        here = Path(top).relative_to(root)
        dirs[:] = [d for d in dirs if not _ignored(f"{(here / d).as_posix()}/", ignored)]
        names += [(here / f).as_posix() for f in found]
    return names


def _patterns(path: Path) -> tuple[str, ...]:
    if not path.is_file():
        return ()
    lines = (line.strip() for line in path.read_text(errors="replace").splitlines())
    return tuple(line for line in lines if line and not line.startswith("#"))


def _ignored(name: str, patterns: tuple[str, ...]) -> bool:
    """Whether ``name`` (relative, `/`-separated; a directory's ends with `/`), or a
    directory it lies in, matches one of ``patterns``."""
    parts = name.rstrip("/").split("/")
    for i in range(len(parts)):
        path, is_dir = "/".join(parts[:i + 1]), i < len(parts) - 1 or name.endswith("/")
        for pattern in patterns:
            if pattern.endswith("/") and not is_dir:
                continue
            pattern = pattern.rstrip("/")
            if "/" in pattern:
                matched = fnmatch.fnmatchcase(path, pattern.lstrip("/"))
            else:
                matched = fnmatch.fnmatchcase(parts[i], pattern)
            if matched:
                return True
    return False


def _size_problems(root: Path, sent: dict[str, Path], limit_mb: float) -> list[str]:
    sizes = {name: path.stat().st_size for name, path in sent.items()}
    total = sum(sizes.values()) / 2**20
    if total <= limit_mb:
        return []
    largest = sorted(sizes, key=lambda n: (-sizes[n], n))[:LARGEST_SHOWN]
    shown = ", ".join(f"{n} ({_size(sizes[n])})" for n in largest)
    return [f"the project {root} is {total:.3g} MB ({len(sent)} files), over the limit of "
            f"job.max_project_mb={limit_mb:g} MB; its largest files: {shown}. Every node "
            "gets a copy: keep data and outputs out of it (list them in "
            f"{_ignore_files(root)}), or raise job.max_project_mb"]


def _size(size: int) -> str:
    if size >= 2**20 / 10:
        return f"{size / 2**20:.1f} MB"
    return f"{size / 2**10:.1f} KB" if size >= 2**10 else f"{size} bytes"


def _script_problems(root: Path, command: list[str], sent: dict[str, Path]) -> list[str]:
    try:
        check_command(root, command)
    except ConfigError as e:
        return [str(e)]
    script = script_of(command)
    if script is not None and os.path.normpath(script) not in sent:
        return [f"{script}: in {root}, but not sent to the nodes ({_left_out(root)}); the "
                "command cannot run there without it"]
    return []


def _left_out(root: Path) -> str:
    return f"outside the project directory, or left out by {_ignore_files(root)}"


def _ignore_files(root: Path) -> str:
    return f".gitignore or {IGNORE_FILE}" if _git_names(root) else IGNORE_FILE


def _requirement_problems(root: Path, path: Path, sent: dict[str, Path],
                          seen: set[Path]) -> list[str]:
    """What pip would reject in the requirements file ``path`` and the files it names,
    or a file of them that is not ``sent``."""
    shown = path.relative_to(root) if path.is_relative_to(root) else path
    seen.add(path.resolve())
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        why = e.strerror if isinstance(e, OSError) else "it is not UTF-8 text"
        return [f"{shown}: cannot be read ({why}); pip reads it on every node"]
    problems = []
    if shown.as_posix() not in sent:
        problems.append(f"{shown}: not sent to the nodes ({_left_out(root)}), where pip "
                        "reads it")
    for number, line in _logical_lines(text):
        try:
            nested = _nested_file(line, root, path.parent)
        except ValueError as e:
            problems.append(f"{shown}, line {number}: {line!r}: {e}")
            continue
        if nested is not None and nested.resolve() not in seen:
            problems += _requirement_problems(root, nested, sent, seen)
    return problems


def _logical_lines(text: str) -> list[tuple[int, str]]:
    """pip's lines: comments gone, a line ending in `\\` joined to the next, blanks gone;
    each with the number of its first line."""
    lines, start, parts = [], 0, []
    for number, raw in enumerate(text.splitlines(), 1):
        start = start or number
        if raw.endswith("\\"):
            parts.append(raw[:-1])
            continue
        line = _COMMENT.sub("", " ".join([*parts, raw])).strip()
        if line:
            lines.append((start, line))
        start, parts = 0, []
    return lines


def _nested_file(line: str, root: Path, here: Path) -> Path | None:
    """The file a -r/-c line names (it must exist), or None for any other line pip
    takes; ValueError saying why pip would not take it."""
    words = line.split(" ")
    first_option = next((i for i, w in enumerate(words) if w.startswith("-")), len(words))
    requirement = " ".join(words[:first_option]).strip()
    try:
        options = shlex.split(" ".join(words[first_option:]))
    except ValueError as e:
        raise ValueError(f"its options cannot be split ({e})") from None
    if requirement:
        _check_requirement(requirement, root)
        for option in options:
            if option.split("=", 1)[0] not in _REQUIREMENT_OPTIONS:
                raise ValueError(f"{option} is not an option pip takes after a requirement "
                                 f"(those are {', '.join(_REQUIREMENT_OPTIONS)})")
        return None
    name, _, value = options[0].partition("=")
    if name not in _LINE_OPTIONS and name[:2] in _LINE_OPTIONS and not name.startswith("--"):
        name, value = name[:2], name[2:]  # -rfile, as pip takes it
    if name not in _LINE_OPTIONS:
        raise ValueError(f"{name} is not an option pip takes in a requirements file (those "
                         f"are {', '.join(_LINE_OPTIONS)})")
    rest = options[1:]
    if _LINE_OPTIONS[name] and not value:
        if not rest:
            raise ValueError(f"{name} needs a value")
        value, rest = rest[0], rest[1:]
    if rest:
        raise ValueError(f"{' '.join(rest)}: more than pip takes after {name}")
    if name not in _NESTED or _URL.match(value):
        return None
    nested = here / value
    if not nested.is_file():
        raise ValueError(f"{name} names {value}, which is not a file (the path is relative "
                         f"to {here})")
    return nested


def _check_requirement(text: str, root: Path) -> None:
    """ValueError where ``text`` is none of what pip installs from: a PEP 508 requirement,
    a URL, or a local path (which must then exist, relative to the project)."""
    try:
        Requirement(text)
        return
    except InvalidRequirement as e:
        why = str(e).splitlines()[0]
    if _URL.match(text):
        return
    path = re.sub(r"\[[^\]]*\]$", "", text)  # ./pkg[extra]
    if "/" in path or path.startswith(".") or path.endswith(_ARCHIVES):
        if not Path(path).is_absolute() and not (root / path).exists():
            raise ValueError(f"no such file or directory in the project {root}")
        return
    raise ValueError(f"not a requirement pip takes ({why}); write NAME[EXTRAS] SPECIFIERS "
                     "(PEP 508, e.g. torch>=2.4), a URL, or a path to a wheel or project")


def read_toml(path: Path) -> dict:
    """The TOML file at ``path``; ValueError where it is not TOML (or not UTF-8)."""
    if sys.version_info >= (3, 11):
        import tomllib
    else:  # its backport, a dependency of spotring on Python 3.10
        import tomli as tomllib
    return tomllib.loads(path.read_text(encoding="utf-8"))


def _dependencies(path: Path) -> list[str]:
    """[project].dependencies of the pyproject.toml at ``path``; ConfigError where it is
    not TOML, or the dependencies are not a list of strings."""
    try:
        data = read_toml(path)
    except (OSError, ValueError) as e:  # unreadable, not UTF-8, not TOML
        raise ConfigError(f"{path.name}: not a TOML file the nodes can read ({e})") from None
    project = data.get("project", {})
    dependencies = project.get("dependencies", []) if isinstance(project, dict) else None
    if not isinstance(dependencies, list) or not all(isinstance(d, str) for d in dependencies):
        raise ConfigError(f"{path.name}: [project].dependencies must be a list of strings "
                          f"(PEP 508 requirements), not {dependencies!r}")
    return dependencies
