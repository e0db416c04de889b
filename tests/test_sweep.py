"""spotring sweep on this machine: real Optuna studies of short MNIST trials, 2 at a
time on the 2 cores, each trial a real trainer process, and of a user's own script
(tests/user_script.py) run from its project directory; the study read back from its
journal, the report from its markdown, what each trial's processes got from /proc."""

from __future__ import annotations

import itertools
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from datetime import datetime
from pathlib import Path

import boto3
import optuna
import pytest
from optuna.storages import JournalStorage
from optuna.storages.journal import JournalFileBackend
from optuna.trial import TrialState

from spotring.contract import RESTART, RUN_DIR, RUN_ID
from spotring.exits import EXIT_CONFIG
from spotring.launch.commands import local_environment
from spotring.sweep.__main__ import main as sweep_main
from spotring.sweep.report import pareto_front
from spotring.sweep.runner import PARAMS
from tests.conftest import REPO
from tests.test_sweep_report import number, trials_table
from tests.user_script import reference, write_project

# A trial: a few dozen steps of the default MNIST run, evaluated on 500 test images.
SHORT = ["train.eval_samples=500", "telemetry.progress=false"]
PNG = b"\x89PNG\r\n\x1a\n"
CORES = len(os.sched_getaffinity(0))
LR = "sweep.params.lr=interval(0.01,0.1)"


def sweep_command(sweep_dir: Path, *overrides: str, trainer: tuple[str, ...] = ()) -> list[str]:
    return [sys.executable, "-m", "spotring", "sweep", f"sweep.dir={sweep_dir}", *overrides,
            "--", *SHORT, *trainer]


def run_sweep(sweep_dir: Path, *overrides: str, trainer: tuple[str, ...] = (),
              expect: int = 0, env: dict[str, str] | None = None) -> str:
    proc = subprocess.run(sweep_command(sweep_dir, *overrides, trainer=trainer), cwd=REPO,
                          capture_output=True, text=True, timeout=600,
                          env=local_environment(**(env or {})))
    output = proc.stdout + proc.stderr
    assert proc.returncode == expect, f"exit {proc.returncode}\n{output[-6000:]}"
    return output


def load(sweep_dir: Path, name: str) -> optuna.Study:
    storage = JournalStorage(JournalFileBackend(str(sweep_dir / "study.journal")))
    return optuna.load_study(study_name=name, storage=storage)


def trials(sweep_dir: Path) -> list[optuna.trial.FrozenTrial]:
    """The study's trials as the journal has them now; none before the sweep made it."""
    try:
        return load(sweep_dir, "faults").trials
    except (KeyError, FileNotFoundError):
        return []


def summary(sweep_dir: Path, number: int) -> dict:
    return json.loads((sweep_dir / "trials" / f"{number:03d}" / "summary.json").read_text())


def table_row(report: str, number: int) -> list[str]:
    line = next(line for line in report.splitlines()
                if line.startswith(f"| [{number}](trials/{number:03d}) |"))
    return [cell.strip() for cell in line.strip("|").split("|")]


def attempts(trial_dir: Path) -> int:
    """How many attempts the sweep counted for the trial: the number of the last one its
    trial.log names."""
    return max(int(n) for n in re.findall(r"^spotring sweep: \S+ \S+ attempt (\d+) starts",
                                          (trial_dir / "trial.log").read_text(), re.MULTILINE))


def environment(pid: int) -> dict[str, str]:
    """A running process's environment."""
    raw = Path(f"/proc/{pid}/environ").read_bytes().decode()
    return dict(item.split("=", 1) for item in raw.split("\0") if "=" in item)


def lifetime(trial_dir: Path) -> tuple[datetime, datetime]:
    """When the trial's process started and ended, from its trial.log."""
    stamps = re.findall(r"^spotring sweep: (\S+ \S+) attempt (?:1 starts|ended)",
                        (trial_dir / "trial.log").read_text(), re.MULTILINE)
    assert len(stamps) == 2, stamps
    return datetime.fromisoformat(stamps[0]), datetime.fromisoformat(stamps[1])


