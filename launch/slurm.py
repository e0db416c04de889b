"""spotring sbatch: a job's command (the built-in trainer's, or a user's own) as a SLURM
batch job that survives preemption.

    spotring sbatch nodes=2 gpus_per_node=8 partition=gpu time=12:00:00 -- dataset=cifar10
    spotring sbatch nodes=2 gpus_per_node=8 -- python train.py --epochs 3   a command
    spotring sbatch nodes=4 min_nodes=2 -- ...    may come back on 2 to 4 nodes after a
                                                  requeue, with the same global batch
    spotring sbatch nodes=2 --dry-run             print the script; submit nothing

After `--`, the job's command, or the trainer's overrides, which make it `spotring train
OVERRIDES` (launch/contract.py). It writes RUN_DIR/sbatch.sh (run_dir:
runs/slurm/JOB_NAME, which must be on storage every node shares, or give
checkpoint.uri=s3://..., gs://... or az://...) and submits it. The script asks SLURM for:

    --cpus-per-task, --mem  cpus_per_task CPUs and mem_per_task memory for every task
                            (--mem: per node, tasks x mem_per_task); srun is given
                            --cpus-per-task too, which it no longer takes from sbatch (22.05)
    --requeue               a job whose node failed (NODE_FAIL) goes back in the queue
    --signal=TERM@S         SIGTERM to every task S seconds before the time limit
                            (signal=USR1: SIGUSR1, which the trainer takes the same way)
    --open-mode=append      one log, RUN_DIR/slurm-JOBID.out, across requeues
    --nodes=MIN-MAX         with min_nodes; per node --mincpus=TASKS x CPUS rather than
                            --ntasks-per-node, which would start it on MIN nodes

and runs `srun CMD` in the submit directory, with the environment of the submission and
the bin directory of the Python that submits first on PATH (where `spotring` is): one
task per GPU (or tasks_per_node on CPUs), the process group formed from SLURM's
variables (spotring/runtime.py), with the contract's variables (spotring/contract.py):
SPOTRING_RUN_ID the job id (the same across requeues), SPOTRING_RUN_DIR,
SPOTRING_RESTART SLURM's restart count, SPOTRING_CHECKPOINT_URI. Open MPI's consent to
run as root is exported only where the job runs as root.

CMD is pinned at submission (spotring.cli.pin_command): the trainer's overrides get the
global batch on all the nodes asked for (train.global_batch), so that on fewer nodes after
a requeue the trainer takes the same samples in more micro-steps; a node range whose
counts the command refuses (spotring.cli.check_command) is refused at submission.

SIGTERM or SIGUSR1, from `scancel --signal=TERM JOBID`, a preempting partition or the time
limit, is a spot notice to the trainer (and to a script on spotring.init): a checkpoint at
once, exit 75, and the script requeues the job, which resumes from the checkpoint. Which
exits are requeued is the restart policy of spotring.exits as this script can apply it
(POLICY: one budget, max_restarts, and no step to tell a failure that repeats, so a
failure is never requeued; docs/exit-codes.md). A stop at the time limit (the job's end
was within signal_s + 60 s: SLURM signals up to a minute early) is not requeued unless
requeue_at_time_limit=true, so the job holds its nodes no longer than the user asked:
(1 + max_restarts) x time x nodes at most, which the script's header and the command say.
A run past max_restarts (SLURM's own requeues after NODE_FAIL count) does not start. A
signal for the batch shell (`--signal=B:...`, `scancel --full`) would end srun and the job
with it: the signal goes to the tasks, which is SLURM's default.

srun returns the highest exit status of its tasks (128+N for a task ended by signal N).
It runs with --kill-on-bad-exit=0: a rank that exits 75 first must not have srun SIGTERM
the others while they shut down (they would die of it, 143, and the job would not be
requeued); a lost rank makes the others exit 69 by themselves, within engine.timeout_s.

Bad input exits 2 before anything is submitted: no sbatch here, more tasks per node than
GPUs, a time or memory SLURM would not read, the command refusing its arguments (a bad
trainer override) or `python X.py` with no X.py in the submit directory, an option or
partition SLURM refuses (`sbatch --test-only` says which).
"""

from __future__ import annotations

import argparse
import logging
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig

