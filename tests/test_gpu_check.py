"""tools/gpu-check, the one command that proves spotring on a GPU machine, kept from
rotting where there is no GPU: its CPU mode runs every check, and the wheel list of
`make gpu-bundle` is all the trainer needs beside a torch."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from importlib import metadata
from pathlib import Path

import pytest
import torch
from packaging.requirements import Requirement

from spotring.benchmarks import gpu_bundle, gpu_check
from spotring.trainer.config import compile_unavailable
from tests.conftest import REPO


@pytest.mark.slow
def test_the_cpu_mode_runs_every_check_and_reports_each_figure(tmp_path):
    out = tmp_path / "out"
    start = time.monotonic()
    proc = subprocess.run([str(REPO / "tools" / "gpu-check"), str(out), "--device", "cpu",
                           "--tiny"], env={**os.environ, "PYTHON": sys.executable},
                          capture_output=True, text=True, timeout=600)
    print(f"\ntools/gpu-check --device cpu --tiny: {time.monotonic() - start:.1f} s")
    assert proc.returncode == 0, proc.stdout + proc.stderr[-4000:]
    results = json.loads((out / "results.json").read_text())
    checks = {c["check"]: c for c in results["checks"]}
    names = [c.name for c in gpu_check.CHECKS]
    assert list(checks) == names
    report = (out / "report.md").read_text()
    for name in names:  # a row as each ended, and in the report
        assert f"| {name} | {checks[name]['status']} |" in proc.stdout
        assert f"| {name} | {checks[name]['status']} |" in report
    compiles = compile_unavailable(on_cpu=True) is None
    assert {n: c["status"] for n, c in checks.items()} == {
        **{n: "passed" for n in names}, "throughput fp16": "skipped",
        "throughput bf16 channels_last compile": "passed" if compiles else "skipped"}
    assert "fp16 on the CPU" in checks["throughput fp16"]["summary"]
    assert results["machine"]["torch"] == torch.__version__ and results["devices"] == 2

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
    # Its runs keep their records, not their checkpoints: OUTDIR is for committing.
    assert (out / "runs" / "mnist-w1-s0" / "summary.json").is_file()
    assert not list(out.glob("runs/*/checkpoints"))


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is here: the kit would run")
def test_without_a_gpu_the_kit_says_so_and_names_the_cpu_mode(tmp_path, capsys):
    assert gpu_check.main([str(tmp_path / "out")]) == 2  # --device cuda, the default
    assert "--device cuda: torch sees no GPU here" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_a_bundle_without_wheels_is_named_with_what_makes_them(tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    code = gpu_check.main([str(tmp_path / "out"), "--device", "cpu",
                           "--bundle", str(tmp_path / "empty")])
    assert code == 2
    assert "empty: no wheels there; `make gpu-bundle` makes them" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


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


@pytest.mark.slow
def test_the_bundle_list_is_all_the_trainer_needs_beside_torch(tmp_path):
    # The list's wheels for this Python (the bundle proper is for the GPU machine's
    # 3.12), from the package index, installed as tools/gpu-check installs them.
    wheels = gpu_bundle.download(tmp_path / "bundle", python=())
    assert len(wheels) == len(gpu_bundle.requirements())
    site = tmp_path / "site"
    gpu_bundle.install(tmp_path / "bundle", site)
    link_torch_alone(tmp_path / "torch")
    # python -S: no site-packages; the checkout, the bundle and torch alone.
    env = {"PATH": os.environ["PATH"], "HOME": os.environ.get("HOME", str(tmp_path)),
           "PYTHONPATH": os.pathsep.join(map(str, [REPO, site, tmp_path / "torch"]))}
    isolated = [sys.executable, "-S"]
    where = subprocess.run([*isolated, "-c", "import hydra, yaml, tensorboard, boto3; "
                            "print(hydra.__file__, yaml.__file__, tensorboard.__file__, "
                            "boto3.__file__)"], cwd=REPO, env=env, capture_output=True,
                           text=True, timeout=120)
    assert where.returncode == 0, where.stderr
    assert all(path.startswith(str(site)) for path in where.stdout.split())
    run = subprocess.run([*isolated, "-m", "spotring.trainer", f"hydra.run.dir={tmp_path / 'run'}",
                          "telemetry.progress=false", "train.device=cpu", "train.max_steps=2",
                          "dataset=synthetic", "dataset.train_size=256", "dataset.test_size=64"],
                         cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr[-4000:]
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["steps"] == 2
    assert (tmp_path / "run" / "tensorboard").is_dir()
