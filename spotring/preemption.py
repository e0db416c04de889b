"""Spot interruption notices: watch for them, and agree on them at a step boundary.

EC2 takes a spot instance back with a two-minute notice, published by the instance
metadata service (IMDSv2), and at the end the OS sends SIGTERM. Every rank:

    catches SIGTERM (the notice of last resort, and how launchers stop their workers)
        and SIGUSR1 (a warning only: SLURM's --signal=USR1@S before the time limit);
    on local rank 0 of each node, a thread polls the instance metadata service
        (spotring/metadata.py) every poll_seconds (PreemptionOptions): a spot notice
        stops the job, a rebalance recommendation (the risk went up) checkpoints now

and at every step boundary the ranks add up their votes in one small allreduce, so all
of them see the same answer at the same step (the sum of the votes of the step before,
so that the allreduce overlaps a step's computation). On "stop", rank 0 writes a checkpoint
at once and the job exits with code 75 (preempted); the launcher replaces the node and
resumes. Off EC2 the first requests fail within a second each and the
thread stops polling after three of them; SIGTERM still works.
"""

from __future__ import annotations

import logging
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from spotring import metadata
from spotring.checkpoint import Checkpoints, Saved
from spotring.engines import Engine
from spotring.metadata import Metadata
from spotring.options import PreemptionOptions

log = logging.getLogger(__name__)

NOTICE_SECONDS = 120  # EC2's spot interruption notice: the instance goes this long after it
# Signals that stop the run as a spot notice does: SIGTERM from the OS and launchers,
# SIGUSR1 from schedulers asked for a warning that is not also their kill signal.
SIGNALS = (signal.SIGTERM, signal.SIGUSR1)
_PROBES = 3  # first requests before deciding there is no metadata service
# How long close() waits for the watcher: a poll in flight is up to three requests
# (token, notice, rebalance) of Metadata's 1 s timeout.
_CLOSE_SECONDS = 3.5


@dataclass
class Decision:
    stop: str | None  # why every rank stops now (a notice or a signal), or None
    checkpoint: bool  # checkpoint now (a rebalance recommendation) and go on


