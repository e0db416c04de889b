"""engine=horovod: the same steps as engine=ddp, its options, its failures."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from harness.weights import distance_ratios
from spotring.checkpoint.layout import newest_valid
from spotring.exits import EXIT_PREEMPTED
from spotring.launch.commands import local_command, local_environment
from spotring.polling import poll
from tests.conftest import PARITY, QUICK, REPO, assert_close, run_trainer

STEPS = [*PARITY, "train.batch_size=32"]


@pytest.fixture(scope="module")
def horovod(tmp_path_factory):
    """A horovodrun run that also writes a timeline (which does not change the maths)."""
    run_dir = tmp_path_factory.mktemp("horovod") / "run"
    return run_trainer(run_dir, *STEPS, "engine=horovod", f"engine.timeline={run_dir}.json",
                       launcher="horovodrun", nproc=2)


@pytest.mark.slow
def test_horovod_and_ddp_take_the_same_steps(horovod, ddp_2x32):
    assert horovod.summary["engine"] == "horovod" and horovod.summary["steps"] == 20
    assert_close(horovod.params(), ddp_2x32.params(), rtol=1e-10)


@pytest.mark.slow
def test_timeline_is_valid_json_with_allreduce_events(horovod):
    events = json.loads(Path(f"{horovod.dir}.json").read_text())  # a whole JSON array
    rows = {e["pid"]: e["args"]["name"] for e in events
            if e.get("name") == "process_name" and "name" in e.get("args", {})}
    allreduces = [rows[e["pid"]] for e in events if e.get("ph") == "B"
                  and e.get("name") == "ALLREDUCE"]
    # Every parameter's gradient is allreduced at each of the 20 steps.
    for parameter in ["0.0.weight", "0.3.weight", "1.weight", "3.bias"]:
        assert allreduces.count(f"allreduce.{parameter}") == 20, parameter


@pytest.mark.slow
def test_fp16_compression_stays_within_its_rounding(train, ddp_2x32):
    """Tolerance. fp16 keeps 11 significant bits, and Horovod rounds twice (each rank's
    gradient, then their fp16 sum), so one step's update is off by at most ~2^-10 of
    itself: that is checked after step 1 (measured: 0.03%). Over 20 steps early in
    training the dynamics amplify such a perturbation, as they would any other (measured
    with the default model: 0.07% after 5 steps, 0.8% after 10, 3.6% after 20); 10% of
    the distance the weights moved leaves room for run-to-run variation, while a broken
    compression (say, sums not averaged) is off by about 100%. Uncompressed, the two
    engines agree to 1e-10 (the parity test)."""
    fp16 = train("fp16", *STEPS, "engine=horovod", "engine.compression=fp16",
                 launcher="horovodrun", nproc=2)
    for step, tolerance in [(1, 2**-10), (20, 0.1)]:
        for name, ratio in distance_ratios(ddp_2x32.params(step), fp16.params(step)).items():
            assert 0 < ratio <= tolerance, (step, name, ratio)


@pytest.mark.slow
def test_accumulation_under_horovod_equals_the_larger_batch(train, ddp_2x32):
    acc = train("acc", *PARITY, "train.batch_size=16", "train.accumulation=2",
                "engine=horovod", launcher="horovodrun", nproc=2)
    assert acc.summary["global_batch"] == 64
    assert_close(acc.params(), ddp_2x32.params(), rtol=1e-10)


@pytest.mark.slow
@pytest.mark.parametrize("launcher, how", [("horovodrun", "KILL"), ("mpirun", "TERM")])
def test_a_stopped_rank_ends_the_horovod_job_and_the_next_resumes_from_its_checkpoint(
        tmp_path, launcher, how):
    """A rank killed ends the job (not 0); a rank sent SIGTERM is a notice: Horovod's vote
    stops every rank at one step with a checkpoint, and mpirun exits 75. Either way the
    next job resumes from the newest checkpoint."""
    args = [f"hydra.run.dir={tmp_path}", *QUICK, "engine=horovod", "engine.timeout_s=20",
            "dataset=synthetic", "dataset.shape=[1,28,28]", "dataset.train_size=100000",
            "train.batch_size=16", "train.threads=1", "checkpoint.every_steps=2"]
    proc = subprocess.Popen(local_command(launcher, 2, args), cwd=REPO, env=local_environment(),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        # Once rank 0 wrote a checkpoint, kill one worker (the newest trainer process) in
        # the middle of its steps.
        poll(lambda: newest_valid(tmp_path / "checkpoints"), timeout_s=120, interval_s=0.05,
             what="a checkpoint")
        # The ranks' own processes: the launcher's command line names the run dir as
        # well, and horovodrun starts its ranks in sessions of their own.
        worker = (f"^{re.escape(sys.executable)} -m spotring.trainer "
                  f"hydra.run.dir={re.escape(str(tmp_path))} ")
        workers = subprocess.run(["pgrep", "-f", "-n", worker], capture_output=True,
                                 text=True).stdout.split()
        assert workers and int(workers[-1]) != proc.pid, "no worker found"
        subprocess.run(["kill", f"-{how}", workers[-1]], check=True)
        code = proc.wait(timeout=60)  # bounds a failure: the job must end, not hang
        output = proc.stdout.read()
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
    if how == "TERM":
        stopped = json.loads((tmp_path / "preempted.json").read_text())["step"]
        # A whole checkpoint of that step: every rank wrote its part there, at one step.
        assert code == EXIT_PREEMPTED, output[-3000:]
        assert newest_valid(tmp_path / "checkpoints").step == stopped, output[-3000:]
    else:
        assert code != 0
    # Only rank 0 holds the checkpoint; the others receive it.
    newest = newest_valid(tmp_path / "checkpoints").step
    resumed = run_trainer(tmp_path, *args[1:], f"train.max_steps={newest + 2}",
                          launcher=launcher, nproc=2)
    assert f"resumed at step {newest}" in resumed.output
    assert resumed.summary["steps"] == newest + 2


@pytest.mark.slow(cores=1)
def test_engine_horovod_without_horovod_says_how_to_build_it(tmp_path):
    # Shadow the installed Horovod with an empty package: `import horovod.torch` then
    # fails exactly as on a machine where it was never built.
    (tmp_path / "shadow" / "horovod").mkdir(parents=True)
    (tmp_path / "shadow" / "horovod" / "__init__.py").write_text("")
    run = run_trainer(tmp_path / "run", "engine=horovod", expect=2,
                      env={"PYTHONPATH": str(tmp_path / "shadow")})
    assert "engine=horovod, but Horovod is not installed here" in run.output
    assert "make horovod" in run.output
