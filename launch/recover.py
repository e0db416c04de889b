"""`launch` on spot nodes: run the job, and when nodes are taken away, get nodes again
and resume, within two budgets counted apart.

    run the job (the trainer's resume=auto, or the command's own restore, picks up the
    newest checkpoint; a command that keeps none starts again from the beginning)
    exit 0                            done
    exit 75: preempted (a spot        a preemption, up to cluster.max_preemptions: wait
    notice or SIGTERM reached the     (up to cluster.notice_wait_s) for the noticed node
    trainer, which saved a            to leave `running`, replace the lost nodes (on EC2:
    checkpoint)                       the same type, else the next of
                                      cluster.instance_types, in the run's zone); if none
                                      can be had, go on with the survivors when they are
                                      at least cluster.min_nodes
    exit 69 (a rank was lost), any    a failure, up to cluster.max_restarts: the same,
    other crash, or a node not        without the wait. The same exit at the same step as
    running (or no longer reachable   the try before stops the run: a failure that repeats
    by ssh) without a notice          where it happened is the job's own (a bug), and
                                      another try would fail the same way
    exit 2 (bad input), 65 (diverged) the job's own verdict: stop

(spotring.exits.classify is the rule: which exit is which, and the budget each spends.)

Each try is recorded in state.json ("tries": when it ran, on which nodes, how it ended,
the step it reached and resumed from, the trainer's notice and checkpoint times), which
launch/ledger.py turns into the run's bill; the run's end says how much of each budget
it spent.

On fewer (or again more) workers the global batch stays what it was: train.accumulation
(and, where it must, train.batch_size) make up for the missing workers, so with the
world-size-invariant sample order the run continues the same sample sequence with the
same maths (docs/design.md, "Why N workers take the same steps as one"). Rank 0 keeps its
checkpoints on node 0; if node 0 itself is lost, only checkpoint.uri=s3://... keeps
them (the trainer resumes from S3 on the new node 0).
"""

from __future__ import annotations

import logging
import time

from omegaconf import DictConfig

from spotring.exits import EXIT_OK, MAX_PREEMPTIONS, MAX_RESTARTS, ConfigError, classify
from spotring.global_batch import split_global_batch
from spotring.launch import tries
from spotring.launch.provider import NoCapacity, Node, Provider
from spotring.launch.run import run as run_job
from spotring.launch.rundir import RunDir
from spotring.launch.ssh import RemoteError
from spotring.launch.up import admit
from spotring.polling import poll
from spotring.trainer import config as trainer_config

log = logging.getLogger("launch")

PREEMPTION, FAILURE = "preemption", "failure"  # the causes of a restart, each its budget
_BUDGET_KEYS = {PREEMPTION: MAX_PREEMPTIONS, FAILURE: MAX_RESTARTS}
_CAUSES = {key: cause for cause, key in _BUDGET_KEYS.items()}
# Trainer arguments the launcher sets itself on a restart.
_OWN_ARGS = ("resume=", "train.batch_size=", "train.accumulation=")


def supervise(cfg: DictConfig, run: RunDir, provider: Provider) -> int:
    """Run the job on the run's nodes until it ends; replace lost nodes between tries.
    Returns the last try's exit code; the last line logged says what each budget spent."""
    command = list(cfg.job.command)  # a command of the user's own keeps its global batch
    batch = None if command else _batch(cfg.job.args)
    workers = sum(n.slots for n in run.nodes())
    c = cfg.cluster
    in_s3 = cfg.job.checkpoint_uri if command else any(
        a.startswith("checkpoint.uri=") for a in cfg.job.args)
    if (c.max_restarts or c.max_preemptions) and not in_s3:
        log.info("recover: checkpoints stay on node 0; should node 0 itself be lost, the job "
                 "starts over. %s=s3://bucket/prefix keeps them in S3 instead",
                 "job.checkpoint_uri" if command else "checkpoint.uri")
    budgets = {PREEMPTION: c.max_preemptions, FAILURE: c.max_restarts}
    spent = dict.fromkeys(budgets, 0)
    try:
        while True:
            nodes = [n.id for n in run.nodes()]
            started = time.time()
            try:
                code, unreachable = run_job(cfg, run, provider), None
            except RemoteError as e:  # ssh to a node failed: lost, or a failure of its own
                code, unreachable = None, e
            outcome = tries.outcome(run, started, nodes, code)
            cause, lost = _cause(code), []
            stop = _why_stop(cause, code, spent, budgets)
            if stop is None and cause is not None:
                lost = _lost_nodes(cfg, run, provider, waiting=cause == PREEMPTION)
                if not lost and cause == FAILURE:  # no node to blame
                    stop = _repeated(code, outcome, run.tries(), spent[FAILURE],
                                     budgets[FAILURE])
            tries.record(run, outcome, None if stop else cause, [n.id for n in lost])
            if code == 0:
                return 0
            if stop is not None:
                log.info("recover: %s: %s; stopping", _ended(code, outcome, unreachable), stop)
                if code is None:
                    raise unreachable
                return code
            spent[cause] += 1
            log.info("recover: %s %d of %d (cluster.%s): %s, lost %s", cause, spent[cause],
                     budgets[cause], _BUDGET_KEYS[cause], _ended(code, outcome, unreachable),
                     ", ".join(n.id for n in lost) or "no node (every node still runs)")
            now = _replace(cfg, run, provider, lost)
            if batch is not None:
                cfg.job.args = _restart_args(cfg.job.args, batch, workers,
                                             sum(n.slots for n in now))
    finally:
        log.info("recover: the run spent %s", ", ".join(
            f"{spent[k]} of {budgets[k]} {k}s (cluster.{_BUDGET_KEYS[k]})" for k in budgets))