class Preemption:
    """This rank's watcher (``options``: spotring.PreemptionOptions), and the
    step-boundary vote of all ranks over ``engine``."""

    def __init__(self, options: PreemptionOptions, engine: Engine, local_rank: int) -> None:
        self.options, self.engine = options, engine
        self._stop: str | None = None
        # time.time() when a stop first reached this rank: its own notice or signal, or
        # else the vote of another rank (rank 0's goes into preempted.json).
        self.noticed_at: float | None = None
        self._rebalance = threading.Event()
        self._rebalance_handled = False
        self._closed = threading.Event()
        self._steps = 0
        self._pending: Callable[[], torch.Tensor] | None = None  # the last votes sent
        self._previous_handlers = {s: signal.signal(s, self._on_signal) for s in SIGNALS}
        self._thread: threading.Thread | None = None
        if options.imds and local_rank == 0:
            self._thread = threading.Thread(target=self._watch,
                                            args=(Metadata(metadata.endpoint()),),
                                            name="spot-notice-watcher", daemon=True)
            self._thread.start()

    def _on_signal(self, signum, frame) -> None:
        # Only set a flag: the step in progress finishes, then every rank agrees.
        self._notice(signal.Signals(signum).name)

    def _notice(self, reason: str) -> None:
        """Keep the first reason to stop, and when it came (noticed_at first: decide()
        reads _stop, maybe from another thread)."""
        if self._stop is None:
            self.noticed_at = self.noticed_at or time.time()
            self._stop = reason

    def _watch(self, source: Metadata) -> None:
        for probe in range(_PROBES):  # a busy new instance may miss one; off EC2 all fail
            try:
                source.get(metadata.SPOT_NOTICE)
                break
            except (OSError, ValueError) as e:
                if probe == _PROBES - 1 or self._closed.wait(self.options.poll_seconds):
                    log.debug("no instance metadata service at %s (%s): not watching for "
                              "spot notices", source.endpoint, e)
                    return
        log.info("watching %s for spot interruption notices every %g s",
                 source.endpoint, self.options.poll_seconds)
        while not self._closed.wait(self.options.poll_seconds):
            try:
                action = source.get(metadata.SPOT_NOTICE)
                if action is not None:
                    notice = f"spot {action.get('action', 'interruption')} notice " \
                             f"for {action.get('time', 'soon')}"
                    self._notice(notice)
                    log.warning("%s", notice)
                    return
                if not self._rebalance.is_set() and source.get(
                        metadata.REBALANCE) is not None:
                    log.warning("rebalance recommendation: checkpointing now")
                    self._rebalance.set()
            except (OSError, ValueError) as e:  # a hiccup; the next poll may work
                log.debug("instance metadata poll failed: %s", e)

    def decide(self) -> Decision:
        """Every rank's notices, added up: the same answer on all ranks (a collective).
        Runs every check_every_steps steps; a decision is never undone.

        Each call sends this rank's votes and answers with the sum of the votes sent by
        the call before: the small allreduce runs while the next step computes instead
        of stopping every step for it (a step late is nothing against a two-minute
        notice). The first call only sends."""
        self._steps += 1
        if self._steps % self.options.check_every_steps:
            return Decision(None, False)
        rebalance = self._rebalance.is_set() and not self._rebalance_handled
        self._rebalance_handled |= rebalance  # voted once; answered with the next call
        votes = torch.tensor([self._stop is not None, rebalance], dtype=torch.float32,
                             device=self.engine.device)
        # The sum sent last time first: Horovod allows one tensor of a name in flight.
        previous = self._pending() if self._pending is not None else None
        self._pending = self.engine.start_sum(votes, "preemption")
        if previous is None:
            return Decision(None, False)
        stop_votes, rebalance_votes = previous.tolist()
        if stop_votes > 0:
            self.noticed_at = self.noticed_at or time.time()
            return Decision(self._stop or "another rank received a notice", False)
        if rebalance_votes > 0:
            self._rebalance_handled = True  # one checkpoint, whichever rank saw it first
            return Decision(None, True)
        return Decision(None, False)

    def close(self) -> None:
        """Stop watching, and wait for the watcher to end. Left to end during interpreter
        exit, its thread would drop the last reference to this object, whose pending
        votes hold a tensor: freeing it there aborts the process ("terminate called
        without an active exception") after a run that succeeded, about once in 50
        single-process runs on a busy host. The signal handlers stay: restore_signals."""
        self._closed.set()
        if self._thread is not None:
            self._thread.join(_CLOSE_SECONDS)

    def restore_signals(self) -> None:
        """Give SIGTERM and SIGUSR1 back their handlers from before this object, once the
        job's failure path has ended (a lost rank's roll call, the engine's shutdown).
        Until then a signal only sets the stop flag: torchrun answers a dead worker by
        sending SIGTERM to the others while they name it (DDPEngine.describe_failure, up
        to 5 s), and with the default handler back they would die of it, silent (-15),
        instead of exiting 69 with the lost rank named."""
        for signum, handler in self._previous_handlers.items():
            signal.signal(signum, handler)


def notice_budget(saved: Saved, checkpoints: Checkpoints, reason: str, step: int,
                  noticed_at: float) -> dict[str, float]:
    """Rank 0: how long the checkpoint a run stops with took after the notice (or signal)
    reached this process, against EC2's NOTICE_SECONDS. Logs one line and returns
    preempted.json's fields (epoch seconds; noticed_at <= local_saved_at <= saved_at, a
    time clamped to noticed_at where that checkpoint was already written when the notice
    came):

        noticed_at       the notice or signal reached rank 0 (or the others' vote did)
        local_saved_at   the checkpoint complete in the checkpoint directory
        saved_at         complete and read back on every store (S3 too)
        upload_seconds, upload_bytes   the S3 store's share (with a checkpoint uri)
    """
    fields = {"noticed_at": noticed_at,
              "local_saved_at": max(saved.done_at[checkpoints.local.where], noticed_at),
              "saved_at": max(saved.complete_at, noticed_at)}
    if checkpoints.remote is not None:
        fields |= {"upload_seconds": saved.seconds[checkpoints.remote.where],
                   "upload_bytes": saved.bytes}
    spent = fields["saved_at"] - noticed_at
    # Past the notice the instance is gone, and so is a checkpoint not yet uploaded.
    log.log(logging.INFO if spent <= NOTICE_SECONDS else logging.WARNING,
            "notice budget (%s): checkpoint of step %d, %s; notice to the local copy "
            "%.2f s, to every store and read back %.2f s: %.2f s left of EC2's %d s",
            reason, step, saved.describe(), fields["local_saved_at"] - noticed_at, spent,
            NOTICE_SECONDS - spent, NOTICE_SECONDS)
    return fields
