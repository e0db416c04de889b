"""spotring sweep on this machine, 2 trials at a time on the 2 cores: real Optuna studies,
each trial a real process, the study read back from its journal, the report from its
markdown, what each trial's processes got from /proc.

Two sweeps, each run once and read by several tests:

    trainer_sweep   the built-in trainer's study of two objectives on MNIST: a grid of
                    2 learning rates (one diverges at once) x 2 widths
    script_sweep    a user's own script (harness/user_script.py) from its project
                    directory, its study kept in GCS (its emulator), through a schedule
                    of faults: one trial's processes killed at its first checkpoint, then
                    the sweep itself killed while trials run, the same command again to
                    the end, and again on a machine that lost the sweep directory
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest
from optuna.trial import TrialState

from harness import stores
from harness.commands import call
from harness.cores import cores
from harness.schedule import Schedule
from harness.sweeps import (
    attempts,
    command_line,
    environment,
    load,
    rows,
    run_sweep,
    side_by_side,
    summary,
    sweep_command,
    trial_dir,
    trial_pids,
    trials,
)
from harness.user_script import reference, write_project
from spotring.checkpoint.layout import manifests
from spotring.contract import CHECKPOINT_URI, RESTART, RUN_DIR, RUN_ID
from spotring.exits import EXIT_CONFIG
from spotring.launch.commands import local_environment
from spotring.polling import poll
from spotring.stores import open_store
from spotring.sweep import config as sweep_config
from spotring.sweep.__main__ import main as sweep_main
from spotring.sweep.report import pareto_front
from spotring.sweep.runner import PARAMS, Runner
from spotring.sweep.study import Study

PNG = b"\x89PNG\r\n\x1a\n"
CORES = len(os.sched_getaffinity(0))

# A few dozen steps of the default MNIST run, evaluated on 500 test images: the fixed
# words, then the two searched.
FIXED = ("train.epochs=0.05", "telemetry.log_every=5", "train.eval_samples=500",
         "telemetry.progress=false")
SEARCHED = ("optim.lr=choice(0.05,10000)", "model.hidden=choice(16,64)")


@pytest.fixture(scope="module")
def trainer_sweep(tmp_path_factory) -> Path:
    sweep_dir = tmp_path_factory.mktemp("trainer") / "sweep"
    with cores():
        run_sweep(f"sweep.dir={sweep_dir}", "sweep=custom", "sweep.name=width",
                  "sweep.parallel=2", "sweep.sampler=grid",
                  "sweep.objectives=[test_accuracy,parameter_mb]", "--", *FIXED, *SEARCHED)
    return sweep_dir


def diverges(trial) -> bool:
    return trial.user_attrs["params"]["optim.lr"] == "10000"


@pytest.mark.slow
def test_the_study_holds_what_each_trials_summary_says(trainer_sweep):
    study = load(trainer_sweep, "width")
    assert len(study.trials) == 4
    for t in study.trials:
        if diverges(t):
            continue
        s = summary(trainer_sweep, t.number)
        assert t.state == TrialState.COMPLETE
        assert t.values == [s["test_accuracy"], s["parameter_mb"]]
        assert f"model.hidden={t.user_attrs['params']['model.hidden']}" in \
            (trial_dir(trainer_sweep, t.number) / ".hydra" / "overrides.yaml").read_text()


@pytest.mark.slow
def test_a_diverged_trial_fails_and_is_not_run_again(trainer_sweep):
    table = rows((trainer_sweep / "sweep_report.md").read_text())
    diverged = [t for t in load(trainer_sweep, "width").trials if diverges(t)]
    assert len(diverged) == 2
    for t in diverged:
        assert t.state == TrialState.FAIL and t.user_attrs["starts"] == 1
        assert t.user_attrs["note"].startswith("diverged at step"), t.user_attrs
        assert table[t.number]["state"] == "failed"
        assert table[t.number]["note"] == t.user_attrs["note"]


@pytest.mark.slow
def test_the_report_marks_the_pareto_front_and_gives_the_best_trials_command(trainer_sweep):
    study = load(trainer_sweep, "width")
    report = (trainer_sweep / "sweep_report.md").read_text()
    table = rows(report)
    done = [t.number for t in study.trials if t.state == TrialState.COMPLETE]
    summaries = {n: summary(trainer_sweep, n) for n in done}
    values = [[summaries[n]["test_accuracy"], summaries[n]["parameter_mb"]] for n in done]
    front = {done[i] for i in pareto_front(values, ["maximize", "minimize"])}
    # Recomputed here: no trial is at least as good in both and better in one.
    front_by_hand = {done[i] for i, (acc, mb) in enumerate(values) if not any(
        a >= acc and m <= mb and (a > acc or m < mb) for a, m in values)}
    assert front == front_by_hand and front
    for n in done:
        row = table[n]
        assert (row["state"], row["pareto"]) == ("complete", "★" if n in front else "")
        assert row["test accuracy (%)"] == f"{100 * summaries[n]['test_accuracy']:.2f}"
        assert row["parameters"] == f"{summaries[n]['parameters']:,}"
    for png in ("optimization_history.png", "pareto_front.png"):
        data = (trainer_sweep / png).read_bytes()
        assert data.startswith(PNG) and len(data) > 5000
    # The best trial's command, which trains it again: the trainer with its values.
    best = study.best_trials[0]
    again = ["spotring", "train", *FIXED,
             *(f"{k}={v}" for k, v in best.user_attrs["params"].items())]
    assert f"```sh\n{' '.join(again)}\n```" in report.split("## Trials")[0]


@pytest.mark.slow
def test_two_trials_run_at_a_time(trainer_sweep):
    # Their own logs say so.
    assert side_by_side(trainer_sweep, list(range(4)))


# A user's script, its searched values in its command's placeholders: 30 steps of a
# global batch of 1 or 2, within the first epoch of its 64 samples (no stop falls on an
# epoch's end), long enough for a kill to land after the first checkpoint with 26 steps
# to spare.
WORDS = ("python", "train.py", "--steps", "30", "--save-every", "4", "--sleep", "0.2",
         "--lr", "{lr}", "--batch", "{batch}")
SCRIPT = ("sweep=custom", "sweep.name=script", "sweep.trials=4", "sweep.parallel=2",
          "sweep.params.lr=interval(0.01,0.1)", "sweep.params.batch=choice(1,2)",
          "sweep.objectives=[test_loss]", "checkpoint.uri=gs://spotring-tests/team",
          "--", *WORDS)


@dataclass
class Swept:
    """What the schedule of ``script_sweep`` saw."""

    dir: Path  # the sweep directory as the finished sweep left it (moved here at the end)
    ran_in: Path  # where it ran: runs/sweeps/script of the project
    victim: int  # the trial killed at its first checkpoint
    victim_env: dict[str, str]  # what its process had in its environment
    victim_command: list[str]  # and on its command line
    killed_output: str  # the sweep's, until it was killed
    finished_before: set[int]  # the trials finished when it was killed
    unfinished: set[int]
    second_output: str  # the same command, to the end
    project_files: list[str]  # the project directory then
    elsewhere: str  # the same command, where the sweep directory is gone


def checkpointed(sweep_dir: Path) -> int | None:
    """The first trial with a checkpoint of its own on disk."""
    for t in trials(sweep_dir, "script"):
        folder = trial_dir(sweep_dir, t.number) / "checkpoints"
        if folder.is_dir() and manifests(p.name for p in folder.iterdir()):
            return t.number
    return None


@pytest.fixture(scope="module")
def script_sweep(tmp_path_factory, gcs_emulator) -> Swept:
    gcs = gcs_emulator.env()
    tmp = tmp_path_factory.mktemp("script")
    project = write_project(tmp / "project")
    sweep_dir = project / "runs" / "sweeps" / "script"
    output = tmp / "sweep.out"
    with cores():
        with open(output, "w") as out:
            first = subprocess.Popen(sweep_command(*SCRIPT), cwd=project, stdout=out,
                                     stderr=subprocess.STDOUT, env=local_environment(**gcs),
                                     start_new_session=True)
        schedule = Schedule("spotring sweep of train.py", output.read_text)
        try:
            with schedule.step("a trial's processes SIGKILLed at its first checkpoint"):
                victim = poll(lambda: checkpointed(sweep_dir), timeout_s=300, interval_s=0.05,
                              what="a trial's first checkpoint")
                pids = trial_pids(trial_dir(sweep_dir, victim))
                assert pids, f"trial {victim} ended before it could be killed"
                env, words = environment(pids[0]), command_line(pids[0])
                for pid in pids:
                    os.kill(pid, signal.SIGKILL)
            with schedule.step("the sweep SIGKILLed once that trial resumed and another ended"):
                poll(lambda: trials(sweep_dir, "script")[victim].user_attrs.get("retries") == 1
                     and any(t.state.is_finished() for t in trials(sweep_dir, "script"))
                     or None, timeout_s=300, interval_s=0.05, what="the trial to resume")
                os.killpg(first.pid, signal.SIGKILL)
                first.wait(timeout=30)
                killed = output.read_text()
                finished = {t.number for t in trials(sweep_dir, "script")
                            if t.state.is_finished()}
                unfinished = {t.number for t in trials(sweep_dir, "script")} - finished
            with schedule.step("the same command again, to the study's end"):
                second = run_sweep(*SCRIPT, cwd=project, env=gcs)
                files = sorted(p.name for p in project.iterdir())
            with schedule.step("the same command where the sweep directory is gone"):
                kept = shutil.move(sweep_dir, tmp / "finished")
                elsewhere = run_sweep(*SCRIPT, cwd=project, env=gcs)
        finally:
            if first.poll() is None:
                os.killpg(first.pid, signal.SIGKILL)
                first.wait(timeout=30)
    return Swept(Path(kept), sweep_dir, victim, env, words, killed, finished,
                 unfinished, second, files, elsewhere)


def command_of(params: dict[str, str]) -> list[str]:
    return [w.format(**params) for w in WORDS]


def values(sweep_dir: Path) -> dict[int, dict[str, str]]:
    """Each trial's values as the report shows them, the words its command got."""
    table = rows((sweep_dir / "sweep_report.md").read_text())
    return {n: {key: row[key] for key in ("lr", "batch")} for n, row in table.items()}