from spotring import contract
from spotring.cli import pin_command
from spotring.exits import EXIT_CONFIG, EXIT_FAILED, EXIT_PREEMPTED, ConfigError
from spotring.launch import project
from spotring.launch.commands import AS_ROOT, BIN, LAUNCHER_ENV
from spotring.launch.console import split_dashes
from spotring.launch.contract import command_of, split_command
from spotring.options import one_of
from spotring.support.checkpoint import CheckpointNode, checkpoint_problems
from spotring.support.compose import compose_checked
from spotring.support.restarts import CODES, MAX_PREEMPTIONS, MAX_RESTARTS, Launcher

# The warnings the trainer takes as a spot notice; --signal sends one to every task.
SIGNALS = ("TERM", "USR1")
# How `spotring sbatch` applies the restart policy (docs/exit-codes.md).
POLICY = Launcher(
    "spotring sbatch", {MAX_PREEMPTIONS: "max_restarts", MAX_RESTARTS: "max_restarts"},
    sees_steps=False,
    reason="one budget, `max_restarts`, for every requeue: SLURM keeps one count of them "
           "(`SLURM_RESTART_COUNT`, its own requeues after a node failure included), and "
           "the bound on the node-time a job holds, (1 + max_restarts) x time x nodes, "
           "rests on it. Its batch script cannot see the step a try stopped at, so it "
           "cannot tell a failure that would repeat from one that would pass: it requeues "
           "the machines' stops only, never a failure that may be a bug (`sbatch "
           "RUN_DIR/sbatch.sh` runs it again by hand). A stop at the time limit is not "
           "requeued unless `requeue_at_time_limit=true`.")
# The exits the script requeues, srun's 128 + N for a task ended by signal N among them.
REQUEUE = [code for code in CODES if POLICY.verdict(code).budget is not None]
# SLURM may send the --signal warning up to this much earlier than signal_s before the
# end: a requeued exit within signal_s + this of the end is the time limit's.
SIGNAL_EARLY_S = 60
# The contract's values the script expands at run time: the job id, the same across
# requeues, and SLURM's count of them.
JOB_ID, RESTART_COUNT = "$SLURM_JOB_ID", "${SLURM_RESTART_COUNT:-0}"
TIMES = "MM, MM:SS, HH:MM:SS, D-HH, D-HH:MM, D-HH:MM:SS"
MEMORY = re.compile(r"(\d+)([KMGT]?)")

log = logging.getLogger("launch")


@dataclass
class SbatchConfig:
    nodes: int = 1
    min_nodes: int | None = None  # may restart on as few as this many nodes
    gpus_per_node: int = 0  # 0: CPU nodes
    tasks_per_node: int | None = None  # default: gpus_per_node, or 1 on CPUs
    # Each task's share of its node: the trainer (or script) and its data loader
    # processes (data.workers=2), and their memory. SLURM's default is one CPU a task.
    cpus_per_task: int = 4
    mem_per_task: str = "16G"  # as --mem takes it (K, M, G, T; M if none); 0: the whole node
    partition: str | None = None
    time: str | None = None  # the time limit, as sbatch takes it (HH:MM:SS, D-HH:MM)
    signal: str = "TERM"  # the warning to every task: TERM or USR1 (SIGNALS)
    signal_s: int = 120  # the warning this long before the time limit: a checkpoint in time
    job_name: str = "spotring"
    run_dir: str = "runs/slurm/${job_name}"  # on storage every node shares
    options: list[str] = field(default_factory=list)  # more sbatch options: [--account=x]
    # Requeues (after a preemption, a lost rank: docs/exit-codes.md) before the job gives
    # up. A node that fails outright (NODE_FAIL) is requeued by SLURM itself; they count too.
    max_restarts: int = 3
    # Requeue a stop at the time limit too (max_restarts times at most). Off: the job ends
    # there, as its user asked, and `sbatch RUN_DIR/sbatch.sh` resumes it.
    requeue_at_time_limit: bool = False
    # checkpoint.uri=s3://, gs://, az://...: $SPOTRING_CHECKPOINT_URI
    checkpoint: CheckpointNode = field(default_factory=CheckpointNode)


def register() -> None:
    ConfigStore.instance().store(name="sbatch_schema", node=SbatchConfig)


def compose(overrides: list[str]) -> DictConfig:
    register()
    return compose_checked("sbatch", overrides,
                           "The keys: spotring sbatch --help (launch/slurm.py).")


