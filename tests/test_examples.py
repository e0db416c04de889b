"""examples/: a user's own script gets spotring's guarantees under every launcher.

One uninterrupted reference run (torchrun, 2 workers, 2 loader processes each) answers
for the others: 1 worker alone, mpirun, Horovod's example under horovodrun, and a run
stopped by SIGTERM mid-epoch and resumed on 4 workers all end with its weights (srun:
tests/test_slurm.py; every notice, and resuming from S3: tests/test_resume.py).
In float64, as tests/test_equivalence.py explains: in float32 a rounding difference
eventually flips a near-tie in a max-pool and the runs drift apart.
"""

from __future__ import annotations

import difflib
import errno
import json
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest
from torchvision.datasets import ImageFolder

from harness.examples import (
    EPOCHS,
    EXAMPLES,
    GLOBAL_BATCH,
    PER_CLASS,
    SEED,
    STEPS_PER_EPOCH,
    TIMEOUT,
    run,
    started,
    weights,
    write_images,
)
from spotring.checkpoint.layout import Checkpoints, folder_name
from spotring.exits import EXIT_PREEMPTED
from spotring.sampler import epoch_order
from tests.conftest import assert_close

# The largest number of lines train.py adds to or changes in plain_train.py.
MOST_CHANGED_LINES = 17


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("images")
    write_images(root)
    return root


@pytest.fixture(scope="module")
def reference(data, tmp_path_factory) -> Path:
    """The uninterrupted run: torchrun, 2 workers, 2 data loader processes each."""
    out = tmp_path_factory.mktemp("reference")
    run("torchrun", 2, data, out, "--workers", "2")
    return out


def test_train_py_is_plain_train_py_and_a_few_marked_lines():
    plain, spotring = ((EXAMPLES / name).read_text().splitlines()
                       for name in ("plain_train.py", "train.py"))
    diff = list(difflib.unified_diff(plain, spotring, lineterm=""))[2:]  # no file names
    added = [line[1:] for line in diff if line.startswith("+") and line[1:].strip()]
    assert all("# spotring" in line for line in added), "\n".join(added)
    assert 0 < len(added) <= MOST_CHANGED_LINES, "\n".join(added)  # none: spotring unused
    # examples/README.md shows the diff as it is.
    shown = (EXAMPLES / "README.md").read_text().split("```diff\n")[1].split("```")[0]
    assert shown.splitlines() == diff


@pytest.mark.slow
def test_the_plain_script_runs_and_saves_the_same_model(reference, data, tmp_path):
    plain = weights(run("single", 1, data, tmp_path, script="plain_train.py"))
    assert plain.keys() == weights(reference / "weights.pt").keys()


@pytest.mark.slow
def test_two_workers_with_loader_processes_take_one_workers_steps(reference, data, tmp_path):
    alone = run("single", 1, data, tmp_path)
    assert_close(weights(alone), weights(reference / "weights.pt"), rtol=1e-10)