@pytest.mark.slow
def test_a_two_objective_study_runs_two_trials_at_a_time_and_reports_its_pareto_front(
        tmp_path):
    sweep_dir = tmp_path / "sweep"
    run_sweep(sweep_dir, "sweep=custom", "sweep.name=width", "sweep.trials=6",
              "sweep.parallel=2", "sweep.sampler=nsga2",
              "sweep.objectives=[test_accuracy,parameter_mb]",
              trainer=("model.hidden=choice(16,64,256)", "optim.lr=interval(0.05,0.2)",
                       "train.epochs=0.05", "telemetry.log_every=5"))

    study = load(sweep_dir, "width")
    assert [t.state for t in study.trials] == [TrialState.COMPLETE] * 6
    summaries = {t.number: summary(sweep_dir, t.number) for t in study.trials}
    for t in study.trials:  # the study holds what each trial's summary.json says
        s = summaries[t.number]
        assert t.values == [s["test_accuracy"], s["parameter_mb"]]
        assert f"model.hidden={t.user_attrs['params']['model.hidden']}" in \
            (sweep_dir / "trials" / f"{t.number:03d}" / ".hydra" / "overrides.yaml").read_text()

    # Two trials ran at the same time: their own logs say so.
    intervals = [lifetime(sweep_dir / "trials" / f"{n:03d}") for n in range(6)]
    assert any(a[0] < b[1] and b[0] < a[1] for a, b in itertools.combinations(intervals, 2)), \
        intervals

    report = (sweep_dir / "sweep_report.md").read_text()
    values = [[summaries[n]["test_accuracy"], summaries[n]["parameter_mb"]] for n in range(6)]
    front = {n for n in pareto_front(values, ["maximize", "minimize"])}
    # Recomputed here: no trial is at least as good in both and better in one.
    front_by_hand = {i for i, (acc, mb) in enumerate(values) if not any(
        a >= acc and m <= mb and (a > acc or m < mb) for a, m in values)}
    assert front == front_by_hand
    for n in range(6):
        cells = table_row(report, n)
        assert cells[1] == "complete"
        assert cells[2] == ("★" if n in front else "")
        assert f"{100 * summaries[n]['test_accuracy']:.2f}" in cells
        assert f"{summaries[n]['parameters']:,}" in cells
    for png in ("optimization_history.png", "pareto_front.png"):
        data = (sweep_dir / png).read_bytes()
        assert data.startswith(PNG) and len(data) > 5000
    # The best trial's command, which trains it again: the trainer with its values.
    best = study.best_trials[0]
    again = ["spotring", "train", *SHORT, "train.epochs=0.05", "telemetry.log_every=5",
             *(f"{k}={v}" for k, v in best.user_attrs["params"].items())]
    assert f"```sh\n{' '.join(again)}\n```" in report.split("## Trials")[0]


def trial_pids(trial_dir: Path) -> list[int]:
    """The processes of a running trial: those whose environment names its run dir."""
    found = []
    for proc in Path("/proc").iterdir():
        try:
            if proc.name.isdigit() and environment(int(proc.name)).get(RUN_DIR) == str(trial_dir):
                found.append(int(proc.name))
        except OSError:  # ended meanwhile
            continue
    return found


def wait_for(condition, timeout: float = 120.0, what: str = ""):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if value := condition():
            return value
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}")


def checkpoint_steps(trial_dir: Path) -> list[int]:
    return sorted(int(p.stem.split("-")[1]) for p in (trial_dir / "checkpoints").glob("*.json"))


