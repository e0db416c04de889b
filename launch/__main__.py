"""python -m launch: start spot GPU nodes, run the trainer across them, tear them down.

    python -m launch launch nodes=8 -- train.epochs=30    up + run + down (make launch NODES=8);
                                                with cluster.max_restarts=K, lost spot
                                                nodes are replaced and the job resumes
    python -m launch up nodes=8                 the nodes; the first line names the run dir,
                                                where hosts and hosts.mpich are written
    python -m launch run -- dataset=cifar10     the code to the nodes, the job, results back
    python -m launch status                     the newest run's nodes (or run_id=ID)
    python -m launch down                       the newest run (or run_id=ID); --all-mine:
                                                everything of yours, from any run
    python -m launch cost                       $/hour now; the newest run's node-hours, $/epoch
    python -m launch up nodes=8 --dry-run       the whole plan; no cloud API is called

Before `--`: overrides of conf/launch.yaml, e.g. nodes=8 cluster=local,
cluster.instance_types=[g5.12xlarge,g6.12xlarge], cluster.zones=[us-east-1a],
cluster.ssh_cidr=203.0.113.7/32, cluster.on_demand_fallback=true, job.launcher=torchrun.
After it: the trainer's, as `python -m trainer` takes them, checked before anything is
created. `run`, `status`, `down` and `cost` take the cluster and node count from the
run's launch.yaml (`cost` prices other nodes=, cluster.instance_types=, zones= or
region= when given).

`launch` takes everything down at the end, on an error and on Ctrl-C; `up` does on an
error or Ctrl-C before it is done. Exit codes: 0 done; 1 failed (no capacity, an AWS or
ssh error; nothing is left behind); 2 bad input (nothing was created); `run` and
`launch` pass the trainer's on (69 a rank was lost, 75 preempted: trainer/exits.py).
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
from pathlib import Path

from botocore.exceptions import BotoCoreError, ClientError

from launch import config
from launch.cost import after_run, hourly
from launch.down import down
from launch.plan import plan
from launch.provider import NoCapacity, provider_for
from launch.recover import supervise
from launch.run import run as run_job
from launch.rundir import RunDir
from launch.up import up
from trainer.config import ConfigError
from trainer.exits import EXIT_CONFIG, EXIT_FAILED

COMMANDS = ("up", "run", "status", "down", "cost", "launch")
PRICED_ANEW = ("nodes", "cluster.instance_types", "cluster.zones", "cluster.region")
log = logging.getLogger("launch")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    ours, trainer_args = (argv[:argv.index("--")], argv[argv.index("--") + 1:]) \
        if "--" in argv else (argv, [])
    parser = argparse.ArgumentParser(prog="python -m launch", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("command", choices=COMMANDS)
    parser.add_argument("--dry-run", action="store_true", help="print the plan, call no API")
    parser.add_argument("--all-mine", action="store_true",
                        help="down: every resource of yours, from any run")
    parser.add_argument("overrides", nargs="*", help="Hydra overrides of conf/launch.yaml")
    args = parser.parse_intermixed_args(ours)
    _log_to(sys.stdout)
    # A closed terminal or a `kill` tears down like Ctrl-C does.
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, _interrupt)
    try:
        return _command(args, trainer_args)
    except ConfigError as e:
        print(f"spotring launch: error: {e}", file=sys.stderr)
        return EXIT_CONFIG
    except (NoCapacity, RuntimeError, TimeoutError, ClientError, BotoCoreError) as e:
        print(f"spotring launch: {args.command} failed: {e}", file=sys.stderr)
        return EXIT_FAILED
    except KeyboardInterrupt:
        print(f"spotring launch: {args.command} interrupted", file=sys.stderr)
        return 128 + signal.SIGINT


def _interrupt(signum, frame):
    raise KeyboardInterrupt


def _log_to(stream) -> None:
    """The launcher's lines, plain, on stdout; other libraries' (boto3) stay quiet."""
    handler = logging.StreamHandler(stream)
    handler.setFormatter(logging.Formatter("%(message)s"))
    log.handlers = [handler]
    log.setLevel(logging.INFO)
    log.propagate = False


def _command(args: argparse.Namespace, trainer_args: list[str]) -> int:
    cfg = config.compose(args.overrides)
    cfg.job.args = [*cfg.job.args, *trainer_args]
    command, run = args.command, _run_dir(args.command, cfg, args.all_mine)
    if run.config.exists():
        # `cost nodes=8 cluster.instance_types=[...]` prices another cluster than the run's.
        keep = [k for k in PRICED_ANEW if any(o.startswith(f"{k}=") for o in args.overrides)]
        cfg = config.with_saved_cluster(cfg, run.config, keep if command == "cost" else [])
    config.validate(cfg)
    provider = provider_for(cfg, run)
    if args.dry_run:
        log.info("\n".join(plan(command, cfg, run, provider)))
        return 0

    if command in ("up", "launch"):
        log.info("spotring: run %s in %s", run.id, run.path)
    if command == "up":
        up(cfg, run, provider)
    elif command == "run":
        return run_job(cfg, run, provider)
    elif command == "status":
        nodes = provider.describe()
        log.info("status: run %s: %d nodes", run.id, len(nodes))
        for i, node in enumerate(nodes):
            log.info("status: node %d: %s", i, node.summary())
    elif command == "down":
        if run.config.exists() or args.all_mine:
            down(run, provider, args.all_mine)
        else:
            log.info("down: no runs in %s: nothing to take down", cfg.runs_dir)
    elif command == "cost":
        log.info("\n".join(hourly(provider, cfg.nodes)
                           + (after_run(run) if run.config.exists() else [])))
    elif command == "launch":
        try:
            up(cfg, run, provider)
            return supervise(cfg, run, provider)
        finally:
            if run.config.exists():  # up got past its checks: something may exist
                # A second Ctrl-C (or kill) must not stop the teardown halfway.
                for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
                    signal.signal(sig, signal.SIG_IGN)
                down(run, provider)
                log.info("\n".join(after_run(run)))
    return 0


def _run_dir(command: str, cfg, all_mine: bool) -> RunDir:
    """up and launch: a new run (run_id= may name it); the others: the named run, or the
    newest. A run dir that does not exist stands for "no run" (down --all-mine, or down
    and cost before any run)."""
    if command in ("up", "launch"):
        runs = Path(cfg.runs_dir)
        run = RunDir(runs / cfg.run_id) if cfg.run_id else RunDir.planned(runs)
        if run.path.exists():
            raise ConfigError(f"run_id={cfg.run_id}: {run.path} exists; choose a new run id")
        return run
    if all_mine:
        return RunDir.planned(cfg.runs_dir)
    try:
        return RunDir.find(cfg.runs_dir, cfg.run_id)
    except ConfigError:
        if command in ("down", "cost") and cfg.run_id is None:
            return RunDir.planned(cfg.runs_dir)
        raise


if __name__ == "__main__":
    sys.exit(main())