@pytest.fixture(scope="module")
def alone(tmp_path_factory):
    """alone(params): summary.json of the script run alone, uninterrupted, with a trial's
    values; once for each."""
    made: dict[tuple[str, ...], dict] = {}

    def run(params: dict[str, str]) -> dict:
        args = tuple(command_of(params)[2:])
        if args not in made:
            made[args] = reference(tmp_path_factory.mktemp("alone"), *args)
        return made[args]
    return run


@pytest.mark.slow
def test_a_trial_runs_the_command_with_its_values_and_the_contracts_variables(script_sweep):
    """What the killed trial's process got on its first attempt: its values in the
    command and in SPOTRING_PARAMS, its own run directory and checkpoint prefix."""
    swept, n = script_sweep, script_sweep.victim
    params = values(swept.dir)[n]
    env = swept.victim_env
    assert (env[RUN_ID], env[RUN_DIR], env[RESTART]) == (
        f"script/{n:03d}", str(trial_dir(swept.ran_in, n)), "0")
    assert env[CHECKPOINT_URI] == f"gs://spotring-tests/team/sweeps/script/trials/{n:03d}"
    assert json.loads(env[PARAMS]) == {"lr": float(params["lr"]), "batch": int(params["batch"])}
    assert swept.victim_command == command_of(params)
    # Its summary.json where its environment put it; the project holds nothing else new.
    assert summary(swept.dir, n)["run_dir"] == env[RUN_DIR]
    assert swept.project_files == ["runs", "train.py"]


