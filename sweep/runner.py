"""The sweep's loop: a trial on every free slot, its evaluations to the pruner, its end
to the study, until the study has its trials.

Every trial is a whole spotring training job in SWEEP_DIR/trials/NNN/ (train.log,
metrics.jsonl, tensorboard/, checkpoints/, summary.json, and trial.log: what its
processes printed): the plan's command with the trial's values in its placeholders
(`spotring train ... optim.lr=0.0123` for the trainer). Every process of it gets the
contract's variables (spotring/contract.py):

    SPOTRING_RUN_ID          NAME/NNN, the same for every attempt of the trial
    SPOTRING_RUN_DIR         its run directory (on a cluster: on its slice's first node)
    SPOTRING_RESTART         0 on its first attempt, then 1, 2, ... (the report's restarts)
    SPOTRING_CHECKPOINT_URI  URI/sweeps/NAME/trials/NNN, where the sweep has a URI
    SPOTRING_PARAMS          its values as JSON, {"lr": 0.0123, "batch": 16}

How a trial ends decides what the study records:

    summary.json written          complete, with the objectives read from it (failed
                                  where it lacks one)
    the pruner stopped it         pruned (at its last reported evaluation)
    any other end                 the restart policy (spotring.exits, POLICY below;
                                  docs/exit-codes.md): where it runs the job again, the
                                  trial resumes from its own checkpoint in the same run
                                  directory, up to sweep.max_retries times; else, or
                                  then, failed (a divergence, bad input, a failure that
                                  repeats at the same step)

The exit is read with rank 0's note where it left one (spotring.support.restarts.with_note: torchrun
exits 1 whatever the trainer's exit 65 or 75), and the step a try reached from its
metrics (launch.tries.step_reached).

A slot is free again the moment its trial ends. Trials the study holds as running when
the sweep starts (a sweep that was stopped or killed) resume first; finished ones are
never run again. An attempt's processes hold its trial.log locked (flock, inherited with
the file they write to) for as long as any of them runs, and the next attempt waits for
them: a sweep killed outright leaves its trials running, told to stop
(slots._ends_with_sweep), and one may still be writing its checkpoint, or its
summary.json where the stop came after its last step, when the next sweep reaches it.
Two counts per trial, both in the study (user attrs), so that they outlive the sweep
process and the Trial objects, which are new on every attempt:
`starts`, its attempts (restarts = starts - 1, whatever stopped the one before), and
`retries`, those charged to the trial (its own stops while the sweep ran) against
sweep.max_retries; `ended`, [exit, step] of its last attempt, tells a repeat.
"""

from __future__ import annotations

import datetime
import fcntl
import json
import logging
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import optuna
from optuna.trial import TrialState

from spotring import contract
from spotring.checkpoint import layout
from spotring.exits import DIVERGED, EXIT_OK, ConfigError
from spotring.launch.tries import step_reached
from spotring.polling import poll
from spotring.support.restarts import (
    MAX_PREEMPTIONS,
    MAX_RESTARTS,
    NOTES,
    Launcher,
    Outcome,
    classify,
    with_note,
)
from spotring.sweep import report
from spotring.sweep.config import Plan, record_field
from spotring.sweep.slots import STOP_GRACE_S, TRIAL_LOG, Attempt, Slot, Work
from spotring.sweep.study import Study

log = logging.getLogger("launch")
POLL_S = 1.0  # how often trials are checked for their end and new evaluations
# How long an attempt waits for the processes of the trial's attempt before it to end:
# the grace they were given to checkpoint and leave, and as much again.
EARLIER_ATTEMPT_S = 2 * STOP_GRACE_S
STATES = {TrialState.COMPLETE: "complete", TrialState.PRUNED: "pruned",
          TrialState.FAIL: "failed", TrialState.RUNNING: "running", TrialState.WAITING: "running"}
PARAMS = "SPOTRING_PARAMS"  # a trial's values as JSON, for scripts that read them there
# How `spotring sweep` applies the restart policy (docs/exit-codes.md).
POLICY = Launcher(
    "spotring sweep", {MAX_PREEMPTIONS: "sweep.max_retries", MAX_RESTARTS: "sweep.max_retries"},
    sees_steps=True,
    reason="one budget, `sweep.max_retries`, for every retry: a trial is one of many, and "
           "each gets the same small allowance whatever stopped it; a trial that the sweep "
           "itself stopped (Ctrl-C, a signal, its pruner) spends none of it.")


