"""spotring launch|up|run|status|down|cost: start spot GPU nodes, run your command or
the built-in trainer across them, tear them down (also `python -m spotring.launch ...`).

    spotring launch nodes=8 -- python train.py --epochs 30
                                                 up + run + down of your own command, from
                                                 the directory that holds it
    spotring launch nodes=8 -- train.epochs=30   the same with the built-in trainer (make
                                                 launch NODES=8);
                                                 lost spot nodes are replaced and the job
                                                 resumes (cluster.max_preemptions,
                                                 cluster.max_restarts); ledger.json
    spotring up nodes=8                          the nodes; the first line names the run
                                                 dir, where hosts and hosts.mpich are written
    spotring run -- dataset=cifar10              the code to the nodes, the job, results back
    spotring status                              the newest run's nodes (or run_id=ID)
    spotring down                                the newest run (or run_id=ID); --all-mine:
                                                 everything of yours, from any run
    spotring cost                                $/hour now; the newest run's node-hours,
                                                 $/epoch, its ledger
    spotring up nodes=8 --dry-run                the whole plan; no cloud API is called

Before `--`: overrides of conf/launch.yaml, e.g. nodes=8 cluster=local,
cluster.instance_types=[g5.12xlarge,g6.12xlarge], cluster.zones=[us-east-1a],
cluster.ssh_cidr=203.0.113.7/32, cluster.on_demand_fallback=true, job.launcher=torchrun
(`spotring up --help` lists the keys). After it: the job's command, started on every
node's slots by job.launcher (once per node with job.launcher=none); words that start
with KEY=VALUE are the trainer's overrides, and the command is then `spotring train
OVERRIDES` (launch/contract.py). The directory the launcher runs in goes to every node
(the files git lists, or all; up to job.max_project_mb), with spotring at this version
and requirements.txt or pyproject.toml's dependencies installed there; all of it, and
the command's arguments, are checked before anything is created. `run`, `status`, `down`
and `cost` take the cluster and node count from the run's launch.yaml (`cost` prices
other nodes=, cluster.instance_types=, zones= or region= when given). docs/launching.md
is the guide.

`launch` takes everything down at the end, on an error and on Ctrl-C; `up` does on an
error or Ctrl-C before it is done. Each deletion is tried even when others fail; what
is still there then is named, with `spotring down run_id=ID` to try again. Exit codes:
0 done; 1 failed (no capacity, an AWS or ssh error, or something could not be deleted);
2 bad input (nothing was created); 130 interrupted; `run` and `launch` pass the job's
own on (docs/exit-codes.md).
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import textwrap
from pathlib import Path

from botocore.exceptions import BotoCoreError, ClientError
from botocore.parsers import ResponseParserError

from spotring.exits import EXIT_CONFIG, EXIT_FAILED, ConfigError
from spotring.launch import STEPS, config, in_place, ledger, project
from spotring.launch.clusters import provider_for
from spotring.launch.console import interrupt_on_termination, log_to, split_dashes
from spotring.launch.cost import after_run, hourly
from spotring.launch.down import down, down_after, leftovers
from spotring.launch.plan import plan
from spotring.launch.provider import NoCapacity
from spotring.launch.recover import supervise
from spotring.launch.run import run as run_job
from spotring.launch.rundir import RunDir
from spotring.launch.up import up

PRICED_ANEW = ("nodes", "cluster.instance_types", "cluster.zones", "cluster.region")
log = logging.getLogger("launch")

# The overrides each subcommand reads (its one line: launch.STEPS).
COMMANDS = {
    "launch": ["nodes", "cluster", "cluster.*", "job.*", "checkpoint.uri", "run_id", "runs_dir",
               "project", "--"],
    "up": ["nodes", "cluster", "cluster.*", "job.*", "checkpoint.uri", "run_id", "runs_dir",
           "project", "--"],
    "run": ["run_id", "runs_dir", "job.*", "checkpoint.uri", "--"],
    "status": ["run_id", "runs_dir"],
    "down": ["run_id", "runs_dir", "cluster", "cluster.region", "project"],
    "cost": ["nodes", "cluster", "cluster.instance_types", "cluster.zones", "cluster.region",
             "run_id", "runs_dir"],
}
OVERRIDES = {
    "nodes": ("nodes=N", "how many nodes (default 1)"),
    "cluster": ("cluster=aws_spot|local", "EC2 spot instances (default) or this machine"),
    "cluster.region": ("cluster.region=REGION", "the AWS region (default us-east-1)"),
    "cluster.zones": ("cluster.zones=[ZONE,...]", "zones to price (default: every zone)"),
    "cluster.instance_types": ("cluster.instance_types=[TYPE,...]", "types to price"),
    "job.*": ("job.launcher=LAUNCHER", "horovodrun (default), mpirun, torchrun, none\n"
              "  or in_place (the job trains on through lost nodes)\n"
              "job.results=DIR: where your command's rank 0 writes\n"
              "  (default runs/<run id>: $SPOTRING_RUN_DIR)\n"
              "job.max_project_mb=200: the project's size limit"),
    "checkpoint.uri": ("checkpoint.uri=URI", "s3://, gs:// or az://bucket/prefix where the\n"
                       "job's checkpoints also go: $SPOTRING_CHECKPOINT_URI"),
    "run_id": ("run_id=ID", "the run (default: up and launch a new one, the others "
                            "the newest)"),
    "runs_dir": ("runs_dir=DIR", "where run directories are (default runs/launch)"),
    "project": ("project=NAME", "the `project` tag of every resource (default spotring)"),
    "--": ("-- COMMAND | OVERRIDES", "your command, e.g. -- python train.py --lr 0.1,\n"
                                     "or the trainer's overrides (spotring train --help),\n"
                                     "e.g. -- dataset=cifar10 train.epochs=30"),
}


def main(argv: list[str] | None = None, prog: str = "spotring") -> int:
    """Run one subcommand: ``argv`` is [subcommand, arguments...], ``prog`` what help and
    error messages call the program. Returns the exit code."""
    argv = sys.argv[1:] if argv is None else list(argv)
    ours, words = split_dashes(argv)
    try:
        args = _parse(prog, ours, words)
    except SystemExit as e:  # --help (0) or a usage error (2), printed by argparse
        return e.code if isinstance(e.code, int) else 0
    name = f"{prog} {args.command}"
    log_to(sys.stdout)
    interrupt_on_termination()  # a closed terminal or a `kill` tears down too
    try:
        return _command(args, words)
    except ConfigError as e:
        _last_lines(name, f"error: {e}", e)
        return EXIT_CONFIG
    except (NoCapacity, RuntimeError, TimeoutError, ClientError, BotoCoreError,
            ResponseParserError) as e:  # that one: an answer that is not AWS's, e.g. an HTML 500
        _last_lines(name, f"failed: {e}", e)
        return EXIT_FAILED
    except KeyboardInterrupt as e:
        _last_lines(name, "interrupted", e)
        return 128 + signal.SIGINT


def _last_lines(name: str, why: str, error: BaseException) -> None:
    """On stderr: why the command stopped, then what its clean-up could not delete."""
    print(f"{name}: {why}", file=sys.stderr)
    left = leftovers(error)
    if left:
        print(f"{name}: {left}", file=sys.stderr)


def _parse(prog: str, ours: list[str], words: list[str]) -> argparse.Namespace:
    """The subcommand and its options; argparse prints help and usage errors itself."""
    if not ours or ours[0] not in COMMANDS:
        top = argparse.ArgumentParser(
            prog=prog, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
            epilog="subcommands (each has --help):\n" + "\n".join(
                f"  {name:<8}{summary}" for name, summary in STEPS.items()))
        top.add_argument("command", choices=list(COMMANDS), help="the subcommand (below)")
        top.parse_args(ours[:1])  # --help, no subcommand or an unknown one: exits
    command, keys = ours[0], COMMANDS[ours[0]]
    parser = argparse.ArgumentParser(prog=f"{prog} {command}", description=STEPS[command],
                                     epilog=_overrides_help(keys),
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dry-run", action="store_true",
                        help="print the plan; create nothing, call no cloud API")
    if command == "down":
        parser.add_argument("--all-mine", action="store_true",
                            help="every resource of yours, from any run")
    parser.add_argument("overrides", nargs="*", metavar="KEY=VALUE",
                        help="overrides of conf/launch.yaml (below)")
    args = parser.parse_intermixed_args(ours[1:])
    if words and "--" not in keys:
        parser.error(f"takes nothing after -- (there: {' '.join(words)}); "
                     "`run`, `up` and `launch` do")
    args.command = command
    args.all_mine = getattr(args, "all_mine", False)
    return args


def _overrides_help(keys: list[str]) -> str:
    lines = ["overrides (Hydra syntax; conf/launch.yaml and conf/cluster/):"]
    for key in keys:
        if key != "cluster.*":
            left, right = OVERRIDES[key]
            lines.append(f"  {left:<25} " + right.replace("\n", "\n" + " " * 28))
            continue
        lines.append(f"  {'cluster.KEY=VALUE':<25} the cluster's settings; the keys of")
        for cluster, names in config.cluster_keys().items():
            lines.append(textwrap.fill(", ".join(names), width=88,
                                       initial_indent=f"    {cluster + ':':<10}",
                                       subsequent_indent=" " * 14))
    return "\n".join(lines)


def _command(args: argparse.Namespace, after_dashes: list[str]) -> int:
    cfg = config.compose(args.overrides)
    config.add_words(cfg, after_dashes)
    command, run = args.command, _run_dir(args.command, cfg, args.all_mine)
    if run.config.exists():
        # `cost nodes=8 cluster.instance_types=[...]` prices another cluster than the run's.
        keep = [k for k in PRICED_ANEW if any(o.startswith(f"{k}=") for o in args.overrides)]
        cfg = config.with_saved_cluster(cfg, run.config, keep if command == "cost" else [])
        if command == "run" and not after_dashes:  # the job `up` was given
            cfg.job.args, cfg.job.command = [], config.saved_command(run.config)
    config.validate(cfg)
    # From here on the job is its command, the trainer's (`spotring train ...`) or not.
    cfg.job.args, cfg.job.command = [], config.job_command(cfg.job)
    if args.command in ("up", "run", "launch"):  # what goes to the nodes
        project.check(Path.cwd(), list(cfg.job.command), cfg.job.max_project_mb)
    provider = provider_for(cfg, run)
    if args.dry_run:
        log.info("\n".join(plan(command, cfg, run, provider)))
        return 0

    if command in ("up", "launch"):
        log.info("spotring: run %s in %s", run.id, run.path)
    if command == "up":
        up(cfg, run, provider)
    elif command == "run":
        if cfg.job.launcher == "in_place":  # a lost node is not replaced, as `run` restarts none
            return in_place.run(cfg, run, provider)
        return run_job(cfg, run, provider)
    elif command == "status":
        nodes = provider.describe()
        log.info("status: run %s: %d nodes", run.id, len(nodes))
        for i, node in enumerate(nodes):
            log.info("status: node %d: %s", i, node.summary())
    elif command == "down":
        if run.config.exists() or args.all_mine:
            down(run, provider, args.all_mine)
            if run.config.exists():  # the termination times are in: the bill is final
                ledger.write(run)
        else:
            log.info("down: no runs in %s: nothing to take down", cfg.runs_dir)
    elif command == "cost":
        log.info("\n".join(hourly(provider, cfg.nodes)
                           + (after_run(run) if run.config.exists() else [])))
    elif command == "launch":
        try:
            up(cfg, run, provider)
            code = supervise(cfg, run, provider)
        except BaseException as e:
            _clean_up(run, provider, e)
            raise
        _clean_up(run, provider)
        return code
    return 0


def _clean_up(run: RunDir, provider, failure: BaseException | None = None) -> None:
    """launch's end, however it ends: everything of the run deleted, and its cost."""
    if not run.config.exists():  # up stopped at its checks: nothing was made
        return
    try:
        down_after(run, provider, failure)
    finally:
        log.info("\n".join(after_run(run)))


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
    sys.exit(main(prog="python -m spotring.launch"))
