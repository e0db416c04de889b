"""The user's project on its way to the nodes (launch/project.py): which files go, what
the launcher refuses before anything starts, what the nodes install; and spotring's own
wheel for them (launch/wheel.py), from this editable checkout and from a pip install."""

from __future__ import annotations

import base64
import hashlib
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from harness.installed import spotring_venv
from spotring.exits import ConfigError
from spotring.launch import project, wheel

PYTHON_TRAIN = ["python", "train.py", "--steps", "3"]


def write(root: Path, files: dict[str, str | bytes]) -> Path:
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        if isinstance(text, bytes):
            (root / name).write_bytes(text)
        else:
            (root / name).write_text(text)
    return root


def test_files_in_git_and_outside(tmp_path):
    repo = tmp_path / "repo"
    sub = write(repo, {".gitignore": "*.dat\n", "outside.py": "", "proj/train.py": "",
                       "proj/tracked_then_deleted.py": "", "proj/lib/model.py": "x = 1\n",
                       "proj/new_file.py": "", "proj/big.dat": "x",
                       "proj/runs/r1/ckpt.pt": "", "proj/lib/__pycache__/model.pyc": ""}) / "proj"
    git = ["git", "-c", "safe.directory=*"]
    subprocess.run([*git, "init", "-q", repo], check=True)
    subprocess.run([*git, "add", "outside.py", "proj/train.py", "proj/tracked_then_deleted.py",
                    "proj/lib/model.py"], cwd=repo, check=True)
    (sub / "tracked_then_deleted.py").unlink()
    (sub / "link.py").symlink_to(sub / "lib" / "model.py")
    (sub / "linked_dir").symlink_to(sub / "lib")
    found = project.files(sub)
    assert sorted(found) == ["lib/model.py", "link.py", "new_file.py", "train.py"]
    assert found["link.py"] == (sub / "lib" / "model.py").resolve()  # the file, not a link
    with pytest.raises(ConfigError, match=r"\(list them in \.gitignore or \.spotringignore\)"):
        project.check(sub, PYTHON_TRAIN, limit_mb=1e-6)

    plain = write(tmp_path / "plain", {
        "train.py": "", "pkg/m.py": "", "pkg/__pycache__/m.cpython-311.pyc": "", "x.pyc": "",
        ".git/HEAD": "", ".venv/bin/python": "", "venv/lib/x.py": "", "runs/r1/job.log": "",
        "data/raw/a.bin": "", "keep/data.txt": "", "logs/a.log": "", "pkg/b.log": "",
        "notes/draft.md": "", "notes/sub/final.md": "", "cache": "a file, not a dir",
        project.IGNORE_FILE: "# data and outputs\ndata\n*.log\n\n/notes/*.md\ncache/\n"})
    (plain / "link.py").symlink_to(plain / "pkg" / "m.py")
    (plain / "linked_dir").symlink_to(plain / "pkg")
    (plain / "broken.py").symlink_to(plain / "nowhere.py")
    assert sorted(project.files(plain)) == [project.IGNORE_FILE, "cache", "keep/data.txt",
                                            "link.py", "pkg/m.py", "train.py"]


def test_check_names_every_problem_at_once(tmp_path):
    root = write(tmp_path / "p", {
        "weights.bin": b"\0" * 5000, "train.py": "print('hi')\n",
        "requirements.txt": "# pinned\n\nnumpy>=1.24 ; python_version >= '3.10'\ntorch>>=2\n"
                            "-r more/extra.txt\n--bogus-option\n./wheels/missing.whl\n",
        "more/extra.txt": "tqdm \\\n  >=4.66\n-c nowhere.txt\n",
        "pyproject.toml": "[project]\nname = p\n"})
    with pytest.raises(ConfigError) as raised:
        project.check(root, ["python", "missing.py"], limit_mb=0.001)
    said = str(raised.value)
    for expected in [
            "0.00494 MB (5 files), over the limit of job.max_project_mb=0.001 MB",
            "largest files: weights.bin (4.9 KB), requirements.txt (113 bytes), more/extra.txt",
            "list them in .spotringignore",
            "missing.py: no such file in the project directory",
            "requirements.txt, line 4: 'torch>>=2': not a requirement pip takes",
            "requirements.txt, line 6: '--bogus-option': --bogus-option is not an option",
            "requirements.txt, line 7: './wheels/missing.whl': no such file or directory",
            "more/extra.txt, line 3: '-c nowhere.txt': -c names nowhere.txt, which is not a "
            "file", "pyproject.toml: not a TOML file", "(at line 2, column 8)"]:
        assert expected in said, said
    assert "line 1:" not in said and "extra.txt, line 1" not in said  # comment, continuation
    with pytest.raises(ConfigError) as raised:
        project.check(write(root, {project.IGNORE_FILE: "train.py\nextra.txt\n"}),
                      PYTHON_TRAIN, 1)
    for expected in ["train.py: in ", "more/extra.txt: not sent to the nodes (outside the "
                     "project directory, or left out by .spotringignore), where pip reads it",
                     ", but not sent to the nodes (outside the project directory, or left "
                     "out by .spotringignore); the command cannot run there without it"]:
        assert expected in str(raised.value), str(raised.value)

    # Unreadable: not UTF-8, or not a file (tests run as root, who reads mode 000).
    for bad, why in [(b"numpy\n\xff\xfe\n", "it is not UTF-8 text"), (None, "Is a directory")]:
        unreadable = tmp_path / f"u{why[:2]}"
        unreadable.mkdir()
        (unreadable / "train.py").touch()
        if bad is None:
            (unreadable / "requirements.txt").mkdir()
        else:
            (unreadable / "requirements.txt").write_bytes(bad)
        with pytest.raises(ConfigError) as raised:
            project.check(unreadable, PYTHON_TRAIN, 1)
        assert str(raised.value) == f"requirements.txt: cannot be read ({why}); pip reads " \
                                    "it on every node"


