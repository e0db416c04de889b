"""tools/gpu-check, the one command that proves spotring on a GPU machine, kept from
rotting where there is no GPU: its CPU mode runs every check; stopped by a signal or by
its budget it takes every process it started down with it and says which checks ran; and
the bundle of `make gpu-bundle` is all it needs on a Python that has torch alone."""

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
from importlib import metadata
from pathlib import Path

import pytest
import torch
from packaging.requirements import Requirement

from spotring.benchmarks import gpu_bundle, gpu_check, gpu_kit, gpu_report
from spotring.launch import wheel
from spotring.runtime import compile_unavailable
from tests.conftest import REPO

KIT = REPO / "tools" / "gpu-check"
NAMES = [c.name for c in gpu_check.CHECKS]


@pytest.fixture(scope="module")
def kit_start():
    """tools/run_bundled.py, which runs by its path before anything of spotring imports."""
    spec = importlib.util.spec_from_file_location("run_bundled", REPO / "tools" / "run_bundled.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def marked() -> tuple[dict[str, str], str]:
    """An environment for the kit with a mark of its own, which every process it starts
    inherits; and the mark."""
    mark = uuid.uuid4().hex
    return {**os.environ, "PYTHON": sys.executable, "SPOTRING_TEST_MARK": mark}, mark


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


@pytest.mark.slow
def test_the_cpu_mode_runs_every_check_and_reports_each_figure(tmp_path):
    out = tmp_path / "out"
    start = time.monotonic()
    proc = subprocess.run([str(KIT), str(out), "--device", "cpu", "--tiny"], cwd=REPO,
                          env={**os.environ, "PYTHON": sys.executable},
                          capture_output=True, text=True, timeout=600)
    print(f"\ntools/gpu-check --device cpu --tiny: {time.monotonic() - start:.1f} s")
    assert proc.returncode == 0, proc.stdout + proc.stderr[-4000:]
    results, checks, report = results_of(out)
    assert list(checks) == NAMES
    for name in NAMES:  # a row as each ended, and in the report
        assert f"| {name} | {checks[name]['status']} |" in proc.stdout
        assert f"| {name} | {checks[name]['status']} |" in report
    compiles = compile_unavailable(torch.device("cpu")) is None
    assert {n: c["status"] for n, c in checks.items()} == {
        **{n: "passed" for n in NAMES}, "throughput fp16": "skipped",
        "throughput bf16 channels_last compile": "passed" if compiles else "skipped"}
    assert "fp16 on the CPU" in checks["throughput fp16"]["summary"]
    assert results["machine"]["torch"] == torch.__version__ and results["devices"] == 2
    assert results["stopped_by"] is None and results["passed"]
    assert results["spotring"] == f"{metadata.version('spotring')} from {REPO}"

    for name, workers in (("mnist 1", 1), ("mnist all", 2)):
        figures = checks[name]["figures"]
        assert figures["workers"] == workers and figures["reached"] == 1
        (run,) = figures["runs"]
        assert run["seconds_to_target"] > 0 and run["images_per_second"] > 0
        assert run["backend"] == "gloo" and run["command"] in checks[name]["commands"]
        assert f"--nproc-per-node {workers} -m spotring.trainer" in run["command"]
    assert checks["parity"]["figures"]["relative_difference"] <= 1e-10
    throughput = checks["throughput fp32"]["figures"]
    assert throughput["images_per_second"]["mean"] > 0 and throughput["peak_memory_mb"] > 0
    preemption = checks["preemption"]["figures"]
    assert preemption["exit_code"] == 75 and preemption["bitwise_equal"]
    assert 10 <= preemption["stopped_at"] < preemption["steps"] == 40
    allreduce = checks["allreduce"]["figures"]
    assert [r["bytes"] for r in allreduce["sizes"]] == [1024, 4096, 16384, 65536]
    assert all(r["busbw_gbps"] > 0 for r in allreduce["sizes"])
    fsdp = checks["fsdp"]["figures"]
    for engine in ("ddp", "fsdp"):
        assert fsdp[engine]["engine"] == engine and fsdp[engine]["world_size"] == 1
        assert fsdp[engine]["tokens_per_second"] > 0
        assert fsdp[engine]["ranks"][0]["peak_memory_mib"] > 0
    saves = checks["checkpoint"]["figures"]
    assert saves["world_size"] == 2 and saves["state_bytes"] >= 0.02e9
    for kind in ("background", "blocking"):
        assert saves[kind]["saves"] >= 1 and saves[kind]["save_step"] > 0
    # Its runs keep their records, not their checkpoints: OUTDIR is for committing.
    assert (out / "runs" / "mnist-w1-s0" / "summary.json").is_file()
    assert not list(out.glob("runs/*/checkpoints"))


@pytest.mark.slow
def test_sigterm_in_the_middle_of_a_check_stops_the_kit_and_every_process_it_started(
        tmp_path):
    out = tmp_path / "out"
    env, mark = marked()
    kit = subprocess.Popen([str(KIT), str(out), "--device", "cpu", "--tiny"], cwd=REPO, env=env,
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 300
        while not torchrun_workers(mark):  # the checks' trainers under way
            assert kit.poll() is None and time.monotonic() < deadline, kit.communicate()
            time.sleep(0.1)
        kit.send_signal(signal.SIGTERM)
        stdout, stderr = kit.communicate(timeout=60)
    finally:
        if kit.poll() is None:
            kit.kill()
            kit.communicate()
    assert kit.returncode == 128 + signal.SIGTERM, stdout + stderr[-4000:]
    assert none_left(mark) == []
    results, checks, report = results_of(out)
    assert results["stopped_by"] == "SIGTERM"
    assert list(checks) == NAMES  # every check says what became of it
    stopped = [n for n, c in checks.items() if c["status"] == "stopped"]
    assert stopped and all("the kit got SIGTERM" in checks[n]["summary"] for n in stopped)
    assert all(c["status"] == "skipped" and c["summary"].startswith("not started: the kit got "
                                                                    "SIGTERM")
               for n, c in checks.items() if n not in stopped)
    assert "**Stopped by SIGTERM**" in report and f"| {stopped[0]} | stopped |" in report
    assert "gpu-check: STOPPED by SIGTERM" in stdout


@pytest.mark.slow
def test_a_check_that_would_run_past_the_budget_is_stopped(tmp_path):
    out = tmp_path / "out"
    env, mark = marked()
    start = time.monotonic()
    proc = subprocess.run([str(KIT), str(out), "--device", "cpu", "--tiny", "--budget", "10"],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    wall = time.monotonic() - start
    assert proc.returncode == 0, proc.stdout + proc.stderr[-4000:]
    assert none_left(mark) == []
    results, checks, _ = results_of(out)
    assert results["stopped_by"] is None and list(checks) == NAMES
    statuses = {c["status"] for c in checks.values()}
    assert "stopped" in statuses and statuses <= {"passed", "stopped", "skipped"}
    for check in checks.values():
        if check["status"] == "stopped":
            assert "time budget ran out (--budget 10)" in check["summary"]
    # Not the minutes its checks take: stopped, not waited for (start-up and saving aside).
    assert wall < 10 + 60, wall


def test_bad_input_exits_2_naming_it(tmp_path, capsys):
    for args, named in ((["--budget", "0"], "0: must be a number above 0"),
                        (["--device", "tpu"], "'tpu'"), (["--bund", "x"], "--bund")):
        with pytest.raises(SystemExit) as exited:
            gpu_check.main([str(tmp_path / "out"), *args])
        assert exited.value.code == 2 and named in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is here: the kit would run")
def test_without_a_gpu_the_kit_says_so_and_names_the_cpu_mode(tmp_path, capsys):
    assert gpu_check.main([str(tmp_path / "out")]) == 2  # --device cuda, the default
    assert "--device cuda: torch sees no GPU here" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_the_report_of_a_gpu_machine_names_it_and_says_why_a_check_failed():
    gpu = {"count": 1, "name": "NVIDIA H100 80GB HBM3", "memory_gib": 79.2, "capability": "9.0",
           "driver": "580.65.06", "cuda": "13.0", "cudnn": 91300, "nccl": "2.27.7"}
    results = {
        "command": "tools/gpu-check out --bundle gpu-bundle", "mode": "full", "device": "cuda",
        "devices": 1, "bundle": "gpu-bundle (17 wheels)", "spotring": "0.1.0 from /cache/k",
        "throughput_workload": gpu_kit.FULL.workload, "started": "2026-11-27 10:00:00",
        "machine": {"cpu": "Xeon", "cores": 16, "memory_gib": 125.8, "python": "3.12.3",
                    "torch": "2.11.0", "packages": {"torchvision": "0.26.0"}, "commit": "abc1234",
                    "gpu": gpu},
        "checks": [{"check": "mnist 1", "status": "failed", "summary": "1 of 3 seeds did not",
                    "seconds": 61.5, "figures": {"error": "1 of 3 seeds did not\nreach 99%"},
                    "commands": ["torchrun --standalone -m spotring.trainer"]},
                   {"check": "parity", "status": "skipped", "summary": "needs 2 cuda devices",
                    "seconds": 0.0, "figures": {}, "commands": []}],
        "stopped_by": None, "wall_seconds": 61.6}
    lines = gpu_report.report(results).splitlines()
    assert lines[0] == "# spotring GPU check: 1 x NVIDIA H100 80GB HBM3"
    assert lines[2].endswith(", full mode, 61.6 s: 1 failed, 1 skipped.")
    for line in ["| GPUs | 1 x NVIDIA H100 80GB HBM3 (79.2 GiB, compute capability 9.0) |",
                 "| driver, CUDA, cuDNN, NCCL | 580.65.06, 13.0, 91300, 2.27.7 |",
                 "| torch, torchvision | 2.11.0, 0.26.0 |",
                 "| spotring | 0.1.0 from /cache/k, commit abc1234; bundle gpu-bundle "
                 "(17 wheels) |",
                 "| mnist 1 | failed | 1 of 3 seeds did not | 61.5 |",
                 "| parity | skipped | needs 2 cuda devices | 0 |",
                 "    1 of 3 seeds did not", "    reach 99%",
                 "    torchrun --standalone -m spotring.trainer"]:
        assert line in lines


def make_wheel(path: Path, files: dict[str, bytes]) -> Path:
    with zipfile.ZipFile(path, "w") as archive:
        for name, data in files.items():
            archive.writestr(name, data)
    return path


@pytest.mark.parametrize("wheels, said", [
    ([], "empty: no wheels there; `make gpu-bundle` makes them"),
    (["tiny-1.0-py3-none-any.whl"], "empty: no wheel of spotring there; `make gpu-bundle` "
                                    "makes the bundle with it"),
])
def test_a_bundle_that_cannot_serve_is_named_with_what_makes_it(tmp_path, wheels, said):
    (tmp_path / "empty").mkdir()
    for name in wheels:
        make_wheel(tmp_path / "empty" / name, {"tiny/__init__.py": b""})
    proc = subprocess.run([str(KIT), str(tmp_path / "out"), "--device", "cpu",
                           "--bundle", str(tmp_path / "empty")], cwd=REPO,
                          env={**os.environ, "PYTHON": sys.executable}, capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 2 and said in proc.stderr, proc.stderr
    assert not (tmp_path / "out").exists()


def test_without_spotring_and_without_a_bundle_the_kit_names_the_bundle(tmp_path):
    # python -S: this Python's site-packages, where spotring is installed, are not read.
    proc = subprocess.run([sys.executable, "-S", str(REPO / "tools" / "run_bundled.py"),
                           "spotring.benchmarks.gpu_check", str(tmp_path / "out")], cwd=REPO,
                          capture_output=True, text=True, timeout=60)
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


def test_a_bundle_of_other_code_than_the_checkouts_is_refused_naming_the_files(tmp_path,
                                                                               kit_start):
    # The checkout's code copied beside a wheel of it, as `make gpu-bundle` makes one.
    checkout = tmp_path / "checkout"
    checkout.mkdir()
    (checkout / "pyproject.toml").write_text((REPO / "pyproject.toml").read_text())
    for folder in ("spotring", "conf", "trainer", "launch", "benchmarks", "sweep"):
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


def link_torch_alone(dest: Path) -> None:
    """dest/: links to torch, torchvision and what their metadata requires here, and to
    nothing else of this environment."""
    dest.mkdir()
    seen, todo = set(), ["torch", "torchvision"]
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
    """The python of a new virtual environment that has torch and torchvision and nothing
    else: the GPU machine's Python, which has torch but not spotring."""
    link_torch_alone(tmp_path / "torch")
    venv.create(tmp_path / "venv", with_pip=False)
    python = tmp_path / "venv" / "bin" / "python"
    purelib = subprocess.run([str(python), "-c", "import sysconfig; "
                              "print(sysconfig.get_paths()['purelib'])"],
                             capture_output=True, text=True, check=True).stdout.strip()
    Path(purelib, "torch-alone.pth").write_text(f"{tmp_path / 'torch'}\n")
    return python


@pytest.mark.slow
def test_the_bundle_is_all_the_kit_and_the_trainer_need_beside_torch(tmp_path, kit_start):
    # The bundle for this Python (the bundle proper is for the GPU machine's 3.12): the
    # list's wheels from the package index, and spotring's own.
    wheels = gpu_bundle.make(tmp_path / "bundle", python=())
    assert len(wheels) == len(gpu_bundle.requirements()) + 1
    assert any(w.name.startswith("spotring-") for w in wheels)
    python = python_with_torch_alone(tmp_path)
    env = {"PATH": os.environ["PATH"], "HOME": str(tmp_path),
           "XDG_CACHE_HOME": str(tmp_path / "cache")}
    # The kit, started there from this checkout: it installs the bundle and gets as far as
    # its results (a budget that runs out at once: no check starts).
    kit = subprocess.run([str(KIT), str(tmp_path / "out"), "--device", "cpu", "--bundle",
                          str(tmp_path / "bundle"), "--budget", "0.001"], cwd=REPO,
                         env={**env, "PYTHON": str(python)}, capture_output=True, text=True,
                         timeout=300)
    assert kit.returncode == 0, kit.stdout + kit.stderr[-4000:]
    (site,) = (tmp_path / "cache" / "spotring" / "bundles").iterdir()
    results, checks, _ = results_of(tmp_path / "out")
    assert results["spotring"] == f"{metadata.version('spotring')} from {site}"
    assert {c["status"] for c in checks.values()} == {"skipped"}

    # The trainer from the bundle alone, away from the checkout.
    env |= {"PYTHONPATH": str(site), "PYTHONSAFEPATH": "1"}
    where = subprocess.run([str(python), "-c", "import spotring.trainer, hydra, yaml, "
                            "tensorboard, boto3; print(spotring.trainer.__file__, "
                            "hydra.__file__, yaml.__file__, tensorboard.__file__, "
                            "boto3.__file__)"], cwd=tmp_path, env=env, capture_output=True,
                           text=True, timeout=120)
    assert where.returncode == 0, where.stderr
    assert all(path.startswith(str(site)) for path in where.stdout.split())
    run = subprocess.run([str(python), "-m", "spotring.trainer",
                          f"hydra.run.dir={tmp_path / 'run'}", "telemetry.progress=false",
                          "train.device=cpu", "train.max_steps=2", "dataset=synthetic",
                          "dataset.train_size=256", "dataset.test_size=64"],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr[-4000:]
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["steps"] == 2
    assert (tmp_path / "run" / "tensorboard").is_dir()