@pytest.mark.slow(cores=1)
def test_a_killed_trial_resumes_from_its_checkpoint_and_ends_as_if_never_stopped(
        script_sweep, alone):
    swept, n = script_sweep, script_sweep.victim
    assert "it resumes from its checkpoint (retry 1 of 2)" in swept.killed_output, \
        swept.killed_output
    trial = load(swept.dir, "script").trials[n]
    assert trial.state == TrialState.COMPLETE and trial.user_attrs["retries"] == 1
    resumed = summary(swept.dir, n)
    # Its last attempt resumed: none where the sweep's kill stopped it at its last step.
    assert 0 <= resumed["steps_this_run"] < resumed["steps"] == 30, resumed
    assert resumed["weights"] == pytest.approx(alone(values(swept.dir)[n])["weights"],
                                               abs=1e-10)


@pytest.mark.slow
def test_a_killed_sweep_continues_and_runs_no_finished_trial_again(script_sweep):
    swept = script_sweep
    assert swept.finished_before and swept.unfinished, swept.killed_output
    started_again = {int(n) for n in re.findall(r"trial (\d+) (?:starts|resumes)",
                                                swept.second_output)}
    assert not started_again & swept.finished_before, swept.second_output
    assert swept.unfinished <= started_again, swept.second_output
    study = load(swept.dir, "script")
    assert [t.state for t in study.trials] == [TrialState.COMPLETE] * 4
    # A killed sweep is no fault of the trial: only the victim's own stop was charged.
    assert {t.number: t.user_attrs.get("retries", 0) for t in study.trials} == {
        t.number: int(t.number == swept.victim) for t in study.trials}


