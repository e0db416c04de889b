"""Spot interruption notices: watch for them, and agree on them at a step boundary.

A cloud takes a spot instance back with a notice, published by its instance metadata
service (EC2: two minutes ahead; GCP and Azure: 30 seconds), and at the end the OS sends
SIGTERM. Every rank:

    catches SIGTERM (the notice of last resort, and how launchers stop their workers)
        and SIGUSR1 (a warning only: SLURM's --signal=USR1@S before the time limit);
    on local rank 0 of each node, a thread finds which cloud's metadata service answers
        (spotring/metadata.py; PreemptionOptions.notices) and asks it for a notice again
        and again: GCP's server holds each request until its preempted flag changes,
        EC2's and Azure's are polled every poll_seconds (0.5 s). A spot notice stops the
        job, EC2's rebalance recommendation (the risk went up) checkpoints now

and every few steps the ranks add up their votes in one small allreduce, so all of them
see the same answer at the same step. The sum is read one step after it is sent, so that
the allreduce overlaps that step's computation. On "stop", every rank writes its part of
a checkpoint at once and the job exits with code 75 (preempted); the launcher replaces
the node and resumes. Off every cloud each probe fails within a second, and the thread
gives up after 10 s of them (_FIND_SECONDS); SIGTERM still works.

How often the ranks vote (PreemptionOptions.check_every_steps; by default automatic):
each vote carries every rank's proposal of the interval, from its own measures of the
step time and the vote's cost (``vote_interval``), and every rank takes the floor of
the proposals' mean from the same sum: the ranks cannot disagree on the steps they vote
at. A proposal is at most twice the interval in force, so that the interval grows from
one vote per step as the measures come in (the first steps, warming up, are no guide).
"""

from __future__ import annotations

import logging
import math
import queue
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from spotring import metadata
from spotring.checkpoint.layout import Checkpoints, Saved
from spotring.engines import Engine
from spotring.options import PreemptionOptions

log = logging.getLogger(__name__)

# The window assumed until a metadata service is found, or where none is (SIGTERM alone):
# EC2's, where spotring launch runs jobs.
NOTICE_SECONDS = metadata.EC2.notice_seconds
# Signals that stop the run as a spot notice does: SIGTERM from the OS and launchers,
# SIGUSR1 from schedulers asked for a warning that is not also their kill signal.
SIGNALS = (signal.SIGTERM, signal.SIGUSR1)
# How long the watcher probes, every poll_seconds, before deciding that no metadata
# service answers (a busy new instance's may miss a probe; off every cloud all fail).
_FIND_SECONDS = 10.0
# How long close() waits for the watcher: it ends the request in flight at once
# (metadata.Source.close), but one still connecting ends at a Source's 1 s timeout.
_CLOSE_SECONDS = 2.0
VOTE_BUDGET = 0.01  # the share of the steps' time the automatic interval lets votes take
VOTE_SPAN_SECONDS = 1.0  # the most steps' time between two automatic votes


def vote_interval(step_seconds: float, vote_seconds: float) -> int:
    """The steps between two votes that keep a vote costing ``vote_seconds`` near
    VOTE_BUDGET of the time of steps of ``step_seconds`` each, but span no more than
    VOTE_SPAN_SECONDS of them (a notice waits that long for the next vote); at least 1."""
    step_seconds = max(step_seconds, 1e-9)  # two calls within the clock's resolution
    for_cost = math.ceil(vote_seconds / (VOTE_BUDGET * step_seconds))
    for_span = math.floor(VOTE_SPAN_SECONDS / step_seconds)
    return max(1, min(for_cost, for_span))


@dataclass
class Decision:
    stop: str | None  # why every rank stops now (a notice or a signal), or None
    checkpoint: bool  # checkpoint now (a rebalance recommendation) and go on
    # In place: the ranks whose node has a notice (they leave, the others go on), and
    # how many processes asked to join.
    leaving: tuple[int, ...] = ()
    joining: int = 0