def script(cfg: DictConfig, command: list[str], workdir: Path) -> str:
    """The batch script, in full, that runs ``command`` (as ``check`` pinned it)."""
    tasks = _tasks(cfg)
    run_dir = Path(cfg.run_dir).resolve()
    if cfg.min_nodes:
        # A node range with --ntasks-per-node starts on min_nodes nodes (SLURM counts the
        # tasks at submission: min_nodes x tasks). Asked per node instead, it gets as many
        # nodes as are free; srun starts the tasks.
        nodes = [f"#SBATCH --nodes={cfg.min_nodes}-{cfg.nodes}",
                 f"#SBATCH --mincpus={tasks * cfg.cpus_per_task}"]
    else:
        nodes = [f"#SBATCH --nodes={cfg.nodes}", f"#SBATCH --ntasks-per-node={tasks}"]
    amount, unit = MEMORY.fullmatch(str(cfg.mem_per_task)).groups()
    lines = ["#!/bin/bash",
             f"# Written by `spotring sbatch`; submit it again: sbatch {run_dir}/sbatch.sh",
             f"# Holds {hold(cfg)}",
             f"#SBATCH --job-name={cfg.job_name}", *nodes,
             f"#SBATCH --cpus-per-task={cfg.cpus_per_task}",
             f"#SBATCH --mem={int(amount) * tasks}{unit}", "#SBATCH --requeue",
             # To the tasks, not to the batch shell (B:), whose srun in the foreground
             # would end with it, and the job with no checkpoint.
             f"#SBATCH --signal={cfg.signal}@{cfg.signal_s}", "#SBATCH --open-mode=append",
             f"#SBATCH --output={run_dir}/slurm-%j.out"]
    if cfg.gpus_per_node:
        lines.append(f"#SBATCH --gpus-per-node={cfg.gpus_per_node}")
    if cfg.partition:
        lines.append(f"#SBATCH --partition={cfg.partition}")
    if cfg.time:
        lines.append(f"#SBATCH --time={cfg.time}")
    lines += [f"#SBATCH {option}" for option in cfg.options]
    env = contract.environment(JOB_ID, str(run_dir), RESTART_COUNT, cfg.checkpoint.uri)
    lines += [
        "",
        f"cd {shlex.quote(str(workdir))}",
        *(f"export {k}={v}" for k, v in LAUNCHER_ENV.items() if k not in AS_ROOT),
        # Open MPI's consent to root only for a job that runs as root.
        f"if (( $(id -u) == 0 )); then export "
        f"{' '.join(f'{k}={v}' for k, v in AS_ROOT.items())}; fi",
        # The submitting Python's scripts first: `spotring`, and the `python` that has it.
        f'export PATH={shlex.quote(str(BIN))}:"$PATH" '
        + " ".join(f"{k}={_shell(v)}" for k, v in env.items()),
        f'echo "$(date "+%F %T") spotring sbatch: job $SLURM_JOB_ID (restart '
        f'${contract.RESTART}) on $SLURM_JOB_NUM_NODES nodes: $SLURM_JOB_NODELIST"',
        *_start_guard(cfg, run_dir),
        # srun takes --cpus-per-task from here, not from sbatch (SLURM 22.05 on).
        f"srun --ntasks-per-node={tasks} --cpus-per-task={cfg.cpus_per_task} "
        f"--kill-on-bad-exit=0 {shlex.join(command)}",
        "code=$?",
        'echo "$(date "+%F %T") spotring sbatch: srun exit $code"',
        *_requeue(cfg, run_dir),
        "exit $code",
        "",
    ]
    return "\n".join(lines)


def _shell(value: str) -> str:
    """``value`` as the script writes it: expanded there where it is one of SLURM's."""
    return f'"{value}"' if value in (JOB_ID, RESTART_COUNT) else shlex.quote(value)


def _start_guard(cfg: DictConfig, run_dir: Path) -> list[str]:
    """A run past max_restarts does not start (SLURM requeues after NODE_FAIL whatever
    the count), so hold() is a bound; and, unless requeue_at_time_limit, the end of this
    run's time limit (NONE without one), read before a preemption moves it (to GraceTime
    from then)."""
    guard = [f"if (( {RESTART_COUNT} > {cfg.max_restarts} )); then",
             f'    echo "$(date "+%F %T") spotring sbatch: not run: restart '
             f'{RESTART_COUNT} is past max_restarts={cfg.max_restarts}; '
             f'sbatch {run_dir}/sbatch.sh resumes it"',
             f"    exit {EXIT_PREEMPTED}",
             "fi"]
    if not cfg.requeue_at_time_limit:
        guard.append('end=$(squeue --noheader --jobs="$SLURM_JOB_ID" --format=%e)')
    return guard