@pytest.mark.slow
def test_rank_0_alone_writes_summary_and_test_metrics(reference):
    summary = json.loads((reference / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["launcher"] == "torchrun"
    assert summary["steps"] == EPOCHS * STEPS_PER_EPOCH
    assert summary["global_batch"] == GLOBAL_BATCH
    assert summary["test_accuracy"] >= 0.9
    records = [json.loads(line) for line in (reference / "metrics.jsonl").read_text().splitlines()]
    tests = [r for r in records if r["kind"] == "test"]
    # One writer: two ranks would leave two records, or one line cut into another.
    assert len(tests) == 1, tests
    assert tests[0]["accuracy"] == summary["test_accuracy"]
    assert tests[0]["step"] == EPOCHS * STEPS_PER_EPOCH
    found = Checkpoints(reference / "checkpoints", keep=EPOCHS).found()
    assert [c.step for c in found] == list(range(EPOCHS * STEPS_PER_EPOCH, 0,
                                                 -STEPS_PER_EPOCH))  # one every epoch
    for checkpoint in found:
        checkpoint.verify()


def held(data: Path, copy: Path, epoch: int, batch: int) -> tuple[Path, bytes]:
    """``data`` copied to ``copy``, where the first training image of global batch
    ``batch`` of ``epoch`` becomes a named pipe: the rank that reads it waits until the
    test writes the image (``give``), so a signal or notice lands at a known step however
    fast the run is. Every epoch reads it once. Returns the pipe and the image."""
    shutil.copytree(data, copy)
    index = int(epoch_order(2 * PER_CLASS, SEED, epoch)[batch * GLOBAL_BATCH])
    fifo = Path(ImageFolder(copy / "train").samples[index][0])
    image = fifo.read_bytes()
    fifo.unlink()
    os.mkfifo(fifo)
    return fifo, image


def reader_waiting(fifo: Path, proc: subprocess.Popen, deadline: float) -> int:
    """Wait until the run opens ``fifo`` to read it; returns the writing end."""
    while True:
        try:
            return os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
        except OSError as e:
            if e.errno != errno.ENXIO:  # ENXIO: no reader yet
                raise
        assert proc.poll() is None, proc.communicate()[0][-6000:]
        assert time.monotonic() < deadline, "the run never read the image"
        time.sleep(0.01)


def give(fd: int, content: bytes) -> None:
    try:
        os.write(fd, content)  # a PNG of 8x8 fits the pipe's buffer: no wait
    finally:
        os.close(fd)


@pytest.mark.slow
def test_sigterm_mid_epoch_exits_75_and_resumes_on_4_workers(reference, data,
                                                                     tmp_path):
    # SIGTERM while a rank waits for the image of epoch 1's global batch 2 (of 0..5).
    images = tmp_path / "images"
    fifo, image = held(data, images, epoch=1, batch=2)
    out = tmp_path / "run"
    with started("torchrun", 2, images, out) as proc:
        deadline = time.monotonic() + TIMEOUT
        give(reader_waiting(fifo, proc, deadline), image)  # epoch 0
        # A new pipe in its place, atomically: the one just read may still be open.
        os.mkfifo(tmp_path / "pipe")
        os.replace(tmp_path / "pipe", fifo)
        fd = reader_waiting(fifo, proc, deadline)  # epoch 1, step 2
        ranks = subprocess.run(["pgrep", "-P", str(proc.pid)], capture_output=True,
                               text=True, timeout=10).stdout.split()
        assert len(ranks) == 2, ranks
        for pid in ranks:  # every process gets SIGTERM on a spot instance's shutdown
            os.kill(int(pid), signal.SIGTERM)
        give(fd, image)
        output, _ = proc.communicate(timeout=TIMEOUT)
    # torchrun exits 1 when a worker fails, naming the worker's exit code.
    assert f"exitcode  : {EXIT_PREEMPTED}" in output, output[-6000:]
    stopped = json.loads((out / "preempted.json").read_text())
    # The signal comes in epoch 1's 3rd step (or the 4th, where a rank runs its handler
    # only after the image came); the next vote carries it and is read a step later: after
    # the 4th step where the ranks vote every step, up to 8 steps after the 3rd where they
    # vote less often (an interval at most doubles at each vote: 8 by then).
    assert STEPS_PER_EPOCH + 4 <= stopped["step"] <= STEPS_PER_EPOCH + 3 + 8, stopped
    assert stopped["reason"] == "SIGTERM"
    assert stopped["checkpoint"] == str(out / "checkpoints" / folder_name(stopped["step"]))
    assert not (out / "weights.pt").exists() and not (out / "summary.json").exists()

    # The same command continues, on 4 workers.
    resumed = run("torchrun", 4, data, out)
    assert_close(weights(resumed), weights(reference / "weights.pt"), rtol=1e-10)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["world_size"] == 4
    assert summary["steps_this_run"] == EPOCHS * STEPS_PER_EPOCH - stopped["step"]


@pytest.mark.slow
def test_horovod_style_under_horovodrun_takes_the_same_steps(reference, data, tmp_path):
    try:
        import horovod.torch  # noqa: F401
    except ImportError as e:
        pytest.skip(f"Horovod is not built in this environment ({e}): `make horovod`")
    ran = run("horovodrun", 2, data, tmp_path, script="horovod_style.py")
    # Horovod averages as (a + b) / 2, DDP as a/2 + b/2: in float64 a rounding apart.
    assert_close(weights(ran), weights(reference / "weights.pt"), rtol=1e-10)
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["engine"] == "horovod" and summary["world_size"] == 2


@pytest.mark.slow
def test_mpirun_takes_the_same_steps(reference, data, tmp_path):
    ran = run("mpirun", 2, data, tmp_path)
    assert_close(weights(ran), weights(reference / "weights.pt"), rtol=1e-10)
    assert json.loads((tmp_path / "summary.json").read_text())["launcher"] == "mpi"
