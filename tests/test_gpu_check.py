"""tools/gpu-check, the one command that proves spotring on a GPU machine, kept from
rotting where there is no GPU. Its tests are tests/test_gpu.py's, which `make test` runs
itself; here: its pytest reports each test as it starts and ends, with the test's figures;
stopped by SIGTERM in the middle of a test, the kit takes every process it started down
with it and says what became of each check; its figures run on a CPU; its report; bad
input; and the bundle of `make gpu-bundle` is all it needs on a Python that has torch
and pytest alone."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
import venv
import zipfile
from concurrent.futures import ThreadPoolExecutor
from importlib import metadata
from pathlib import Path

import pytest
import torch
from packaging.requirements import Requirement

from spotring.launch import wheel
from tests.conftest import REPO, pyproject

KIT = REPO / "tools" / "gpu-check"


def tool(name: str):
    """tools/``name``.py as a module: the kit's files run by their paths, not imported."""
    spec = importlib.util.spec_from_file_location(name, REPO / "tools" / f"{name}.py")
    module = sys.modules[name] = importlib.util.module_from_spec(spec)  # as its dataclasses ask
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def kit():
    return tool("gpu_check")


@pytest.fixture(scope="module")
def kit_start():
    """tools/run_bundled.py, which runs before anything of spotring imports."""
    return tool("run_bundled")


def processes_marked(mark: str) -> dict[int, tuple[int, str]]:
    """pid: (parent's pid, command line) of the live processes whose environment holds
    ``mark``."""
    found = {}
    for proc in Path("/proc").iterdir():
        try:
            env = (proc / "environ").read_bytes().split(b"\0")
            command = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode()
            stat = (proc / "stat").read_text()
        except (OSError, NotADirectoryError):  # not a process, or gone meanwhile
            continue
        if f"SPOTRING_TEST_MARK={mark}".encode() in env:
            found[int(proc.name)] = (int(stat[stat.rindex(")") + 2:].split()[1]), command)
    return found


def torchrun_workers(mark: str) -> list[int]:
    """The marked trainer processes that torchrun started: each in a session of its own,
    which a kill of the launcher's process group does not reach."""
    found = processes_marked(mark)
    return [pid for pid, (parent, command) in found.items()
            if "-m spotring.trainer" in command and "torchrun" in found.get(parent, (0, ""))[1]]


def none_left(mark: str) -> list[str]:
    """The command lines of the marked processes still alive after a few seconds' grace."""
    deadline = time.monotonic() + 10
    while (left := processes_marked(mark)) and time.monotonic() < deadline:
        time.sleep(0.2)
    return [command for _, command in left.values()]


def results_of(out: Path) -> tuple[dict, dict[str, dict], str]:
    results = json.loads((out / "results.json").read_text())
    return results, {c["check"]: c for c in results["checks"]}, (out / "report.md").read_text()


# A test file of the kit's pytest's own: one test passes with figures, one skips, one fails.
LINES_TESTS = """
import pytest

def test_passes(record_property):
    record_property("images_per_second", 1234.5678)
    record_property("backend", "gloo")

def test_skips():
    pytest.skip("needs 2 cuda devices or more")

def test_fails():
    assert 1 + 1 == 3
"""