def test_what_the_nodes_install(tmp_path):
    root = write(tmp_path / "p", {"train.py": "", "wheels/dep-1.0-py3-none-any.whl": "",
                                  "pyproject.toml": "[project]\nname = 'p'\n"
                                                    "dependencies = ['numpy>=1.24', 'tqdm']\n"})
    assert project.requirements(root) == ["numpy>=1.24", "tqdm"]
    assert project.requirements(tmp_path) == []
    # Every kind of line pip takes, passed.
    write(root, {"requirements.txt": "\n".join([
        "--index-url https://pypi.org/simple", "--extra-index-url=https://x.example/simple",
        "-f ./wheels", "--pre", "--prefer-binary", "--only-binary :all:", "-e .",
        "-rmore.txt", "./wheels/dep-1.0-py3-none-any.whl", "numpy[dev]>=1.24,<3  # pinned",
        'tqdm; python_version >= "3.10" --hash=sha256:0123', "mypkg @ https://x.example/a.whl",
        "git+https://github.com/org/repo@v1#egg=repo", "torch \\", "  ==2.4.1"]),
        "more.txt": "boto3\n"})
    sent = project.check(root, PYTHON_TRAIN, 1)
    assert sorted(sent) == ["more.txt", "pyproject.toml", "requirements.txt", "train.py",
                            "wheels/dep-1.0-py3-none-any.whl"]
    assert project.requirements(root) == ["-r", "requirements.txt"]


def test_wheel_of_this_checkout(tmp_path):
    """Built from the editable install these tests run in: the same bytes every time, the
    packages with their data, a RECORD that holds."""
    first, second = wheel.build(tmp_path / "a"), wheel.build(tmp_path / "b")
    assert first.name == "spotring-0.1.0-py3-none-any.whl"
    assert first.read_bytes() == second.read_bytes()
    with zipfile.ZipFile(first) as archive:
        names = archive.namelist()
        record = archive.read("spotring-0.1.0.dist-info/RECORD").decode().splitlines()
        for line in record:
            name, digest, size = line.rsplit(",", 2)
            if name.endswith("/RECORD"):
                continue
            data = archive.read(name)
            assert int(size) == len(data)
            assert digest == "sha256=" + base64.urlsafe_b64encode(
                hashlib.sha256(data).digest()).rstrip(b"=").decode()
        assert archive.getinfo("spotring/launch/node/build-horovod").external_attr >> 16 == 0o755
        entry_points = archive.read("spotring-0.1.0.dist-info/entry_points.txt").decode()
    assert sorted(line.rsplit(",", 2)[0] for line in record) == sorted(names)
    assert {name.split("/")[0] for name in names} == {"spotring", "spotring-0.1.0.dist-info"}
    for name in ["spotring/__init__.py", "spotring/trainer/__init__.py",
                 "spotring/launch/wheel.py", "spotring/sweep/__init__.py",
                 "spotring/benchmarks/__init__.py", "spotring/conf/config.yaml",
                 "spotring/conf/cluster/local.yaml", "spotring/launch/node/setup.sh",
                 "spotring/launch/aws/provider.py", "spotring/engines/ddp.py",
                 "spotring-0.1.0.dist-info/METADATA", "spotring-0.1.0.dist-info/WHEEL"]:
        assert name in names
    assert not [n for n in names if "__pycache__" in n or n.endswith(".pyc")]
    assert "spotring = spotring.cli:main" in entry_points
    assert "trainer = spotring.trainer:COMMANDS" in entry_points


@pytest.mark.slow(cores=1)
def test_spotring_from_a_pip_install(tmp_path):
    """spotring_venv's environment runs the wheel's spotring; a wheel launch/wheel.py
    builds there (from site-packages) holds the same code, and a pip install of the one
    built here (from the checkout) gives a working `spotring` too."""
    venv = spotring_venv(tmp_path / "venv")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}

    def run(*args: str) -> str:
        proc = subprocess.run(args, cwd=tmp_path, env=env, capture_output=True, text=True,
                              timeout=120)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        return proc.stdout

    where = "import importlib.metadata as m, spotring, spotring.trainer, spotring.conf; " \
            "print(m.version('spotring'), spotring.__file__, spotring.trainer.__file__, " \
            "spotring.conf.__file__)"
    site = str(venv / "lib")
    for _ in ("setuptools' wheel", "launch/wheel.py's"):
        assert "predict" in run(str(venv / "bin" / "spotring"), "--help")
        version, *files = run(str(venv / "bin" / "python"), "-c", where).split()
        assert version == "0.1.0" and all(f.startswith(site) for f in files), files
        rebuilt = Path(run(str(venv / "bin" / "python"), "-c", "from pathlib import Path; "
                           "from spotring.launch import wheel; print(wheel.build(Path('again')))")
                       .strip())
        here = wheel.build(tmp_path / "here")
        with zipfile.ZipFile(tmp_path / rebuilt) as there, zipfile.ZipFile(here) as ours:
            code = [n for n in there.namelist() if ".dist-info/" not in n]
            assert "spotring/conf/config.yaml" in code
            assert "spotring/launch/node/setup.sh" in code
            assert all(there.read(n) == ours.read(n) for n in code)
        run(sys.executable, "-m", "pip", "--python", str(venv / "bin" / "python"), "install",
            "-q", "--no-deps", "--force-reinstall", str(here))