def _requeue(cfg: DictConfig, run_dir: Path) -> list[str]:
    """The lines that requeue the job after an exit the policy runs again (REQUEUE), and
    say why where they do not."""
    resume = f"sbatch {run_dir}/sbatch.sh resumes it"
    lines = ["# Requeued (docs/exit-codes.md): "
             + "; ".join(f"{c} {CODES[c].outcome.what}" for c in REQUEUE),
             f"requeue=$(( {' || '.join(f'code == {c}' for c in REQUEUE)} ))",
             f"if (( requeue && {RESTART_COUNT} >= {cfg.max_restarts} )); then",
             f'    echo "$(date "+%F %T") spotring sbatch: not requeued: max_restarts='
             f'{cfg.max_restarts} used up; {resume}"']
    if not cfg.requeue_at_time_limit:
        window = cfg.signal_s + SIGNAL_EARLY_S
        lines += [f'elif (( requeue )) && [[ $end == *T* ]] && '
                  f'(( $(date +%s) >= $(date -d "$end" +%s) - {window} )); then',
                  f'    echo "$(date "+%F %T") spotring sbatch: stopped at the time limit: '
                  f'not requeued (requeue_at_time_limit=false); {resume}"']
    return [*lines,
            "elif (( requeue )); then",
            '    echo "$(date "+%F %T") spotring sbatch: requeueing job $SLURM_JOB_ID to '
            'resume from its last checkpoint"',
            "    scontrol requeue $SLURM_JOB_ID",
            "fi"]


def hold(cfg: DictConfig) -> str:
    """The most node-time the job can hold, in words: (1 + max_restarts) runs, each up to
    the time limit, on up to ``nodes`` nodes."""
    runs = f"{1 + cfg.max_restarts} runs (1 + max_restarts={cfg.max_restarts})"
    if cfg.time is None:
        most = f"{runs} x the partition's time limit x {cfg.nodes} nodes"
    else:
        hours = (1 + cfg.max_restarts) * seconds(cfg.time) * cfg.nodes / 3600
        most = f"{runs} x time={cfg.time} x {cfg.nodes} nodes = {hours:.4g} node-hours"
    requeued = "requeued" if cfg.requeue_at_time_limit else "not requeued"
    return (f"at most {most}; a stop at the time limit is {requeued} "
            f"(requeue_at_time_limit={str(cfg.requeue_at_time_limit).lower()})")


def seconds(time: str) -> int | None:
    """A time limit as sbatch --time reads it (TIMES), in seconds; None if it is none."""
    days, dash, clock = str(time).rpartition("-")
    parts = clock.split(":")
    if len(parts) > 3 or not all(p.isdigit() for p in parts) or (dash and not days.isdigit()):
        return None
    numbers = [int(p) for p in parts]
    # After days the first number is hours (D-HH[:MM[:SS]]); without, minutes unless
    # there are three (MM, MM:SS, HH:MM:SS).
    if dash or len(numbers) == 3:
        hours, minutes, secs = numbers + [0] * (3 - len(numbers))
    else:
        hours, minutes, secs = [0, *numbers] + [0] * (2 - len(numbers))
    return ((int(days or 0) * 24 + hours) * 60 + minutes) * 60 + secs


def check(cfg: DictConfig, command: list[str], workdir: Path) -> list[str]:
    """Everything that can be told before submitting; raises ConfigError. Returns the
    command pinned on all the nodes asked for (spotring.cli.pin_command), which every
    run of the job runs, on however many nodes it gets."""
    problems = []
    for key in ("nodes", "signal_s", "cpus_per_task"):
        if cfg[key] < 1:
            problems.append(f"{key}={cfg[key]}: must be 1 or more")
    if (problem := one_of("signal", cfg.signal, SIGNALS)) is not None:
        problems.append(problem)
    if cfg.max_restarts < 0:
        problems.append(f"max_restarts={cfg.max_restarts}: must be 0 or more")
    problems += checkpoint_problems(cfg)
    if cfg.min_nodes is not None and not 1 <= cfg.min_nodes <= cfg.nodes:
        problems.append(f"min_nodes={cfg.min_nodes}: must be 1 to nodes={cfg.nodes}")
    if cfg.gpus_per_node < 0:
        problems.append(f"gpus_per_node={cfg.gpus_per_node}: must be 0 (CPUs) or more")
    if cfg.tasks_per_node is not None and cfg.gpus_per_node and \
            cfg.tasks_per_node > cfg.gpus_per_node:
        problems.append(f"tasks_per_node={cfg.tasks_per_node} with gpus_per_node="
                        f"{cfg.gpus_per_node}: one task per GPU at most (NCCL takes one "
                        f"GPU per rank); valid: 1 to {cfg.gpus_per_node}")
    if not MEMORY.fullmatch(str(cfg.mem_per_task)):
        problems.append(f"mem_per_task={cfg.mem_per_task}: valid: a number of megabytes, or "
                        "one with K, M, G or T (16G); 0: the whole node")
    if cfg.time is not None and seconds(cfg.time) is None:
        problems.append(f"time={cfg.time}: valid: {TIMES} (leave it out for the "
                        "partition's default)")
    if problems:
        raise ConfigError("bad sbatch settings:\n  - " + "\n  - ".join(problems))
    tasks = _tasks(cfg)
    # Every node count the job may come back on; the first start's (all of them) first.
    counts = range(cfg.nodes, (cfg.min_nodes or cfg.nodes) - 1, -1)
    project.check_command(workdir, command, [nodes * tasks for nodes in counts])
    return pin_command(command, cfg.nodes * tasks)