@pytest.mark.slow
def test_killed_trials_resume_diverged_ones_fail_and_a_killed_sweep_continues(tmp_path):
    """Grid: 2 learning rates x 2 seeds; LR 1e4 diverges. Trial 0 (the first
    converging one) has its processes killed at a checkpoint; then the sweep itself is
    killed while trials run, and the same command finishes the study."""
    sweep_dir = tmp_path / "sweep"
    overrides = ("sweep=custom", "sweep.name=faults", "sweep.parallel=2", "sweep.sampler=grid")
    trainer = ("optim.lr=choice(0.05,10000)", "train.seed=choice(1,2)", "train.epochs=0.25",
               "checkpoint.every_steps=20", "telemetry.log_every=5")
    first = subprocess.Popen(sweep_command(sweep_dir, *overrides, trainer=trainer), cwd=REPO,
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                             env=local_environment(), start_new_session=True)
    try:
        # The first trial with the converging LR, killed once it has a checkpoint.
        victim = wait_for(lambda: next((t.number for t in trials(sweep_dir) if t.user_attrs.get(
            "params", {}).get("optim.lr") == "0.05"), None), what="a converging trial")
        victim_dir = sweep_dir / "trials" / f"{victim:03d}"
        wait_for(lambda: checkpoint_steps(victim_dir), what="its first checkpoint")
        pids = trial_pids(victim_dir)
        env = environment(pids[0])  # the contract's variables, on its first attempt
        assert (env[RUN_ID], env[RUN_DIR], env[RESTART]) == \
            (f"faults/{victim:03d}", str(victim_dir), "0")
        assert {k: str(v) for k, v in json.loads(env[PARAMS]).items()} == \
            trials(sweep_dir)[victim].user_attrs["params"]
        for pid in pids:
            os.kill(pid, signal.SIGKILL)
        # Once the sweep resumed it, and some trial has finished: kill the sweep.
        wait_for(lambda: trials(sweep_dir)[victim].user_attrs.get("retries") == 1
                 and any(t.state.is_finished() for t in trials(sweep_dir)),
                 what="the killed trial to resume")
        os.killpg(first.pid, signal.SIGKILL)
        first_output = first.communicate(timeout=30)[0]
    finally:
        if first.poll() is None:
            os.killpg(first.pid, signal.SIGKILL)
    assert "it resumes from its checkpoint (retry 1 of 2)" in first_output, first_output
    finished_before = {t.number for t in trials(sweep_dir) if t.state.is_finished()}
    unfinished = {t.number for t in trials(sweep_dir)} - finished_before
    assert finished_before and unfinished

    second_output = run_sweep(sweep_dir, *overrides, trainer=trainer)
    started_again = {int(n) for n in re.findall(r"trial (\d+) (?:starts|resumes)",
                                                second_output)}
    assert not started_again & finished_before, second_output
    assert unfinished <= started_again

    study = load(sweep_dir, "faults")
    assert len(study.trials) == 4
    for t in study.trials:
        if t.user_attrs["params"]["optim.lr"] == "10000":  # diverged: a failed trial
            assert t.state == TrialState.FAIL
            assert t.user_attrs["note"].startswith("diverged at step")
        else:
            assert t.state == TrialState.COMPLETE
    # The killed trial counted one retry (a killed sweep is no fault of the trial), and
    # its last attempt went on from a checkpoint: it trained only the steps after it.
    assert study.trials[victim].user_attrs["retries"] == 1
    resumed = summary(sweep_dir, victim)
    from_step = int(re.search(r"ckpt-(\d+)", resumed["resumed_from"]).group(1))
    assert from_step > 0 and resumed["steps_this_run"] == resumed["steps"] - from_step
    report = (sweep_dir / "sweep_report.md").read_text()
    assert "diverged at step" in report
    # The report's restarts: every attempt after a trial's first, whatever stopped the one
    # before (the trial killed, or the sweep), as its trial.log counts them.
    restarts = {number(row["trial"]): int(row["restarts"]) for row in trials_table(report)}
    assert restarts == {n: attempts(sweep_dir / "trials" / f"{n:03d}") - 1 for n in range(4)}
    assert restarts[victim] >= 1 and any(restarts[n] >= 1 for n in unfinished), restarts