@pytest.mark.slow
def test_the_report_shows_each_trials_values_summary_and_restarts(script_sweep):
    """Restarts: every attempt after a trial's first, whatever stopped the one before
    (the trial killed, or the sweep), as its trial.log counts them."""
    swept = script_sweep
    table = rows((swept.dir / "sweep_report.md").read_text())
    for t in load(swept.dir, "script").trials:
        s, row = summary(swept.dir, t.number), table[t.number]
        assert t.values == [s["test_loss"]] and row["test loss"] == f"{s['test_loss']:.4f}"
        # The values the study drew, in the words of the command (lr to 4 digits).
        assert int(row["batch"]) == t.params["batch"] == s["global_batch"]
        assert float(row["lr"]) == pytest.approx(t.params["lr"], rel=1e-3)
        counted = attempts(trial_dir(swept.dir, t.number))[-1].number
        assert row["restarts"] == str(counted - 1)
    restarted = {n for n, row in table.items() if int(row["restarts"]) >= 1}
    assert swept.victim in restarted and restarted & swept.unfinished, table


@pytest.mark.slow(cores=1)
def test_the_best_trials_command_trains_it_again(script_sweep, alone):
    swept = script_sweep
    best = load(swept.dir, "script").best_trial
    again = command_of(values(swept.dir)[best.number])
    report = (swept.dir / "sweep_report.md").read_text()
    assert f"```sh\n{' '.join(again)}\n```" in report.split("## Best trial")[1]
    # It trained with exactly the values shown: the weights of the script run alone.
    assert summary(swept.dir, best.number)["weights"] == pytest.approx(
        alone(values(swept.dir)[best.number])["weights"], abs=1e-10)


@pytest.mark.slow
def test_with_a_checkpoint_uri_the_study_survives_the_loss_of_its_machine(script_sweep,
                                                                          gcs_emulator):
    """Run again where the sweep directory is gone, the same command finds the study in
    GCS (its emulator) and trains nothing again."""
    swept = script_sweep
    with stores.environment(gcs_emulator.env()):
        keys = open_store("gs://spotring-tests/team/sweeps/script").names()
    assert "study.journal" in keys
    for n in range(4):  # each trial checkpointed to its own prefix
        assert any(k.startswith(f"trials/{n:03d}/ckpt-") for k in keys), keys
    assert ("the study from gs://spotring-tests/team/sweeps/script/study.journal"
            in swept.elsewhere)
    assert not re.search(r"trial \d+ (starts|resumes)", swept.elsewhere), swept.elsewhere
    assert [t.state for t in load(swept.ran_in, "script").trials] == [TrialState.COMPLETE] * 4