class Preemption:
    """This rank's watcher (``options``: spotring.PreemptionOptions), and the
    step-boundary vote of all ranks over ``engine``.

    source: the metadata service this rank's watcher found (local rank 0 of each node),
        or None (none yet, none answers, or this rank does not watch).
    interval: the steps between two votes now, the same on every rank.
    waiting: in place (spotring/elastic/), how many processes asked to join (rank 0
        asks, and votes it): a notice or signal then votes this rank out, not all of
        them to a stop. None: not in place.
    """

    def __init__(self, options: PreemptionOptions, engine: Engine, local_rank: int,
                 waiting: Callable[[], int] | None = None) -> None:
        self.options, self.engine, self.waiting = options, engine, waiting
        self.source: metadata.Source | None = None
        self.interval = options.check_every_steps or 1
        self._stop: str | None = None
        self._decided: Decision | None = None  # a stop, once agreed: it is never undone
        # time.time() when a stop first reached this rank: its own notice or signal, or
        # else the vote of another rank (rank 0's goes into preempted.json).
        self.noticed_at: float | None = None
        self._rebalance = threading.Event()
        self._rebalance_handled = False
        self._closed = threading.Event()
        self._steps = 0
        self._next_vote = self.interval
        # The votes in flight (read at the next call), and the step and perf_counter()
        # they were sent at; the seconds the last vote cost (sending it and waiting for
        # its sum), which the next proposal weighs.
        self._pending: Callable[[], torch.Tensor] | None = None
        self._sent: tuple[int, float] | None = None
        self._vote_seconds = 0.0
        self._previous_handlers = {s: signal.signal(s, self._on_signal) for s in SIGNALS}
        self._thread: threading.Thread | None = None
        # What the watcher has to say, as Logger.log takes it, but the notice: logged by
        # the training thread, at its next decide() or at close(). From the watcher's own
        # thread a line could land inside one the script prints (an unbuffered print
        # writes its text, then its newline; under ssh -tt stderr and stdout are one
        # stream).
        self._said: queue.SimpleQueue[tuple] = queue.SimpleQueue()
        # The services this rank's watcher asks (probes, then the one found): close()
        # ends their requests.
        self._sources = metadata.sources(options.notices) if local_rank == 0 else []
        for source in self._sources:
            source.say = self._say
        if self._sources:
            self._thread = threading.Thread(target=self._watch, args=(self._sources,),
                                            name="spot-notice-watcher", daemon=True)
            self._thread.start()

    @property
    def notice_seconds(self) -> int:
        """Seconds between a spot notice and the end of the instance, by the cloud whose
        metadata service this rank's watcher found (EC2 120, GCP 30, Azure 30), or
        NOTICE_SECONDS (EC2's) where it found none (yet) or does not watch."""
        return self.source.notice_seconds if self.source is not None else NOTICE_SECONDS

    def _on_signal(self, signum, frame) -> None:
        # Only set a flag: the step in progress finishes, then every rank agrees.
        self._notice(signal.Signals(signum).name)

    def _notice(self, reason: str) -> None:
        """Keep the first reason to stop, and when it came (noticed_at first: decide()
        reads _stop, maybe from another thread)."""
        if self._stop is None:
            self.noticed_at = self.noticed_at or time.time()
            self._stop = reason

    def _say(self, level: int, msg: str, *args) -> None:
        self._said.put((level, msg, *args))

    def _tell(self) -> None:
        """Log what the watcher said since the last call (the training thread's)."""
        while not self._said.empty():
            log.log(*self._said.get())

    def _find(self, candidates: list[metadata.Source]) -> metadata.Source | None:
        """The service among ``candidates`` that answers, probed every poll_seconds for
        up to _FIND_SECONDS; None where none does, or once closed."""
        deadline = time.monotonic() + _FIND_SECONDS
        while (found := metadata.detect(candidates)) is None:
            if time.monotonic() > deadline:
                self._say(logging.DEBUG, "no instance metadata service answers (%s): not "
                          "watching for spot notices",
                          ", ".join(f"{c.cloud} at {c.endpoint}" for c in candidates))
                return None
            if self._closed.wait(self.options.poll_seconds):
                return None
        return found

    def _watch(self, candidates: list[metadata.Source]) -> None:
        source = self.source = self._find(candidates)
        if source is None:
            return
        self._say(logging.INFO, "watching %s's metadata service at %s for spot notices %s",
                  source.cloud, source.endpoint, "with requests it holds until its notice "
                  "changes" if source.holds else f"every {self.options.poll_seconds:g} s")
        while True:
            asked = time.monotonic()
            try:
                notice = source.wait()
                if notice is not None:
                    self._notice(notice)
                    # At once, from here: the one live sign of a notice while a long
                    # step, a blocking save or a hung collective holds the training thread.
                    log.warning("%s", notice)
                    return
                if not self._rebalance.is_set() and source.rebalance():
                    self._say(logging.WARNING, "%s rebalance recommendation: checkpointing "
                              "now", source.cloud)
                    self._rebalance.set()
            except (OSError, ValueError) as e:  # a hiccup (or close()); the next may work
                self._say(logging.DEBUG, "%s metadata request failed: %s", source.cloud, e)
            # A request the service held is followed by the next at once; one answered at
            # once (or failed), at the end of the interval that it began.
            pause = self.options.poll_seconds - (time.monotonic() - asked)
            if self._closed.wait(max(0.0, pause)):
                return

    def decide(self) -> Decision:
        """Every rank's notices, added up: the same answer on all ranks (a collective,
        called once per optimizer step by every rank). A stop, once agreed, is never
        undone.

        The votes are sent every ``interval`` steps and their sum is read by the call
        after, so that the small allreduce runs while that step computes; a notice is
        acted on at most ``interval`` + 1 steps after it reached a rank."""
        self._tell()
        if self._decided is not None:
            return self._decided
        self._steps += 1
        decision = self._read() if self._pending is not None else Decision(None, False)
        if self._steps == self._next_vote and decision.stop is None:
            self._send()
        if decision.stop is not None:
            self._decided = decision
        return decision

    def _send(self) -> None:
        """Start the sum of this rank's votes: stop, rebalance, its proposed interval."""
        now = time.perf_counter()
        rebalance = self._rebalance.is_set() and not self._rebalance_handled
        self._rebalance_handled |= rebalance  # voted once; answered with the next call
        noticed = self._stop is not None
        leaving = [0.0] * self.engine.world_size
        joining = 0
        if self.waiting is not None:  # in place: this rank leaves; rank 0 counts joiners
            leaving[self.engine.rank], noticed = float(noticed), False
            joining = self.waiting() if self.engine.rank == 0 else 0
        votes = torch.tensor([noticed, rebalance, self._proposal(now), joining, *leaving],
                             dtype=torch.float64, device=self.engine.device)
        self._pending = self.engine.start_sum(votes, "preemption")
        self._vote_seconds = time.perf_counter() - now
        self._sent = (self._steps, now)

    def _proposal(self, now: float) -> int:
        """This rank's interval for after the vote it sends ``now``: check_every_steps
        where set; else ``vote_interval`` of the steps since the last vote and of its
        cost, at most twice the interval in force (1 at the first vote)."""
        if self.options.check_every_steps is not None:
            return self.options.check_every_steps
        if self._sent is None:
            return 1
        step_seconds = (now - self._sent[1]) / (self._steps - self._sent[0])
        return min(vote_interval(step_seconds, self._vote_seconds), 2 * self.interval)

    def _read(self) -> Decision:
        """The sum of the votes sent by the call before, and, unless it stops the run, the
        interval it sets: the floor of the proposals' mean, exact in float64, so the same
        on every rank."""
        started = time.perf_counter()
        stop_votes, rebalance_votes, proposals, joining, *leaving = self._pending().tolist()
        self._vote_seconds += time.perf_counter() - started
        self._pending = None
        if stop_votes > 0:  # no vote follows; the interval named is the one this vote kept
            self.noticed_at = self.noticed_at or time.time()
            log.info("the ranks agreed to stop (votes every %d steps)", self.interval)
            return Decision(self._stop or "another rank received a notice", False)
        interval = max(1, int(proposals) // self.engine.world_size)
        if interval != self.interval:
            log.debug("the ranks vote every %d steps now", interval)
        self.interval = interval
        self._next_vote = self._sent[0] + interval
        if rebalance_votes > 0:
            self._rebalance_handled = True  # one checkpoint, whichever rank saw it first
        return Decision(None, rebalance_votes > 0,
                        tuple(r for r, vote in enumerate(leaving) if vote > 0), int(joining))

    def regrouped(self) -> None:
        """In place: the ranks are others now (spotring/elastic/): the vote in flight is
        dropped, and they vote at the next step, as at the start."""
        self._pending, self._sent = None, None
        self.interval = self.options.check_every_steps or 1
        self._next_vote = self._steps + 1

    def stop_all(self, reason: str) -> Decision:
        """In place, where the others cannot go on: every rank stops, as on a notice."""
        self.noticed_at = self.noticed_at or time.time()
        self._decided = Decision(reason, False)
        return self._decided

    def close(self) -> None:
        """Stop watching, ending the metadata request in flight, and wait for the watcher
        to end (within _CLOSE_SECONDS). Left to end during interpreter exit, its thread
        would drop the last reference to this object, whose pending votes hold a tensor:
        freeing it there aborts the process ("terminate called without an active
        exception") after a run that succeeded, about once in 50 single-process runs on
        a busy host. The signal handlers stay: restore_signals."""
        self._closed.set()
        for source in self._sources:
            source.close()
        if self._thread is not None:
            self._thread.join(_CLOSE_SECONDS)
        self._tell()

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
                  noticed_at: float, notice_seconds: int = NOTICE_SECONDS
                  ) -> dict[str, float]:
    """Rank 0: how long the checkpoint a run stops with took after the notice (or signal)
    reached this process, against the cloud's ``notice_seconds`` (Preemption's). Logs one
    line and returns
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
    log.log(logging.INFO if spent <= notice_seconds else logging.WARNING,
            "notice budget (%s): checkpoint of step %d, %s; notice to the local copy "
            "%.2f s, to every store and read back %.2f s: %.2f s left of a %d s notice",
            reason, step, saved.describe(), fields["local_saved_at"] - noticed_at, spent,
            notice_seconds - spent, notice_seconds)
    return fields