@dataclass
class Running:
    trial: optuna.trial.Trial
    slot: Slot
    attempt: Attempt
    log: IO[bytes]
    started: float = field(default_factory=time.monotonic)
    started_at: float = field(default_factory=time.time)  # for the records of this attempt
    reported: set[int] = field(default_factory=set)  # steps already told to the pruner
    pruned: str = ""  # why, once the pruner stopped it

    @property
    def number(self) -> int:
        return self.trial.number


class Runner:
    def __init__(self, plan: Plan, study: Study, slots: list[Slot], sweep_dir: Path) -> None:
        self.plan, self.study, self.sweep_dir = plan, study, sweep_dir
        self.free: deque[Slot] = deque(slots)
        self.running: dict[int, Running] = {}
        uri = plan.checkpoint_uri
        self.checkpoint_uri = uri.rstrip("/") if uri else None
        # Trials a stopped sweep left running: they resume before any new one starts.
        self.resume: deque[int] = deque(
            t.number for t in study.study.get_trials(deepcopy=False)
            if t.state in (TrialState.RUNNING, TrialState.WAITING))

    # ----------------------------------------------------------------------- the loop

    def run(self) -> None:
        if self.resume:
            log.info("sweep: %d trials were running when the sweep stopped; they resume from "
                     "their checkpoints", len(self.resume))
        try:
            while True:
                while self.free and (trial := self._next()) is not None:
                    self._start(trial, self.free.popleft())
                if not self.running:
                    break
                time.sleep(POLL_S)
                for running in list(self.running.values()):
                    self._poll(running)
        except BaseException:
            self._stop_all()  # each trial checkpoints and stays `running` in the study
            raise

    def _next(self) -> optuna.trial.Trial | None:
        study = self.study.study
        if self.resume:
            frozen = study.trials[self.resume.popleft()]
            # Optuna has no public handle on a trial an earlier process asked for.
            trial = optuna.trial.Trial(study, frozen._trial_id)
            # A sweep killed inside study.ask leaves a trial without some of its values:
            # they are sampled now; a value it has is kept (Trial._suggest returns it).
            for p in self.plan.params:
                trial._suggest(p.key, p.distribution)
            return trial
        if len(study.trials) >= self.plan.trials:
            return None
        return study.ask({p.key: p.distribution for p in self.plan.params})

    def _params(self, sampled: dict[str, Any]) -> dict[str, str]:
        """KEY -> the value a trial's command line gets, for Optuna's sampled values."""
        return {p.key: p.text(sampled[p.key]) for p in self.plan.params}

    def trial_dir(self, number: int) -> Path:
        return self.sweep_dir / "trials" / f"{number:03d}"

    def _work(self, trial: optuna.trial.Trial, slot: Slot, restart: int) -> Work:
        """The trial's attempt number ``restart`` (0 the first) on ``slot``."""
        name, number = self.plan.cfg.sweep.name, trial.number
        # Each trial resumable anywhere, from its own prefix.
        uri = (f"{self.checkpoint_uri}/sweeps/{name}/trials/{number:03d}"
               if self.checkpoint_uri else None)
        env = contract.environment(f"{name}/{number:03d}", slot.run_dir(self.trial_dir(number)),
                                   restart, uri)
        env[PARAMS] = json.dumps({p.key: p.value(trial.params[p.key])
                                  for p in self.plan.params})
        return Work(self.plan.command_for(self._params(trial.params)), env)

    def _start(self, trial: optuna.trial.Trial, slot: Slot) -> None:
        trial_dir = self.trial_dir(trial.number)
        trial_dir.mkdir(parents=True, exist_ok=True)
        frozen = self.study.study.trials[trial.number]
        out = open(trial_dir / TRIAL_LOG, "ab")  # noqa: SIM115 - closed in _finish
        _hold(out, trial.number, trial_dir / TRIAL_LOG)
        params = " ".join(f"{k}={v}" for k, v in self._params(trial.params).items())
        if (trial_dir / "summary.json").exists():
            attempt = Attempt([], group=False)  # it ended as the sweep stopped: tell only
        else:
            for note in NOTES:  # from an attempt before this one
                (trial_dir / note).unlink(missing_ok=True)
            # Counted in the study before it starts: a sweep killed during the attempt
            # (a lost machine) leaves the count right for the one that continues it.
            # trial.log numbers the attempt by that count, so a gap there is an attempt
            # counted whose sweep was killed before it began.
            starts = frozen.user_attrs.get("starts", 0)
            # Here, not where the trial was asked for: a sweep killed between the two
            # leaves a trial its successor resumes, which gets them then.
            trial.set_user_attr("params", self._params(trial.params))
            trial.set_user_attr("starts", starts + 1)
            self.study.save()
            _stamp(out, f"{starts + 1} starts on {slot.label}")
            attempt = slot.start(trial_dir, self._work(trial, slot, starts), out)
        self.running[trial.number] = Running(trial, slot, attempt, out,
                                             reported=set(frozen.intermediate_values))
        retry = frozen.user_attrs.get("retries", 0)
        log.info("sweep: trial %d %s on %s: %s%s", trial.number,
                 "resumes" if _has_checkpoint(trial_dir) else "starts",
                 slot.label,
                 params,
                 f" (retry {retry} of {self.plan.cfg.sweep.max_retries})" if retry else "")

    def _poll(self, running: Running) -> None:
        if self.plan.cfg.sweep.pruner != "none" and not running.pruned:
            self._report_evaluations(running)
        code = running.attempt.poll()
        if code is not None:
            self._finish(running, code)

    def _report_evaluations(self, running: Running) -> None:
        text = running.slot.read(self.trial_dir(running.number), "metrics.jsonl") or ""
        metric = next(iter(self.plan.objectives))
        for line in text.splitlines():
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                continue  # the line being written
            if record.get("kind") != "test" or record["step"] in running.reported:
                continue
            running.reported.add(record["step"])
            value = record.get(record_field(metric))
            if not isinstance(value, int | float):
                continue  # a script's test record without this metric: nothing to judge
            running.trial.report(value, record["step"])
            if running.trial.should_prune():
                running.pruned = f"pruned at step {record['step']} ({metric} {value:.4g})"
                running.attempt.stop()
                return

    def _finish(self, running: Running, code: int) -> None:
        number, trial_dir = running.number, self.trial_dir(running.number)
        running.slot.collect(trial_dir)
        if running.attempt.procs:
            _stamp(running.log, f"ended: exit {code}")
        running.log.close()
        self.running.pop(number, None)
        self.free.append(running.slot)
        frozen = self.study.study.trials[number]
        attrs = frozen.user_attrs
        wall = attrs.get("wall_seconds", 0.0) + time.monotonic() - running.started
        running.trial.set_user_attr("wall_seconds", wall)
        if running.slot.hourly_price is not None:
            running.trial.set_user_attr("dollars", running.slot.hourly_price * wall / 3600)
        summary = _read_json(trial_dir / "summary.json") if code == EXIT_OK else None
        if running.pruned:
            self._tell(running, running.pruned, state=TrialState.PRUNED)
        elif summary is not None:
            metrics = summary | {"dollars": running.trial.user_attrs.get("dollars")}
            missing = [m for m in self.plan.objectives
                       if not isinstance(metrics.get(m), int | float)]
            if missing:
                self._tell(running, f"summary.json has no number for {', '.join(missing)} "
                                    f"(it has {', '.join(summary)})", state=TrialState.FAIL)
                return
            values = [float(metrics[m]) for m in self.plan.objectives]
            shown = ", ".join(f"{m} {v:.4g}" for m, v in zip(self.plan.objectives, values,
                                                              strict=True))
            self._tell(running, f"complete: {shown}", values=values)
        else:
            self._after(running, code, attrs)

    def _after(self, running: Running, code: int, attrs: dict[str, Any]) -> None:
        """An attempt that ended without a result: retried, or failed, by the policy."""
        number, trial_dir = running.number, self.trial_dir(running.number)
        code = with_note(code, next((n for n in NOTES if (trial_dir / n).exists()), None))
        ended = [code, step_reached(trial_dir, running.started_at)]
        running.trial.set_user_attr("ended", ended)
        answer = POLICY.verdict(code, repeated=attrs.get("ended") == ended)
        retries, most = attrs.get("retries", 0), self.plan.cfg.sweep.max_retries
        diverged = _read_json(trial_dir / DIVERGED)
        if classify(code) is Outcome.DIVERGED and diverged is not None:
            self._tell(running, f"diverged at step {diverged['step']} (loss "
                                f"{diverged['loss']})", state=TrialState.FAIL)
        elif answer.budget is None:
            why = "no summary.json" if classify(code) is Outcome.DONE else answer.why
            self._tell(running, f"exit {code} at step {ended[1]}: {why} (see "
                                f"{trial_dir / TRIAL_LOG})", state=TrialState.FAIL)
        elif retries < most:
            # Said before it is recorded: whoever sees the retry in the study (a test, a
            # second look at a sweep killed meanwhile) finds the line in the log too.
            log.info("sweep: trial %d stopped (exit %d, %s); it resumes from its checkpoint "
                     "(retry %d of %d)", number, code, answer.why, retries + 1, most)
            running.trial.set_user_attr("note", f"exit {code}; resumed from its checkpoint")
            running.trial.set_user_attr("retries", retries + 1)
            self.resume.appendleft(number)
        else:
            self._tell(running, f"exit {code} after {retries} retries (see "
                                f"{trial_dir / TRIAL_LOG})", state=TrialState.FAIL)

    def _tell(self, running: Running, note: str, values: list[float] | None = None,
              state: TrialState | None = None) -> None:
        running.trial.set_user_attr("note", "" if values is not None else note)
        self.study.study.tell(running.number, values, state=state)
        self.study.save()
        trials = self.study.study.get_trials(deepcopy=False)
        done = sum(t.state.is_finished() for t in trials)
        log.info("sweep: trial %d %s [%d of %d trials done, %d running]", running.number, note,
                 done, self.plan.trials, len(self.running))

    def _stop_all(self) -> None:
        for running in list(self.running.values()):
            running.attempt.stop()
            running.slot.collect(self.trial_dir(running.number))
            running.log.close()
        self.running.clear()

    # ---------------------------------------------------------------------- the report

    def write_report(self, command: str) -> Path:
        study = self.study.study
        trials = study.get_trials(deepcopy=False)
        rows = [report.TrialRow(
            number=t.number, state=STATES[t.state], params=self._params(t.params),
            summary=_read_json(self.trial_dir(t.number) / "summary.json")
            if t.state == TrialState.COMPLETE else None,
            values=t.values, restarts=max(t.user_attrs.get("starts", 0) - 1, 0),
            wall_seconds=t.user_attrs.get("wall_seconds", 0.0),
            dollars=t.user_attrs.get("dollars"), note=t.user_attrs.get("note", ""),
            run_dir=str(self.trial_dir(t.number).relative_to(self.sweep_dir)))
            for t in trials]
        best = [t.number for t in study.best_trials] if any(
            t.state == TrialState.COMPLETE for t in trials) else []
        # The best trial's command: what trains it again.
        best_command = self.plan.command_for(self._params(trials[best[0]].params)) \
            if best else None
        return report.write(self.sweep_dir, self.plan.cfg.sweep.name, self.plan.objectives,
                            rows, best, command, best_command)


