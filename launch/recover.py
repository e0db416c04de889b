"""`launch` on spot nodes: run the job, and when nodes are taken away, get nodes again
and resume, up to cluster.max_restarts times.

    run the job (the trainer's resume=auto picks up the newest checkpoint)
    exit 0                            done
    exit 75 (preempted), 69 (a rank   a restart: wait (up to cluster.notice_wait_s) for the
    was lost), or a node not running  noticed node to leave `running`, replace the lost
    (or no longer reachable by ssh)   nodes (on EC2: the same type, else the next of
                                      cluster.instance_types, in the run's zone); if none
                                      can be had, go on with the survivors when they are
                                      at least cluster.min_nodes
    any other exit                    the job's own failure: stop

On fewer (or again more) workers the global batch stays what it was: train.accumulation
(and, where it must, train.batch_size) make up for the missing workers, so with the
world-size-invariant sample order the run continues the same sample sequence with the
same maths (docs/design.md, "Why N workers take the same steps as one"). Rank 0 keeps its
checkpoints on node 0; if node 0 itself is lost, only checkpoint.uri=s3://... keeps
them (the trainer resumes from S3 on the new node 0).
"""

from __future__ import annotations

import logging

from omegaconf import DictConfig

from launch.provider import NoCapacity, Node, Provider
from launch.run import run as run_job
from launch.rundir import RunDir
from launch.ssh import RemoteError
from launch.up import admit
from trainer import config as trainer_config
from trainer.exits import EXIT_PEER_LOST, EXIT_PREEMPTED
from trainer.polling import poll

log = logging.getLogger("launch")

# Trainer arguments the launcher sets itself on a restart.
_OWN_ARGS = ("resume=", "train.batch_size=", "train.accumulation=")


def supervise(cfg: DictConfig, run: RunDir, provider: Provider) -> int:
    """Run the job on the run's nodes until it ends; replace lost nodes between tries."""
    batch = _batch(cfg.job.args)
    workers = sum(n.slots for n in run.nodes())
    if cfg.cluster.max_restarts and not any(a.startswith("checkpoint.uri=")
                                            for a in cfg.job.args):
        log.info("recover: checkpoints stay on node 0; should node 0 itself be lost, the job "
                 "starts over. checkpoint.uri=s3://bucket/prefix keeps them in S3 instead")
    restarts = 0
    while True:
        try:
            code = run_job(cfg, run, provider)
        except RemoteError as e:  # ssh to a node failed: lost, or a failure of its own
            code, unreachable = None, e
        if code == 0:
            return 0
        if restarts >= cfg.cluster.max_restarts:
            if code is None:
                raise unreachable
            log.info("recover: exit %d, and no restarts left (cluster.max_restarts=%d)",
                     code, cfg.cluster.max_restarts)
            return code
        lost = _lost_nodes(cfg, run, provider, waiting=code == EXIT_PREEMPTED)
        if code not in (EXIT_PREEMPTED, EXIT_PEER_LOST) and not lost:
            if code is None:
                raise unreachable
            return code  # the job failed by itself: another try would fail the same way
        restarts += 1
        log.info("recover: restart %d of %d: %s, lost %s", restarts,
                 cfg.cluster.max_restarts,
                 f"exit {code}" if code is not None else f"ssh failed ({unreachable})",
                 ", ".join(n.id for n in lost) or "no node (every node still runs)")
        nodes = _replace(cfg, run, provider, lost)
        cfg.job.args = _restart_args(cfg.job.args, batch, workers,
                                     sum(n.slots for n in nodes))


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
    survivors alone when no replacement can be had and they are enough."""
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
    run.retire(lost)
    admit(cfg, run, nodes, new)
    return nodes


def _batch(args: list[str]) -> tuple[int, int]:
    """(train.batch_size, train.accumulation) as the trainer composes them from ``args``."""
    train = trainer_config.compose(list(args)).train
    return train.batch_size, train.accumulation


def keep_global_batch(batch_size: int, accumulation: int, workers: int,
                      now: int) -> tuple[int, int]:
    """(batch size, accumulation) for ``now`` workers that keep the global batch of
    ``workers`` x ``batch_size`` x ``accumulation``: the fewest accumulation steps whose
    per-worker batch divides it evenly and fits in memory (no larger than before)."""
    total = batch_size * workers * accumulation
    for steps in range(1, total + 1):
        per_step, rest = divmod(total, now * steps)
        if rest == 0 and per_step <= batch_size:
            return per_step, steps
    raise RuntimeError(f"the global batch {total} cannot be split evenly over {now} workers, "
                       "so the run cannot go on with the same maths; a global batch with "
                       "more divisors (a power of two) or a higher cluster.min_nodes avoids "
                       "this")


def _restart_args(args: list[str], batch: tuple[int, int], workers: int,
                  now: int) -> list[str]:
    """The trainer arguments of a restart: resume=auto, and the global batch kept."""
    kept = [a for a in args if not a.startswith(_OWN_ARGS)]
    size, steps = keep_global_batch(*batch, workers, now)
    if now != workers:
        log.info("recover: %d workers instead of %d: train.batch_size=%d "
                 "train.accumulation=%d keep the global batch at %d, so the run goes on "
                 "with the same samples in the same steps", now, workers, size, steps,
                 size * steps * now)
    return [*kept, "resume=auto", f"train.batch_size={size}", f"train.accumulation={steps}"]
