"""spotring sweep: many trials at once, searched by Optuna; each trial a whole spotring
training job on its own slice of this machine or of a cluster (also `python -m spotring.sweep`).

    spotring sweep sweep=mnist_lr_wd sweep.parallel=2      the Bayesian LR + weight-decay
                                                           study, 2 trials at a time
    spotring sweep sweep=cifar10_family sweep.parallel=16  MathWorks' 16 CIFAR-10 networks,
                                                           one per GPU: accuracy and memory
    spotring sweep sweep.trials=8 -- 'optim.lr=tag(log, interval(0.01, 1))' train.epochs=2
                                  after `--`: the trainer's overrides; a search expression
                                  there joins sweep.params, a plain value is fixed
    spotring sweep sweep=custom sweep.trials=8 'sweep.params.lr=tag(log, interval(0.01, 1))' \
        sweep.objectives=[val_loss:min] -- python train.py --lr {lr} --epochs 3
                                  after `--`: your own command, run from this directory
                                  (the project); each trial fills {lr} with its value and
                                  also gets them all as JSON in $SPOTRING_PARAMS; its
                                  objectives are what it reports to summary.json
                                  (job.finish(val_loss=...)), NAME:min|max for a name
                                  spotring does not know
    spotring up cluster=local nodes=2 && spotring sweep sweep.cluster=latest sweep.parallel=2
                                  one trial per node of the newest `spotring up` run
    spotring sweep sweep.slurm=true sweep.parallel=8 sweep.nodes=2
                                  each trial a SLURM job of 2 nodes, 8 queued at a time
    spotring sweep checkpoint.uri=s3://bucket/prefix ...
                                  each trial checkpoints under URI/sweeps/NAME/trials/NNN
                                  and the study goes to URI/sweeps/NAME/: the sweep goes
                                  on from another machine (the key of every command)

The trainer's sweep is a command's like any other: its trials run `spotring train FIXED
KEY=VALUE...` (sweep/config.py). Run the same command again to continue a sweep that
stopped (Ctrl-C, a crash, a lost machine): finished trials are kept, interrupted ones
resume from their checkpoints. Everything goes to sweep.dir (runs/sweeps/NAME):
study.journal (Optuna's), trials/NNN/ (each trial's run directory, its
SPOTRING_RUN_DIR), sweep_report.md with its plots and the best trial's command, which
trains it again. Keys: sweep/config.py; what a trial's processes get: sweep/runner.py;
the guide: docs/sweeps.md.

Exit codes: 0 the study has its trials (failed ones included), 1 no trial completed or
an error, 2 bad input (nothing was started), 75 stopped by a signal (run it again).
A trial's own exits: docs/exit-codes.md.
"""

from __future__ import annotations

import argparse
import fcntl
import logging
import shlex
import sys
from pathlib import Path

from omegaconf import OmegaConf

from spotring.exits import EXIT_CONFIG, EXIT_FAILED, EXIT_OK, EXIT_PREEMPTED, ConfigError
from spotring.launch.console import interrupt_on_termination, log_to, split_dashes
from spotring.sweep import config

log = logging.getLogger("launch")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    ours, after_dashes = split_dashes(argv)
    parser = argparse.ArgumentParser(
        prog="spotring sweep", description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("overrides", nargs="*", metavar="KEY=VALUE",
                        help="overrides of conf/sweeper.yaml: sweep=STUDY, sweep.KEY=VALUE")
    try:
        args = parser.parse_args(ours)
    except SystemExit as e:
        return e.code if isinstance(e.code, int) else 0
    log_to(sys.stdout)
    command = shlex.join(["spotring", "sweep", *argv])
    try:
        return sweep(args.overrides, after_dashes, command)
    except ConfigError as e:
        print(f"spotring sweep: error: {e}", file=sys.stderr)
        return EXIT_CONFIG


def sweep(overrides: list[str], after_dashes: list[str], command: str) -> int:
    try:
        import optuna  # noqa: F401
    except ImportError as e:
        raise ConfigError(f"spotring sweep needs Optuna ({e}): pip install 'spotring[sweep]'"
                          ) from e
    from spotring.sweep.runner import Runner
    from spotring.sweep.study import Study

    plan = config.plan(overrides, after_dashes)
    cfg = plan.cfg.sweep
    slots = _slots(plan)
    sweep_dir = Path(cfg.dir).resolve()
    sweep_dir.mkdir(parents=True, exist_ok=True)
    with open(sweep_dir / ".lock", "w") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise ConfigError(f"another spotring sweep runs in {sweep_dir}; wait for it, or "
                              "give this one another sweep.dir") from None
        study = Study(plan, sweep_dir, plan.checkpoint_uri)
        OmegaConf.save(plan.cfg, sweep_dir / "sweep.yaml")
        log.info("sweep: %s in %s: %d trials, %s sampler, %s, %d at a time on %s",
                 cfg.name, sweep_dir, plan.trials, plan.sampler,
                 " and ".join(f"{d} {m}" for m, d in plan.objectives.items()), len(slots),
                 "; ".join(s.label for s in slots))
        runner = Runner(plan, study, slots, sweep_dir)
        interrupt_on_termination()
        code = EXIT_OK
        try:
            runner.run()
        except KeyboardInterrupt:
            log.info("sweep: stopped; the running trials wrote checkpoints. Run the same "
                     "command again to continue.")
            code = EXIT_PREEMPTED
        path = runner.write_report(command)
        log.info("sweep: report %s", path)
        if code == EXIT_OK and not any(t.state.name == "COMPLETE"
                                       for t in study.study.get_trials(deepcopy=False)):
            log.info("sweep: no trial completed")
            code = EXIT_FAILED
    return code


def _slots(plan: config.Plan) -> list:
    from spotring.sweep import slots

    cfg = plan.cfg.sweep
    if cfg.slurm:
        return slots.slurm_slots(cfg.parallel, cfg.nodes, cfg.workers, cfg.slurm_options,
                                 cfg.name, cfg.hourly_price)
    if cfg.cluster is None:
        return slots.local_slots(cfg.parallel, cfg.workers, cfg.hourly_price)
    return slots.cluster_slots(cfg.cluster, cfg.runs_dir, cfg.parallel, cfg.nodes,
                               cfg.launcher, plan.command_for(plan.first()), cfg.name,
                               cfg.hourly_price)


if __name__ == "__main__":
    sys.exit(main())