def _tasks(cfg: DictConfig) -> int:
    """Tasks (ranks) per node."""
    return cfg.tasks_per_node or cfg.gpus_per_node or 1


def submit(text: str, run_dir: Path, dry_run: bool) -> int:
    """sbatch --test-only first (SLURM's verdict on the options, nothing queued), then the
    script into run_dir and sbatch. Returns the job id (0 for a dry run)."""
    if dry_run:
        print(text, end="")
        return 0
    if shutil.which("sbatch") is None:
        raise ConfigError("sbatch is not on the PATH: run spotring sbatch on a SLURM login "
                          "node (or install SLURM's client, e.g. apt-get install "
                          "slurm-client, with a slurm.conf that names your cluster)")
    with tempfile.NamedTemporaryFile("w", suffix=".sh") as tmp:
        tmp.write(text)
        tmp.flush()
        test = subprocess.run(["sbatch", "--test-only", tmp.name], capture_output=True,
                              text=True, timeout=60)
    if test.returncode != 0:
        raise ConfigError(f"SLURM refuses the job: {test.stderr.strip() or test.stdout}")
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / "sbatch.sh"
    path.write_text(text)
    proc = subprocess.run(["sbatch", "--parsable", str(path)], capture_output=True, text=True,
                          timeout=60)
    if proc.returncode != 0:
        raise RuntimeError(f"sbatch {path}: {proc.stderr.strip()}")
    return int(proc.stdout.strip().split(";")[0])


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    ours, words = split_dashes(argv)
    parser = argparse.ArgumentParser(prog="spotring sbatch", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dry-run", action="store_true",
                        help="print the script; submit nothing")
    parser.add_argument("overrides", nargs="*", metavar="KEY=VALUE",
                        help="nodes=, min_nodes=, gpus_per_node=, tasks_per_node=, "
                             "cpus_per_task=, mem_per_task=, partition=, time=, "
                             "signal=TERM|USR1, signal_s=, job_name=, run_dir=, options=[...], "
                             "max_restarts=, requeue_at_time_limit=, checkpoint.uri=")
    try:
        args = parser.parse_args(ours)
    except SystemExit as e:
        return e.code if isinstance(e.code, int) else 0
    try:
        cfg = compose(args.overrides)
        command = check(cfg, command_of(*split_command(words)), Path.cwd())
        text = script(cfg, command, Path.cwd())
        job = submit(text, Path(cfg.run_dir).resolve(), args.dry_run)
    except ConfigError as e:
        print(f"spotring sbatch: error: {e}", file=sys.stderr)
        return EXIT_CONFIG
    except (RuntimeError, subprocess.TimeoutExpired) as e:
        print(f"spotring sbatch: failed: {e}", file=sys.stderr)
        return EXIT_FAILED
    if not job:
        print(f"spotring sbatch: nothing submitted (--dry-run); the job would hold "
              f"{hold(cfg)}", file=sys.stderr)
        return 0
    run_dir = Path(cfg.run_dir).resolve()
    print(f"spotring sbatch: submitted job {job} ({cfg.nodes} nodes); it holds {hold(cfg)}; "
          f"follow it with `squeue -j {job}` and `tail -f {run_dir}/slurm-{job}.out`; stop "
          f"it with `scancel {job}` (or `scancel --signal=TERM {job}`: a checkpoint, a "
          f"requeue)")
    return 0
