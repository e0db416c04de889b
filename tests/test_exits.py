"""One restart policy (spotring.support.restarts.verdict), applied by every launcher: what each exit
code is, and, for every code, how many times `spotring launch` (its recovery), the batch
script of `spotring sbatch` and the runner of `spotring sweep` run a job that keeps
ending with it, against what the policy table (docs/exit-codes.md) says."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from harness.recovery import node, supervised
from spotring.launch import recover
from spotring.launch import slurm as sbatch
from spotring.support.restarts import (
    MAX_PREEMPTIONS,
    MAX_RESTARTS,
    Launcher,
    Outcome,
    classify,
    table,
    verdict,
)
from spotring.sweep import runner
from tests.conftest import REPO


@pytest.mark.parametrize("code, outcome, budget, transient", [
    (0, Outcome.DONE, None, False),
    (1, Outcome.FAILED, MAX_RESTARTS, False),  # a crash: maybe a bug, restarted with care
    (2, Outcome.BAD_INPUT, None, False),  # the job's own verdict: never run again
    (65, Outcome.DIVERGED, None, False),
    (69, Outcome.LOST, MAX_RESTARTS, True),
    (137, Outcome.LOST, MAX_RESTARTS, True),  # srun: a task SIGKILLed
    (-9, Outcome.LOST, MAX_RESTARTS, True),  # Python's subprocess: the same
    (75, Outcome.PREEMPTED, MAX_PREEMPTIONS, True),
    (143, Outcome.INTERRUPTED, MAX_RESTARTS, True),  # SIGTERM before the trainer took it
    (138, Outcome.INTERRUPTED, MAX_RESTARTS, True),  # SIGUSR1 likewise
    (3, Outcome.FAILED, MAX_RESTARTS, False),  # a code of no meaning of its own
    (255, Outcome.FAILED, MAX_RESTARTS, False),  # ssh's own failure
])
def test_each_exit_is_classified_with_its_restart_budget(code, outcome, budget, transient):
    got = classify(code)
    assert (got, got.budget, got.transient) == (outcome, budget, transient)


def test_a_failure_runs_again_unless_it_repeats_or_its_step_is_unseen():
    assert verdict(1).budget == MAX_RESTARTS
    assert verdict(1, repeated=True).budget is None
    assert verdict(1, repeated=None).budget is None  # may be a bug: nothing tells
    assert verdict(69, repeated=None).budget == MAX_RESTARTS  # the machines' doing
    assert verdict(75, repeated=True).budget == MAX_PREEMPTIONS  # a notice, wherever


LAUNCHERS = [recover.POLICY, sbatch.POLICY, runner.POLICY]


def test_the_exit_code_page_shows_the_policy_of_each_launcher():
    page = (REPO / "docs/exit-codes.md").read_text()
    rendered = table(LAUNCHERS)
    assert rendered in page, f"docs/exit-codes.md's table is not:\n{rendered}"


# Every code with a meaning of its own, and some without (3, 130 a Ctrl-C, 255 ssh's).
CODES = [0, 1, 2, 3, 65, 69, 75, 130, 137, 138, 143, 255]
BUDGET = 2  # of each budget, in each launcher


def runs_by_the_policy(launcher: Launcher, code: int) -> int:
    """How many times the policy, as ``launcher`` applies it with BUDGET of each of its
    budgets, runs a job that ends with ``code`` at the same step every time."""
    spent: dict[str, int] = {}
    runs = 1
    while (budget := launcher.verdict(code, repeated=runs > 1).budget) is not None:
        key = launcher.budgets[budget]  # two budgets may be one setting
        if spent.get(key, 0) >= BUDGET:
            break
        spent[key] = spent.get(key, 0) + 1
        runs += 1
    return runs


def launch_runs(code: int, tmp_path: Path, monkeypatch) -> int:
    """launch/recover.py's supervise over a job that always ends with ``code`` at step 30
    on nodes that all stay up."""
    _, _, run, _ = supervised(tmp_path, monkeypatch, [(code, 30)] * 10,
                              listed=[node(0), node(1)], max_restarts=BUDGET,
                              max_preemptions=BUDGET, notice_wait_s=0.05)
    return len(run.tries())


def sbatch_runs(code: int, tmp_path: Path) -> int:
    """The batch script `spotring sbatch` writes, run by bash as SLURM would run it, again
    after each `scontrol requeue` it asks for (SLURM_RESTART_COUNT one more each time),
    with srun ending with ``code``."""
    cfg = sbatch.compose([f"max_restarts={BUDGET}", f"run_dir={tmp_path}"])
    (tmp_path / "sbatch.sh").write_text(sbatch.script(cfg, ["python", "train.py"], tmp_path))
    # srun ends with the code; squeue has no end for the job (no time limit); scontrol
    # says what it was asked. `exit 75` of the start guard is SLURM's "not run".
    stubs = (f"srun() {{ return {code}; }}; squeue() {{ echo NONE; }}; "
             'scontrol() { echo "scontrol $*"; }; ')
    runs = 0
    for restart in range(10):
        proc = subprocess.run(["bash", "-c", stubs + "source sbatch.sh"], cwd=tmp_path,
                              capture_output=True, text=True, timeout=60,
                              env={"PATH": os.environ["PATH"], "SLURM_JOB_ID": "7",
                                   "SLURM_RESTART_COUNT": str(restart)})
        runs += "srun exit" in proc.stdout
        if "scontrol requeue 7" not in proc.stdout:
            return runs
    raise AssertionError("requeued forever")


def sweep_runs(code: int, tmp_path: Path, monkeypatch) -> int:
    """The sweep's runner over one trial whose command always exits ``code`` (no
    metrics: the same unknown step every time), on this machine."""
    from spotring.sweep import config
    from spotring.sweep.slots import LocalSlot
    from spotring.sweep.study import Study

    tmp_path.mkdir()
    monkeypatch.chdir(tmp_path)
    # The runner looks at its trials every POLL_S (a second, for trainers that run for
    # minutes); this one ends in a fraction of that.
    monkeypatch.setattr(runner, "POLL_S", 0.01)
    exit_with = "import os, sys; sys.exit(int(os.environ['CODE']))"
    plan = config.plan(["sweep=custom", "sweep.name=codes", "sweep.trials=1",
                        f"sweep.max_retries={BUDGET}", "sweep.params.x=choice(1)"],
                       [sys.executable, "-c", exit_with, "{x}"])
    slot = LocalSlot("here", 1, {"CODE": str(code)}, None, 1.0, None)
    study = Study(plan, tmp_path, None)
    runner.Runner(plan, study, [slot], tmp_path).run()
    (trial,) = study.study.trials
    return trial.user_attrs["starts"]


@pytest.mark.slow(cores=1)  # the sweep's trials and the batch scripts are real processes
@pytest.mark.parametrize("code", CODES)
def test_every_launcher_runs_a_job_again_as_the_policy_table_says(code, tmp_path, monkeypatch):
    expected = {launcher.name: runs_by_the_policy(launcher, code) for launcher in LAUNCHERS}
    got = {recover.POLICY.name: launch_runs(code, tmp_path / "launch", monkeypatch),
           sbatch.POLICY.name: sbatch_runs(code, tmp_path.resolve()),
           runner.POLICY.name: sweep_runs(code, tmp_path / "sweep", monkeypatch)}
    assert got == expected