def _stamp(log: IO[bytes], event: str) -> None:
    """A line in trial.log, around what the trial's processes print: when each attempt
    started and ended (local time, to the millisecond)."""
    now = datetime.datetime.now().isoformat(sep=" ", timespec="milliseconds")
    log.write(f"spotring sweep: {now} attempt {event}\n".encode())
    log.flush()


def _hold(out: IO[bytes], number: int, path: Path) -> None:
    """Lock ``out``, the trial's log at ``path``, for the attempt about to start: its
    processes write to it and so hold the lock until the last of them ends, even where
    the sweep ends first. First wait for those of an earlier attempt to end (within
    EARLIER_ATTEMPT_S, else ConfigError): started beside them, this one would share their
    run directory, and run again a trial that they finish."""
    def locked() -> bool | None:
        try:
            fcntl.flock(out.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            return None

    if locked():
        return
    log.info("sweep: trial %d: processes of an earlier attempt still run (they hold %s); "
             "waiting for them to end", number, path)
    try:
        poll(locked, timeout_s=EARLIER_ATTEMPT_S, interval_s=0.1,
             what=f"the earlier attempt of trial {number} to end")
    except TimeoutError:
        raise ConfigError(f"trial {number}: processes of an earlier attempt still run after "
                          f"{EARLIER_ATTEMPT_S:g} s (they hold {path}: `fuser -v {path}` "
                          "names them); stop them, then run the same command again") from None


def _has_checkpoint(trial_dir: Path) -> bool:
    """Whether the trial's run directory holds a checkpoint its next attempt resumes from
    (one here; a trial on a cluster keeps its own on its node or in S3)."""
    folder = layout.directory_of(trial_dir)
    return folder.is_dir() and bool(layout.manifests(p.name for p in folder.iterdir()))


def _read_json(path: Path) -> dict[str, Any] | None:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return None

