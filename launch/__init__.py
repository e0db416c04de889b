"""The cluster side of spotring: start nodes, write hostfiles, run the trainer across
them, tear them down. `spotring launch|up|run|status|down|cost` (__main__.py, whose
docstring is the runbook) composes the steps, each a module of its own:

    up.py          nodes, known_hosts, hostfiles        config.py     schemas, offline checks
    run.py         code over, the job, results back    rundir.py     runs/launch/<run id>/
    down.py        delete everything of a run          provider.py   Node and the Provider
    cost.py        prices, node-hours, $/epoch                       interface: aws/, local/
    plan.py        --dry-run                           ssh.py, sync.py, hostfile.py,
                                                       job_command.py: what the steps use

commands.py builds the local launcher commands that the Makefile, tests and benchmarks
use (and the environment every launcher gets).
"""
