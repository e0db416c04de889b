"""The cluster side of spotring: start nodes, write hostfiles, run a job's command (the
built-in trainer's, `spotring train ...`, or a user's own) across them, tear them down.
`spotring launch|up|run|status|down|cost` (__main__.py, whose docstring is the runbook)
composes the steps, each a module of its own:

    up.py          nodes, known_hosts, hostfiles        config.py     schemas, offline checks
    run.py         project over, the job, results back rundir.py     runs/launch/<run id>/
    down.py        delete everything of a run          provider.py   Node and the Provider
    cost.py        prices, node-hours, $/epoch                       interface: aws/, local/
    plan.py        --dry-run                           clusters.py   the provider a config
    recover.py     lost nodes replaced, the job again                names
    slurm.py       `spotring sbatch`                   ssh.py, sync.py, hostfile.py,
                                                       job_command.py, contract.py,
                                                       project.py, wheel.py, node_env.py,
                                                       notice.py, tries.py, ledger.py:
                                                       what the steps use

commands.py builds the local launcher commands that the Makefile, tests, benchmarks and
sweeps use (and the environment every launcher gets). The top-level package sweep/ (many
trials at once, `spotring sweep`) is a client of this one; nothing here imports it.
"""

from spotring.cli import Command

# The subcommands and their one line each, for `spotring --help` and `spotring launch
# --help` alike; here, where reading them imports nothing.
STEPS = {
    "launch": "up + run + down: start the nodes, run the job across them, take them down",
    "up": "start the nodes, scan their host keys, write the hostfiles",
    "run": "copy the project to a run's nodes, run the job across them, bring results back",
    "status": "a run's nodes and their state",
    "down": "delete everything of a run (--all-mine: of every run of yours)",
    "cost": "$/hour of N nodes now; a run's node-hours, cost and $/epoch",
}

# What this package adds to the `spotring` command (spotring/cli.py).
COMMANDS = {
    **{step: Command("spotring.launch.__main__:main", summary, prefix=(step,))
       for step, summary in STEPS.items()},
    "sbatch": Command("spotring.launch.slurm:main",
                      "a job's command (or the trainer's) as a SLURM batch job: requeued "
                      "after preemption"),
}