# A trial that outlives its sweep: killed outright, the sweep sends its trials SIGTERM
# (slots._ends_with_sweep), and each checkpoints and leaves in its own time, or finishes
# where the stop came too late, as this one does once the test lets it.
OUTLIVES = """\
import json, os, signal, sys, time
from pathlib import Path

events = Path(sys.argv[1])
with open(events / "started", "a") as f:
    f.write("started\\n")
stopped = []
signal.signal(signal.SIGTERM, lambda *_: stopped.append(1))
for _ in range(30000):
    if stopped or (events / "go").exists():
        break
    time.sleep(0.01)
(events / "terminated").touch()
for _ in range(30000):
    if (events / "go").exists():
        break
    time.sleep(0.01)
run = Path(os.environ["SPOTRING_RUN_DIR"])
run.mkdir(parents=True, exist_ok=True)
(run / "summary.json").write_text(json.dumps({"test_loss": 0.5}))
"""


@pytest.mark.slow(cores=1)
def test_a_trial_still_running_from_a_killed_sweep_is_waited_for_and_not_run_again(tmp_path):
    events, project = tmp_path / "events", write_project(tmp_path / "project")
    events.mkdir()
    (project / "outlives.py").write_text(OUTLIVES)
    args = ("sweep=custom", "sweep.name=outlived", "sweep.trials=1", "sweep.parallel=1",
            "sweep.params.x=choice(1)", "sweep.objectives=[test_loss]", "--",
            "python", "outlives.py", str(events), "{x}")
    sweep_dir = project / "runs" / "sweeps" / "outlived"

    def started() -> int:
        path = events / "started"
        return len(path.read_text().splitlines()) if path.exists() else 0

    outputs = [tmp_path / "first.out", tmp_path / "second.out"]
    sweeps = []
    try:
        with open(outputs[0], "w") as out:
            sweeps.append(subprocess.Popen(sweep_command(*args), cwd=project, stdout=out,
                                           stderr=subprocess.STDOUT, start_new_session=True,
                                           env=local_environment()))
        poll(lambda: started() or None, timeout_s=120, interval_s=0.05,
             what="the trial to start")
        os.killpg(sweeps[0].pid, signal.SIGKILL)
        sweeps[0].wait(timeout=30)
        poll(lambda: (events / "terminated").exists() or None, timeout_s=30, interval_s=0.05,
             what="the trial, outliving its sweep, to be sent SIGTERM")
        with open(outputs[1], "w") as out:
            sweeps.append(subprocess.Popen(sweep_command(*args), cwd=project, stdout=out,
                                           stderr=subprocess.STDOUT, start_new_session=True,
                                           env=local_environment()))
        # The second sweep waits for the trial's processes, or runs its command again.
        poll(lambda: "processes of an earlier attempt still run" in outputs[1].read_text()
             or started() > 1 or None, timeout_s=120, interval_s=0.05,
             what="the second sweep to reach the trial")
        assert started() == 1, outputs[1].read_text()
        (events / "go").touch()
        assert sweeps[1].wait(timeout=120) == 0, outputs[1].read_text()
    finally:
        (events / "go").touch()  # whatever still runs of the trial ends
        for sweep in sweeps:
            if sweep.poll() is None:
                os.killpg(sweep.pid, signal.SIGKILL)
                sweep.wait(timeout=30)
    (trial,) = load(sweep_dir, "outlived").trials
    assert trial.state == TrialState.COMPLETE and trial.values == [0.5]
    assert trial.user_attrs["starts"] == 1 and started() == 1