def _cause(code: int | None) -> str | None:
    """What a try's exit makes of a restart, by the budget spotring.exits.classify gives
    it: a preemption, a failure (also ssh failing: code None), or none (done, or the
    job's own verdict on its input or its loss)."""
    if code is None:
        return FAILURE
    budget = classify(code).budget
    return None if budget is None else _CAUSES[budget]


def _why_stop(cause: str | None, code: int | None, spent: dict[str, int],
              budgets: dict[str, int]) -> str | None:
    """Why the run stops after this try, whatever it lost (None: it goes on, or it is
    done)."""
    if code == EXIT_OK:
        return None
    if cause is None:
        return ("the job's own verdict (bad input or a diverged loss); another try would "
                "end the same")
    if spent[cause] >= budgets[cause]:
        return (f"no {cause}s left ({spent[cause]} of cluster.{_BUDGET_KEYS[cause]}="
                f"{budgets[cause]} spent)")
    return None


def _repeated(code: int | None, outcome: dict, before: list[dict], spent: int,
              budget: int) -> str | None:
    """Why a failure that lost no node stops the run: ssh failed to a node that runs, or
    the job failed as the try before did, with the same exit at the same step (a bug in
    the job, not the cloud: another try would fail the same way)."""
    if code is None:
        return "ssh failed to a node that still runs"
    last = before[-1] if before else None
    if last is not None and (last["exit"], last["step"]) == (code, outcome["step"]):
        return (f"the same exit at the same step as the try before, which looks like a bug "
                f"in the job, not the cloud; not spending cluster.max_restarts on it "
                f"({spent} of {budget} spent)")
    return None


def _ended(code: int | None, outcome: dict, unreachable: RemoteError | None) -> str:
    how = f"exit {code}" if code is not None else f"ssh failed ({unreachable})"
    step = f" at step {outcome['step']}" if outcome["step"] is not None else ""
    why = f" ({outcome['reason']})" if outcome.get("reason") else ""
    return how + why + step


def _lost_nodes(cfg: DictConfig, run: RunDir, provider: Provider,
                waiting: bool) -> list[Node]:
    """The run's nodes that no longer run: not `running`, or gone from the provider's
    list altogether (EC2 stops listing terminated instances after a while). After a
    spot notice (exit 75) the instance still runs for up to two minutes: wait for it."""
    def lost() -> list[Node] | None:
        running = {n.id for n in provider.describe() if n.state == "running"}
        return [n for n in run.nodes() if n.id not in running] or None

    try:
        return poll(lost, timeout_s=cfg.cluster.notice_wait_s if waiting else 0,
                    interval_s=cfg.cluster.notice_poll_s, what="a lost node")
    except TimeoutError:  # every node still runs: the restart goes on with them all
        return []


def _replace(cfg: DictConfig, run: RunDir, provider: Provider, lost: list[Node]) -> list[Node]:
    """The nodes to restart on: the survivors and replacements for the lost, or the
    survivors alone when no replacement can be had and they are enough. The lost nodes
    leave the bill now, when they were found lost, not once their replacements run."""
    found_at = time.time()
    gone = {n.id for n in lost}
    survivors = [n for n in run.nodes() if n.id not in gone]
    if not lost:
        return survivors
    if run.nodes()[0].id in gone:
        log.info("recover: node 0 was lost, and with it the checkpoints on its disk; the "
                 "job resumes from checkpoint.uri if it has one, else from the start")
    try:
        new = provider.replace(lost)
    except NoCapacity as e:
        if len(survivors) < cfg.cluster.min_nodes:
            raise NoCapacity(f"no replacement for {len(lost)} lost node(s), and "
                             f"{len(survivors)} left is below cluster.min_nodes="
                             f"{cfg.cluster.min_nodes}: {e}") from e
        log.info("recover: no replacement to be had (%s); going on with %d node(s) "
                 "(cluster.min_nodes=%d)", e, len(survivors), cfg.cluster.min_nodes)
        new = []
    nodes = survivors + new
    run.retire(lost, at=found_at)
    admit(cfg, run, nodes, new)
    return nodes


def _batch(args: list[str]) -> tuple[int, int]:
    """(train.batch_size, train.accumulation) as the trainer composes them from ``args``."""
    train = trainer_config.compose(list(args)).train
    return train.batch_size, train.accumulation


def _restart_args(args: list[str], batch: tuple[int, int], workers: int,
                  now: int) -> list[str]:
    """The trainer arguments of a restart on ``now`` workers: resume=auto, and the global
    batch of ``workers`` x ``batch`` kept, split by spotring.global_batch.split_global_batch
    into the fewest accumulation steps whose micro-batch is no larger than before (so that
    it fits in memory). RuntimeError where ``now`` workers cannot share it equally."""
    size, steps = batch
    try:
        size, steps = split_global_batch(size * workers * steps, now, batch_size=size)
    except ConfigError as e:  # not bad input (exit 2: nothing was started): the run ran
        raise RuntimeError(f"the run cannot continue on {now} workers with the same maths: {e} "
                           "A higher cluster.min_nodes keeps it on more workers.") from e
    if now != workers:
        log.info("recover: %d workers instead of %d: train.batch_size=%d "
                 "train.accumulation=%d keep the global batch at %d, so the run goes on "
                 "with the same samples in the same steps", now, workers, size, steps,
                 size * steps * now)
    kept = [a for a in args if not a.startswith(_OWN_ARGS)]
    return [*kept, "resume=auto", f"train.batch_size={size}", f"train.accumulation={steps}"]