def script_environments() -> list[dict[str, str]]:
    """The environments of the user's train.py processes that the sweep started."""
    found = subprocess.run(["pgrep", "-f", "train.py --steps"], capture_output=True,
                           text=True).stdout.split()
    envs = []
    for pid in found:
        try:
            env = environment(int(pid))
        except OSError:
            continue  # it just ended
        if RUN_ID in env:  # not the sweep, whose command line names train.py too
            envs.append(env | {"cmdline": Path(f"/proc/{pid}/cmdline").read_text()})
    return envs


@pytest.mark.slow
def test_a_sweep_of_a_users_script_fills_its_placeholders_and_reports_its_summaries(
        tmp_path):
    """4 trials of tests/user_script.py's train.py, 2 at a time, from a project directory
    that holds only it: each trial the command with its values in the placeholders and
    the contract's variables, its summary.json in its own directory, the report's
    numbers and the best trial's command line read from there."""
    project = write_project(tmp_path / "project")
    words = ["python", "train.py", "--steps", "20", "--sleep", "0.05", "--lr", "{lr}",
             "--batch", "{batch}"]
    sweep = subprocess.Popen(
        [sys.executable, "-m", "spotring", "sweep", "sweep=custom", "sweep.name=script",
         "sweep.trials=4", "sweep.parallel=2", "sweep.params.lr=interval(0.01,0.1)",
         "sweep.params.batch=choice(8,16)", "sweep.objectives=[test_loss]", "--", *words],
        cwd=project, env=local_environment(), stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True)
    try:
        env = wait_for(lambda: next(iter(script_environments()), None), what="a trial")
        output = sweep.communicate(timeout=300)[0]
    finally:
        if sweep.poll() is None:
            sweep.kill()
    assert sweep.returncode == 0, output
    sweep_dir = project / "runs" / "sweeps" / "script"
    assert sorted(p.name for p in project.iterdir()) == ["runs", "train.py"]

    study = load(sweep_dir, "script")
    assert [t.state for t in study.trials] == [TrialState.COMPLETE] * 4
    params = {t.number: t.user_attrs["params"] for t in study.trials}
    # What one trial's process got: its values in the command and in SPOTRING_PARAMS,
    # its own run directory, its first attempt.
    seen = int(env[RUN_ID].removeprefix("script/"))
    assert env[RUN_ID] == f"script/{seen:03d}" and env[RESTART] == "0"
    assert env[RUN_DIR] == str(sweep_dir / "trials" / f"{seen:03d}")
    assert json.loads(env[PARAMS]) == {"lr": float(params[seen]["lr"]),
                                       "batch": int(params[seen]["batch"])}
    assert env["cmdline"].split("\0")[:-1] == [
        w.format(**params[seen]) for w in words]

    report = (sweep_dir / "sweep_report.md").read_text()
    rows = {number(row["trial"]): row for row in trials_table(report)}
    for t in study.trials:
        s = summary(sweep_dir, t.number)  # the script's, where the trial's env put it
        assert s["run_dir"] == str(sweep_dir / "trials" / f"{t.number:03d}")
        assert s["global_batch"] == int(params[t.number]["batch"])
        assert t.values == [s["test_loss"]]
        row = rows[t.number]
        assert (row["lr"], row["batch"], row["test loss"], row["restarts"]) == \
            (params[t.number]["lr"], params[t.number]["batch"], f"{s['test_loss']:.4f}", "0")
    best = study.best_trial.number
    again = [w.format(**params[best]) for w in words]
    assert f"```sh\n{' '.join(again)}\n```" in report.split("## Best trial")[1]
    # The best trial trained with exactly the values shown: the same weights as the
    # script run alone with them.
    alone = reference(tmp_path / "alone", *again[2:])
    assert summary(sweep_dir, best)["weights"] == pytest.approx(alone["weights"], abs=1e-10)
    intervals = [lifetime(sweep_dir / "trials" / f"{n:03d}") for n in range(4)]
    assert any(a[0] < b[1] and b[0] < a[1] for a, b in itertools.combinations(intervals, 2)), \
        intervals