def test_a_trial_left_without_values_by_a_sweep_killed_inside_ask_gets_them_on_resume(
        tmp_path, monkeypatch):
    """Optuna's ask stores a new trial, then each of its values: a sweep killed in
    between leaves a running trial with none. The next sweep samples them and runs it."""
    monkeypatch.chdir(write_project(tmp_path / "project"))
    overrides = [o for o in SCRIPT[:SCRIPT.index("--")] if "checkpoint.uri" not in o]
    plan = sweep_config.plan(overrides, list(WORDS))
    study = Study(plan, tmp_path, None)
    study.study._storage.create_new_trial(study.study._study_id)  # what the kill left
    trial = Runner(plan, study, [], tmp_path)._next()
    assert trial.number == 0 and set(trial.params) == {"lr", "batch"}, trial.params
    assert 0.01 <= trial.params["lr"] <= 0.1 and trial.params["batch"] in (1, 2)


@pytest.mark.parametrize("overrides, trainer, named", [
    (["sweep=custom"], ["no_such.key=choice(1,2)"], "no_such"),
    (["sweep=custom"], ["optim.lr=interval(0.5,0.1)"], "inverted"),
    (["sweep=custom"], ["train.batch_size=range(64,8)"], "empty range"),
    (["sweep=custom"], ["optim.lr=choice()"], "optim.lr"),
    ([f"sweep.parallel={CORES + 1}"], [], f"sweep.parallel={CORES + 1}"),
    (["sweep.pruner=median", "sweep.objectives=[train_seconds]"], [],
     "sweep.pruner=median"),
    (["sweep.objectives=[dollars]"], [], "sweep.hourly_price"),
    (["sweep=custom", "sweep.sampler=grid"], ["optim.lr=interval(0.01,0.1)"], "grid"),
    (["sweep=custom"], ["model.depth=choice(2,5)", "model=cifar_convnet", "dataset=cifar10"],
     "model.depth=5"),
    # A command of the user's own, run from a project holding train.py.
    (["sweep=custom", "sweep.params.lr=interval(0.01,0.1)"],
     ["python", "missing.py", "--lr", "{lr}"], "missing.py: no such file"),
    (["sweep=custom", "sweep.params.lr=interval(0.01,0.1)", "sweep.params.batch=choice(8,16)"],
     ["python", "train.py", "--lr", "{lr}"], "sweep.params batch: not in the command"),
    (["sweep=custom", "sweep.params.lr=interval(0.01,0.1)"],
     ["python", "train.py", "--lr", "{lr}", "--batch", "{batch}"],
     "the command's {batch}: no such param; valid: {lr}"),
    (["sweep=custom", "sweep.params.lr=interval(0.01,0.1)", "sweep.objectives=[val_loss]"],
     ["python", "train.py", "--lr", "{lr}"], "val_loss:min or val_loss:max"),
    (["checkpoint.uri=gs:/bucket"], [], "checkpoint.uri=gs:/bucket: expected"),
    # The s3:// forgotten: the study and every trial's checkpoints would go to a folder.
    (["checkpoint.uri=mybucket/team"], [], "checkpoint.uri=mybucket/team: expected "
     "s3://bucket/prefix, gs://bucket/prefix, az://container/prefix or file:///path"),
    # The key of before: unknown, as any other (checkpoint.uri on every command).
    (["sweep.checkpoint_uri=s3://b/p"], [], "Could not override 'sweep.checkpoint_uri'"),
])
def test_bad_input_exits_2_naming_the_value_before_anything_exists(
        tmp_path, monkeypatch, overrides, trainer, named):
    monkeypatch.chdir(write_project(tmp_path / "project"))
    sweep_dir = tmp_path / "sweep"
    done = call(sweep_main, f"sweep.dir={sweep_dir}", *overrides, "--", *trainer)
    assert done.code == EXIT_CONFIG
    assert named in done.err and done.err.startswith("spotring sweep: error:"), done.err
    assert not sweep_dir.exists()


@pytest.mark.slow(cores=1)
def test_the_command_exits_2_on_bad_input_before_anything_exists(tmp_path):
    """`spotring sweep` as users type it, in a process of its own."""
    sweep_dir = tmp_path / "sweep"
    output = run_sweep(f"sweep.dir={sweep_dir}", "sweep.objectives=[test_acc]",
                       expect=EXIT_CONFIG)
    assert output.startswith("spotring sweep: error:") and "test_acc" in output, output
    assert not sweep_dir.exists()
