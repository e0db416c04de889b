"""Sweeps: many trials at once, searched by Optuna (`spotring sweep`; __main__.py is the
runbook, docs/sweeps.md the guide). A client of launch/ (each trial a job started with
its commands) and of spotring.support.plotting (the report's plots); neither imports it
(docs/design.md, "Packages"). Each concern a module of its own:

    config.py   the schema (conf/sweeper.yaml, conf/sweep/), the search space in Hydra's
                grammar as Optuna distributions, every check before a trial starts
    study.py    the Optuna study: journal storage, sampler, pruner, its copy in S3
    slots.py    the slices of GPUs, cores or cluster nodes, and starting a trial on one
    runner.py   the loop: trials to free slots, evaluations to the pruner, ends to the
                study, killed trials resumed
    report.py   sweep_report.md and its plots
"""

from spotring.cli import Command

# What this package adds to the `spotring` command (spotring/cli.py).
COMMANDS = {
    "sweep": Command("spotring.sweep.__main__:main",
                     "many trials at once, searched by Optuna: hyperparameters, model "
                     "families"),
}