@pytest.mark.slow
def test_with_a_checkpoint_uri_the_study_survives_the_loss_of_its_machine(tmp_path, s3):
    """S3 is a moto server. The sweep directory is deleted after the study finished (the
    machine is gone); the same command elsewhere finds the study in S3 and trains nothing
    again."""
    sweep_dir, uri = tmp_path / "sweep", "s3://spotring/team"
    overrides = ("sweep=custom", "sweep.name=spot", "sweep.trials=2", "sweep.parallel=2")
    overrides = (*overrides, f"sweep.checkpoint_uri={uri}")
    trainer = ("optim.lr=choice(0.05,0.1)", "train.epochs=0.02")
    run_sweep(sweep_dir, *overrides, trainer=trainer, env=s3)
    keys = [o["Key"] for o in boto3.client("s3").list_objects_v2(
        Bucket="spotring", Prefix="team/sweeps/spot/")["Contents"]]
    assert "team/sweeps/spot/study.journal" in keys
    for n in range(2):  # each trial checkpointed to its own prefix
        assert any(k.startswith(f"team/sweeps/spot/trials/{n:03d}/ckpt-") for k in keys), keys

    shutil.rmtree(sweep_dir)
    output = run_sweep(sweep_dir, *overrides, trainer=trainer, env=s3)
    assert "the study from s3://spotring/team/sweeps/spot/study.journal" in output
    assert not re.search(r"trial \d+ (starts|resumes)", output), output
    assert [t.state for t in load(sweep_dir, "spot").trials] == [TrialState.COMPLETE] * 2


@pytest.mark.parametrize("overrides, trainer, named", [
    (["sweep=custom"], ["no_such.key=choice(1,2)"], "no_such"),
    (["sweep=custom"], ["optim.lr=interval(0.5,0.1)"], "inverted"),
    (["sweep=custom"], ["train.batch_size=range(64,8)"], "empty range"),
    (["sweep=custom"], ["optim.lr=choice()"], "optim.lr"),
    ([f"sweep.parallel={CORES + 1}"], [], f"sweep.parallel={CORES + 1}"),
    (["sweep.objectives=[test_acc]"], [], "test_acc"),
    (["sweep.pruner=median", "sweep.objectives=[train_seconds]"], [],
     "sweep.pruner=median"),
    (["sweep.objectives=[dollars]"], [], "sweep.hourly_price"),
    (["sweep=custom", "sweep.sampler=grid"], ["optim.lr=interval(0.01,0.1)"], "grid"),
    (["sweep=custom"], ["model.depth=choice(2,5)", "model=cifar_convnet", "dataset=cifar10"],
     "model.depth=5"),
    # A command of the user's own, run from a project holding train.py.
    (["sweep=custom", LR], ["python", "missing.py", "--lr", "{lr}"], "missing.py: no such file"),
    (["sweep=custom", LR, "sweep.params.batch=choice(8,16)"], ["python", "train.py", "--lr",
                                                               "{lr}"],
     "sweep.params batch: not in the command"),
    (["sweep=custom", LR], ["python", "train.py", "--lr", "{lr}", "--batch", "{batch}"],
     "the command's {batch}: no such param; valid: {lr}"),
    (["sweep=custom", LR, "sweep.objectives=[val_loss]"], ["python", "train.py", "--lr", "{lr}"],
     "val_loss:min or val_loss:max"),
])
def test_bad_input_exits_2_naming_the_value_before_anything_exists(
        tmp_path, capsys, monkeypatch, overrides, trainer, named):
    monkeypatch.chdir(write_project(tmp_path / "project"))
    sweep_dir = tmp_path / "sweep"
    code = sweep_main([f"sweep.dir={sweep_dir}", *overrides, "--", *trainer])
    err = capsys.readouterr().err
    assert code == EXIT_CONFIG
    assert named in err and err.startswith("spotring sweep: error:"), err
    assert not sweep_dir.exists()