def test_the_kits_pytest_says_each_test_as_it_starts_and_ends_and_the_kit_rows_them(
        tmp_path, kit):
    (tmp_path / "test_lines.py").write_text(LINES_TESTS)
    lines = tmp_path / "lines.jsonl"
    # pytest and tools/gpu_tests.py alone: nothing imports torch.
    done = subprocess.run([sys.executable, str(REPO / "tools" / "gpu_tests.py"),
                           "test_lines.py", "--gpu-results", str(lines), "-p",
                           "no:cacheprovider"], cwd=tmp_path, capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 1, done.stdout  # one failed
    said = [json.loads(line) for line in lines.read_text().splitlines()]
    ids = [f"test_lines.py::test_{n}" for n in ("passes", "skips", "fails")]
    assert said[0] == {"collected": ids}
    assert [x.get("started") or x["test"] for x in said[1:]] == [i for i in ids for _ in "se"]
    ended = {x["test"]: x for x in said[1:] if "test" in x}
    assert [ended[i]["outcome"] for i in ids] == ["passed", "skipped", "failed"]
    rows = [kit.row_of_test(ended[i]) for i in ids]
    assert [(r.check, r.kind, r.status) for r in rows] == [
        ("test_passes", "test", "passed"), ("test_skips", "test", "skipped"),
        ("test_fails", "test", "failed")]
    assert rows[0].summary == "images_per_second 1235; backend gloo"
    assert rows[0].figures == {"images_per_second": 1234.5678, "backend": "gloo"}
    assert rows[1].summary == "needs 2 cuda devices or more"
    assert rows[2].summary == "assert (1 + 1) == 3" and "def test_fails" in rows[2].figures["error"]


@pytest.mark.slow(cores=1)
def test_sigterm_in_the_middle_of_a_test_stops_the_kit_and_every_process_it_started(
        tmp_path, kit):
    out, mark = tmp_path / "out", uuid.uuid4().hex
    env = {**os.environ, "PYTHON": sys.executable, "SPOTRING_TEST_MARK": mark}
    proc = subprocess.Popen([str(KIT), str(out), "--device", "cpu", "--tiny", "--tests",
                             "default_run and one"], cwd=REPO, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 300
        while not torchrun_workers(mark):  # the test's trainer under way
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
            time.sleep(0.1)
        proc.send_signal(signal.SIGTERM)
        stdout, stderr = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 128 + signal.SIGTERM, stdout + stderr[-4000:]
    assert none_left(mark) == []
    results, checks, report = results_of(out)
    test = "test_the_default_run_reaches_its_target_on_every_seed[one]"
    assert results["stopped_by"] == "SIGTERM"
    assert list(checks) == [test, *kit.FIGURES]  # every check says what became of it
    assert checks[test]["status"] == "stopped"
    assert checks[test]["summary"].endswith("s: the kit got SIGTERM")
    assert all(checks[n]["status"] == "skipped" and checks[n]["summary"] == "not started: the "
               "kit got SIGTERM" for n in kit.FIGURES)
    assert "**Stopped by SIGTERM**" in report and f"| {test} | stopped |" in report
    assert "gpu-check: STOPPED by SIGTERM" in stdout
    assert not list(out.rglob("checkpoints"))  # OUTDIR is for committing


@pytest.mark.slow
def test_the_figures_run_on_a_cpu_and_say_what_they_measured(tmp_path, kit):
    """Each figure as the kit runs it (--device cpu --tiny: three at once): the benchmark
    behind it ran, and the row has its figures. (Its bf16 variants are fp32's with other
    overrides.)"""
    box = kit.Kit(tmp_path, "cpu", 2, kit.TINY)
    names = ["throughput fp32", "throughput fp16", "allreduce", "fsdp", "checkpoint"]
    with ThreadPoolExecutor(kit.TINY.parallel) as pool:
        rows = dict(zip(names, pool.map(lambda name: kit.run_figure(box, name), names),
                        strict=True))
    assert {n: r.status for n, r in rows.items()} == {
        **{n: "passed" for n in rows}, "throughput fp16": "skipped"}
    assert "train.precision=fp16 on the CPU" in rows["throughput fp16"].summary
    throughput = rows["throughput fp32"].figures
    assert len(throughput["intervals"]) == 2 and throughput["images_per_second"]["mean"] > 0
    assert throughput["precision"] == "fp32" and throughput["peak_memory_mb"] > 0
    sizes = rows["allreduce"].figures["sizes"]
    assert [r["bytes"] for r in sizes] == [1024, 4096, 16384, 65536]
    assert all(r["busbw_gbps"] > 0 for r in sizes)
    fsdp = rows["fsdp"].figures
    assert [fsdp[e]["engine"] for e in ("ddp", "fsdp")] == ["ddp", "fsdp"]
    assert all(fsdp[e]["world_size"] == 1 and fsdp[e]["tokens_per_second"] > 0
               for e in ("ddp", "fsdp"))
    saves = rows["checkpoint"].figures
    assert saves["world_size"] == 2 and saves["state_bytes"] >= 0.02e9
    assert all(saves[kind]["saves"] >= 1 for kind in ("background", "blocking"))
    assert all(r.commands for r in rows.values() if r.status == "passed")
    assert not list(tmp_path.rglob("checkpoints"))


def test_bad_input_exits_2_naming_it(tmp_path, capsys, kit):
    for args, named in ((["--budget", "0"], "0: must be a number above 0"),
                        (["--device", "tpu"], "'tpu'"), (["--bund", "x"], "--bund")):
        with pytest.raises(SystemExit) as exited:
            kit.main([str(tmp_path / "out"), *args])
        assert exited.value.code == 2 and named in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is here: the kit would run")
def test_without_a_gpu_the_kit_says_so_and_names_the_cpu_mode(tmp_path, capsys, kit):
    assert kit.main([str(tmp_path / "out")]) == 2  # --device cuda, the default
    assert "--device cuda: torch sees no GPU here" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_the_report_of_a_gpu_machine_names_it_and_says_why_a_check_failed(kit):
    gpu = {"count": 1, "name": "NVIDIA H100 80GB HBM3", "memory_gib": 79.2, "capability": "9.0",
           "driver": "580.65.06", "cuda": "13.0", "cudnn": 91300}
    results = {
        "command": "tools/gpu-check out --bundle gpu-bundle", "mode": "full", "device": "cuda",
        "devices": 1, "bundle": "gpu-bundle (17 wheels)", "spotring": "0.1.0 from /cache/k",
        "throughput_workload": "torchvision model.arch=resnet50 on ...",
        "started": "2026-11-27 10:00:00",
        "machine": {"cpu": "Xeon", "cores": 16, "memory_gib": 125.8, "python": "3.12.3",
                    "packages": {"torch": "2.11.0", "torchvision": "0.26.0"},
                    "commit": "abc1234", "nccl": "2.27.7", "gpu": gpu},
        "checks": [{"check": "test_parity", "kind": "test", "status": "failed",
                    "summary": "assert 2e-05 <= 1e-10", "seconds": 61.5,
                    "figures": {"error": "E   assert 2e-05 <= 1e-10\nE   where ..."},
                    "commands": []},
                   {"check": "allreduce", "kind": "figure", "status": "skipped",
                    "summary": "needs 2 cuda devices", "seconds": 0.0, "figures": {},
                    "commands": []},
                   {"check": "fsdp", "kind": "figure", "status": "passed",
                    "summary": "124M parameters | bf16", "seconds": 20.0, "figures": {},
                    "commands": ["torchrun -m spotring.benchmarks.fsdp_ranks"]}],
        "stopped_by": None, "wall_seconds": 81.6}
    lines = kit.report(results).splitlines()
    assert lines[0] == "# spotring GPU check: 1 x NVIDIA H100 80GB HBM3"
    assert lines[2].endswith(", full mode, 81.6 s: 1 passed, 1 failed, 1 skipped.")
    for line in ["| GPUs | 1 x NVIDIA H100 80GB HBM3 (79.2 GiB, compute capability 9.0) |",
                 "| driver, CUDA, cuDNN, NCCL | 580.65.06, 13.0, 91300, 2.27.7 |",
                 "| torch, torchvision | 2.11.0, 0.26.0 |",
                 "| spotring | 0.1.0 from /cache/k, commit abc1234; bundle gpu-bundle "
                 "(17 wheels) |",
                 "| test_parity | failed | assert 2e-05 <= 1e-10 | 61.5 |",
                 "| allreduce | skipped | needs 2 cuda devices | 0 |",
                 "| fsdp | passed | 124M parameters / bf16 | 20 |",  # a cell's | is not a column
                 "    E   assert 2e-05 <= 1e-10", "    E   where ...",
                 "    torchrun -m spotring.benchmarks.fsdp_ranks"]:
        assert line in lines
    tests, figures = lines.index("## Tests (tests/test_gpu.py)"), lines.index("## Figures")
    assert tests < lines.index("| test_parity | failed | assert 2e-05 <= 1e-10 | 61.5 |") \
        < figures < lines.index("| allreduce | skipped | needs 2 cuda devices | 0 |")


def make_wheel(path: Path, files: dict[str, bytes]) -> Path:
    with zipfile.ZipFile(path, "w") as archive:
        for name, data in files.items():
            archive.writestr(name, data)
    return path


def test_a_bundle_that_cannot_serve_is_named_with_what_makes_it(tmp_path, capsys, kit_start):
    (tmp_path / "empty").mkdir()
    # tools/gpu-check itself, once: the standard library alone refuses, nothing imports torch.
    proc = subprocess.run([str(KIT), str(tmp_path / "out"), "--device", "cpu",
                           "--bundle", str(tmp_path / "empty")], cwd=REPO,
                          env={**os.environ, "PYTHON": sys.executable}, capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 2, proc.stderr
    assert "empty: no wheels there; `make gpu-bundle` makes them" in proc.stderr
    make_wheel(tmp_path / "empty" / "tiny-1.0-py3-none-any.whl", {"tiny/__init__.py": b""})
    assert kit_start.main([str(REPO / "tools" / "gpu_check.py"), str(tmp_path / "out"),
                           "--bundle", str(tmp_path / "empty")]) == 2
    assert ("empty: no wheel of spotring there; `make gpu-bundle` makes the bundle with it"
            in capsys.readouterr().err)
    assert not (tmp_path / "out").exists()


def test_without_spotring_and_without_a_bundle_the_kit_names_the_bundle(tmp_path):
    # python -S: this Python's site-packages, where spotring is installed, are not read.
    proc = subprocess.run([sys.executable, "-S", str(REPO / "tools" / "run_bundled.py"),
                           str(REPO / "tools" / "gpu_check.py"), str(tmp_path / "out")],
                          cwd=REPO, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert f"spotring is not installed for {sys.executable}: give --bundle DIR" in proc.stderr


def test_a_bundle_is_installed_once_and_a_wheel_for_another_python_is_refused(
        tmp_path, monkeypatch, kit_start):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    bundle = tmp_path / "bundle"
    bundle.mkdir()
    make_wheel(bundle / "tiny-1.0-py3-none-any.whl", {
        "tiny/__init__.py": b"X = 1\n", "tiny-1.0.dist-info/METADATA": b"Name: tiny\n",
        "tiny-1.0.data/purelib/tiny_extra.py": b"", "tiny-1.0.data/scripts/tiny": b"#!/bin/sh\n"})
    site = kit_start.install(bundle)
    assert site.parent == tmp_path / "cache" / "spotring" / "bundles"
    assert sorted(p.relative_to(site).as_posix() for p in site.rglob("*") if p.is_file()) == [
        "tiny-1.0.dist-info/METADATA", "tiny/__init__.py", "tiny_extra.py"]
    (site / "mark").touch()
    assert kit_start.install(bundle) == site and (site / "mark").exists()  # not again

    foreign = "other-1.0-cp27-cp27mu-manylinux1_x86_64.whl"
    make_wheel(bundle / foreign, {"other.py": b""})
    with pytest.raises(kit_start.Unusable, match=f"{foreign} cannot run on this Python"):
        kit_start.install(bundle)


def test_a_wheel_runs_here_by_its_tags(kit_start):
    minor, arch = sys.version_info.minor, os.uname().machine
    runs = ["a-1-py3-none-any.whl",
            f"b-1-cp3{minor}-cp3{minor}-manylinux_2_17_{arch}.manylinux2014_{arch}.whl",
            f"c-1-cp39-abi3-manylinux2014_{arch}.whl"]  # the stable ABI of 3.9 and later
    foreign = [f"d-1-cp3{minor + 1}-cp3{minor + 1}-manylinux2014_{arch}.whl",
               f"e-1-cp3{minor}-cp3{minor}-win_amd64.whl", "f-1-py2-none-any.whl"]
    assert [kit_start.supported(Path(name)) for name in runs + foreign] == \
        [True] * len(runs) + [False] * len(foreign)


@pytest.mark.skipif(sys.version_info < (3, 11), reason=(
    "tools/run_bundled.py is standard library only and reads pyproject.toml with tomllib "
    "(Python 3.11 on): the GPU machine's Python is 3.12"))
def test_a_bundle_of_other_code_than_the_checkouts_is_refused_naming_the_files(tmp_path,
                                                                               kit_start):
    # The checkout's code copied beside a wheel of it, as `make gpu-bundle` makes one.
    checkout = tmp_path / "checkout"
    checkout.mkdir()
    (checkout / "pyproject.toml").write_text((REPO / "pyproject.toml").read_text())
    for folder in pyproject()["tool"]["setuptools"]["package-dir"].values():
        # Not the runs under benchmarks/results, which git ignores (and may be large).
        shutil.copytree(REPO / folder, checkout / folder,
                        ignore=shutil.ignore_patterns("__pycache__", "runs"))
    made = wheel.build(tmp_path / "bundle")
    assert kit_start.stale(made, checkout) == []

    (checkout / "trainer" / "loop.py").write_text("# another loop\n")
    (checkout / "conf" / "config.yaml").write_text("defaults: []\n")
    (checkout / "benchmarks" / "new.py").write_text("")
    (checkout / "sweep" / "report.py").unlink()
    run = checkout / "benchmarks" / "results" / "x" / "runs" / "r" / ".hydra"
    run.mkdir(parents=True)
    (run / "config.yaml").write_text("{}\n")  # a run's, which git ignores: not code
    assert kit_start.stale(made, checkout) == [
        "benchmarks/new.py (new)", "conf/config.yaml (changed)", "sweep/report.py (gone)",
        "trainer/loop.py (changed)"]


def link_alone(dest: Path, *names: str) -> None:
    """dest/: links to the distributions ``names`` and what their metadata requires here,
    and to nothing else of this environment."""
    dest.mkdir()
    seen, todo = set(), list(names)
    while todo:
        dist = metadata.distribution(todo.pop())
        if dist.name in seen:
            continue
        seen.add(dist.name)
        todo += [r.name for r in map(Requirement, dist.requires or [])
                 if r.marker is None or r.marker.evaluate({"extra": ""})]
        for top in {Path(str(f)).parts[0] for f in dist.files or []}:
            source = Path(dist.locate_file(top))
            if top not in ("..", "__pycache__") and not top.endswith(".pth") \
                    and source.exists() and not (dest / top).exists():
                (dest / top).symlink_to(source)


def python_with_torch_alone(tmp_path: Path) -> Path:
    """The python of a new virtual environment that has torch, torchvision and pytest and
    nothing else: the GPU machine's Python, which has those but not spotring."""
    link_alone(tmp_path / "torch", "torch", "torchvision", "pytest")
    venv.create(tmp_path / "venv", with_pip=False)
    python = tmp_path / "venv" / "bin" / "python"
    purelib = subprocess.run([str(python), "-c", "import sysconfig; "
                              "print(sysconfig.get_paths()['purelib'])"],
                             capture_output=True, text=True, check=True).stdout.strip()
    Path(purelib, "torch-alone.pth").write_text(f"{tmp_path / 'torch'}\n")
    return python


@pytest.mark.slow(cores=1)
def test_the_bundle_is_all_the_kit_and_the_trainer_need_beside_torch(tmp_path, kit_start):
    # The bundle for this Python (the bundle proper is for the GPU machine's 3.12): the
    # list's wheels from the package index, and spotring's own.
    gpu_bundle = tool("gpu_bundle")
    wheels = gpu_bundle.make(tmp_path / "bundle", python=())
    assert len(wheels) == len(gpu_bundle.requirements()) + 1
    assert any(w.name.startswith("spotring-") for w in wheels)
    python = python_with_torch_alone(tmp_path)
    env = {"PATH": os.environ["PATH"], "HOME": str(tmp_path),
           "XDG_CACHE_HOME": str(tmp_path / "cache")}
    # The kit, started there from this checkout: it installs the bundle and gets as far as
    # its results (a budget that runs out at once: no check starts; its budget stops it).
    kit = subprocess.run([str(KIT), str(tmp_path / "out"), "--device", "cpu", "--bundle",
                          str(tmp_path / "bundle"), "--budget", "0.001"], cwd=REPO,
                         env={**env, "PYTHON": str(python)}, capture_output=True, text=True,
                         timeout=300)
    assert kit.returncode == 0, kit.stdout + kit.stderr[-4000:]
    (site,) = (tmp_path / "cache" / "spotring" / "bundles").iterdir()
    results, checks, _ = results_of(tmp_path / "out")
    assert results["spotring"] == f"{metadata.version('spotring')} from {site}"
    assert {c["status"] for c in checks.values()} == {"skipped"}
    assert checks["tests"]["summary"].startswith("not started: the kit's time budget ran out")

    # The trainer from the bundle alone, away from the checkout.
    env |= {"PYTHONPATH": str(site), "PYTHONSAFEPATH": "1"}
    where = subprocess.run([str(python), "-c", "import spotring.trainer, hydra, yaml, "
                            "tensorboard, boto3; print(spotring.trainer.__file__, "
                            "hydra.__file__, yaml.__file__, tensorboard.__file__, "
                            "boto3.__file__)"], cwd=tmp_path, env=env, capture_output=True,
                           text=True, timeout=120)
    assert where.returncode == 0, where.stderr
    paths = where.stdout.split()
    assert len(paths) == 5 and all(path.startswith(str(site)) for path in paths), paths
    run = subprocess.run([str(python), "-m", "spotring.trainer",
                          f"hydra.run.dir={tmp_path / 'run'}", "telemetry.progress=false",
                          "train.device=cpu", "train.max_steps=2", "dataset=synthetic",
                          "dataset.train_size=256", "dataset.test_size=64"],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr[-4000:]
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["steps"] == 2
    assert (tmp_path / "run" / "tensorboard").is_dir()
