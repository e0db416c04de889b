"""A loss that becomes NaN or infinite ends the run at once, on every rank at the same
step, with its own exit code (65) and rank 0's note diverged.json."""

from __future__ import annotations

import json
import math
import re

import pytest

from spotring.exits import DIVERGED, EXIT_DIVERGED
from spotring.launch.job_command import JobCommand

# optim.lr=1e4 (x2 at batch 64): the train loss is ~5e14 after step 2 and infinite at
# step 3 on MNIST with the default config.
DIVERGING = ["optim.lr=1e4", "train.eval_samples=500"]


def _note(run) -> dict:
    return json.loads((run.dir / DIVERGED).read_text())


@pytest.mark.slow(cores=1)
@pytest.mark.parametrize("max_steps, log_every, kind, step", [
    (30, 5, "train", 5),  # caught at the first log line, after its allreduce
    (5, 100, "test", 5),  # no log line: the final test
])
def test_a_diverging_run_exits_65_with_a_note_and_no_summary(train, max_steps, log_every, kind,
                                                              step):
    run = train("run", *DIVERGING, f"train.max_steps={max_steps}",
                f"telemetry.log_every={log_every}", launcher="spawned", expect=EXIT_DIVERGED)
    note = _note(run)
    assert note["step"] == step and not math.isfinite(note["loss"])
    assert note["reason"].startswith(f"the {kind} loss is ")
    assert f"at step {step}: training diverged" in run.output
    assert "optim.lr" in run.output  # what to try
    assert not (run.dir / "summary.json").exists()


@pytest.mark.slow
def test_every_rank_stops_at_the_same_step_and_the_launcher_reads_65(train):
    run = train("run", *DIVERGING, "train.max_steps=30", "telemetry.log_every=5",
                launcher="torchrun", nproc=2, expect=None)
    assert run.proc.returncode != 0
    # One note, whole (no temporary file left), from rank 0; rank 1 says the same step.
    assert [p.name for p in run.dir.glob("*diverged*")] == [DIVERGED]
    assert _note(run)["step"] == 5
    assert re.search(r"\[rank 1\] ERROR spotring: the train loss is \S+ at step 5: "
                     "training diverged", run.output)
    assert not (run.dir / "summary.json").exists()
    job = JobCommand("torchrun", {})
    assert job.exit_code(run.proc.returncode, run.output, note=DIVERGED) == EXIT_DIVERGED
    assert job.exit_code(0, "", note=DIVERGED) == 0  # a finished job's stale note
