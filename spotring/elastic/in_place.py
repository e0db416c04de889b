"""A rank's part of a job in place: the other workers go on when one is lost or leaves,
and a new one joins at a step boundary, with the same global batches.

Every step of a job in place ends at ``job.should_stop()``, the step boundary where the
ranks agree on everything (spotring/preemption.py's vote). What happens there:

- nothing changed: the small tracked objects' states (the loader's position, schedulers,
  the script's dicts: never the model or the optimizer) are kept, as they stand between
  two steps (``commit``);
- a collective of this step failed (a worker lost without notice: its connections
  closed, or its heartbeat stood still for rendezvous.py's SILENT_S while the others
  waited in a collective: its host cut off): the gradients' hook (DDP's allreduce,
  HSDP's over the groups) gave up and the optimizer skipped its step (``watch``), so the
  step is dropped. The survivors answer a roll call in the rendezvous store and form the
  next generation of members from who answered (HSDP: of the groups still whole), form
  the process group anew, go back to the kept states, and take the same global batch
  again, split over the ranks they have;
- the vote names workers whose node has a notice (or a SIGTERM): every rank writes the
  checkpoint of this step (ElasticOptions.save_on_leave), those workers leave (exit 75),
  the others form the group anew and go on;
- the vote says processes asked to join (``spotring.init`` with the job's rendezvous, in
  a process of its own, then ``job.restore()``): at the next step's start, before its
  first micro-batch is drawn (``step_starts``), the members and they form the group
  anew, and the rank that has taken the most steps sends the model, the optimizer and
  the small states to every rank, which takes them.

Where the survivors cannot go on with the same global batch (it does not split over
them, or fewer than ElasticOptions.min_workers are left), they take today's path: a
checkpoint, and exit 75 on every rank, with a line that says why. A lost worker costs
the step in flight, the roll call (until every member answered or its heartbeat stood
still for rendezvous.py's DEAD_S) and forming the group; a notice, the checkpoint and
forming the group.
"""

from __future__ import annotations

import copy
import logging
import os
import socket
import sys
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch.distributed as dist
from torch import nn
from torch.optim import Optimizer

from spotring import contract
from spotring.elastic.rendezvous import (
    BEAT_S,
    SILENT_S,
    WATCH_S,
    Generation,
    JobEnded,
    Rendezvous,
    connect,
)
from spotring.engines.process_group import Group
from spotring.exits import ConfigError, exit_peer_lost
from spotring.global_batch import split_global_batch
from spotring.loader import DataLoader
from spotring.options import ElasticOptions

if TYPE_CHECKING:
    from spotring.job import Job

log = logging.getLogger("spotring")


class InPlace:
    """This process's membership of a job in place, as ``rendezvous``'s member, in
    ``generation`` (``joining``: not yet a member; its group is its own until
    ``job.restore()`` takes it in)."""

    def __init__(self, options: ElasticOptions, rendezvous: Rendezvous,
                 generation: Generation | None) -> None:
        self.options, self.rendezvous = options, rendezvous
        self.generation = generation or Generation(-1, (rendezvous.name,))
        self.joining = generation is None
        self.applied = 0  # optimizer steps this process applied
        self._stepped = False  # the optimizer ran this step (since the last boundary)
        self._skipped = False  # ... and skipped its update (a lost worker)
        self._kept: dict[str, Any] = {}  # the small states at the last step boundary
        self.engine: Any = None  # the job's, once made (the heartbeat gives it up)
        self._switch = threading.Lock()  # held to change generation (and its failure)
        self._beating = threading.Event()  # set: the heartbeat stops
        self.changes: list[dict[str, Any]] = []  # the job's changes of members, for the summary
        self._joining = 0  # processes the last vote let in: at the next step's start
        self._rejoining: int | None = None  # counted out of this generation: joins again

    @classmethod
    def begin(cls, options: ElasticOptions, rank: int, world_size: int,
              timeout_s: float) -> tuple[InPlace, Group]:
        """Meet the job in its rendezvous store: as a founder, the ``rank`` of the
        ``world_size`` a launcher started together; or, where the job began without this
        process, as one that will join. Returns the group to form now. ConfigError where
        the store cannot be reached."""
        try:
            store = connect(str(options.rendezvous), timeout_s)
        except ConnectionError as e:
            raise ConfigError(f"elastic.rendezvous={options.rendezvous}: {e}") from None
        name = contract.member() or f"{socket.gethostname()}:{os.getpid()}"
        rendezvous = Rendezvous(store, name, timeout_s)
        self = cls(options, rendezvous, None)
        self._beat(Rendezvous(connect(str(options.rendezvous), timeout_s), name, timeout_s))
        generation = rendezvous.found(rank, world_size)
        if generation is not None:
            self.generation, self.joining = generation, False
        if generation is None:  # alone until the members take it in (job.restore)
            return self, Group(dist.HashStore(), 0, 1)
        return self, self._group(generation)

    def _beat(self, rendezvous: Rendezvous) -> None:
        """This process's heartbeat, every BEAT_S from a thread of its own (over a client
        of its own), until ``close``: the roll call after a failure tells the gone from
        the slow by it. The same thread carries a failure to the others: this rank's,
        where one of its collectives failed, and another's, on which it gives up every
        collective it waits in (a rank can wait for a peer that waits in another
        collective, until engine.timeout_s)."""
        def beating() -> None:
            told = None  # the generation whose failure this rank told
            seen: dict[str, tuple[int, float]] = {}  # the others' heartbeats (still)
            watched = 0.0  # when this rank last read them
            while not self._beating.wait(BEAT_S):
                with self._switch:  # the generation and its failure, as one
                    number, engine = self.generation.number, self.engine
                    others = [m for m in self.generation.members if m != rendezvous.name]
                    failure = None if engine is None else engine.failure
                try:
                    rendezvous.beat()
                    if engine is None or self.joining:
                        continue
                    if failure is not None and told != number:
                        rendezvous.flag_failed(number)
                        told = number
                    elif failure is None and (who := rendezvous.failed_in(number)):
                        self._give_up(engine, number,
                                      f"{who} met a lost worker in generation {number}")
                    elif failure is None and engine.waiting and (
                            time.monotonic() - watched >= WATCH_S):
                        watched = time.monotonic()
                        if still := rendezvous.still(others, seen, SILENT_S):
                            self._give_up(engine, number, (
                                f"{', '.join(still)} silent for {SILENT_S:g} s in "
                                f"generation {number} (a host cut off?)"))
                except Exception:  # the store out of reach for a moment: the next may do
                    continue

        rendezvous.beat()
        self._heart = threading.Thread(target=beating, name="spotring-heartbeat", daemon=True)
        self._heart.start()

    def _give_up(self, engine: Any, number: int, why: str) -> None:
        """(The heartbeat's thread.) Every collective of generation ``number`` this rank
        waits in fails now, for ``why``, unless the group was formed anew since."""
        with self._switch:
            if self.generation.number == number:
                engine.give_up(ConnectionError(why))

    def close(self, leaving: bool) -> None:
        """Stop the heartbeat: this process leaves the job, alone (``leaving``, or no member
        now) or with every other member (the store says so: its launcher replaces none of
        them).
        Waits for the heartbeat's request in flight (bounded by the store's timeout): a
        thread left inside the store's C++ call while the interpreter exits aborts the
        process ("terminate called without an active exception") after a job that
        succeeded, which its launcher would take for a failure."""
        self._beating.set()
        self._heart.join(timeout=self.rendezvous.timeout_s)
        if not (leaving or self.joining or self.counted_out):
            self.rendezvous.end()

    def _group(self, generation: Generation) -> Group:
        return Group(dist.PrefixStore(generation.prefix, self.rendezvous.store),
                     generation.rank_of(self.rendezvous.name), len(generation.members))

    # ------------------------------------------------------------------ the steps

    def watch(self, optimizer: Optimizer, failed: Callable[[], bool],
              drop: Callable[[], None]) -> None:
        """Make ``optimizer`` skip the update of a step whose collectives ``failed``
        (every gradient set to None: torch's optimizers step only the parameters that
        have one), then ``drop`` the broken group; and count the updates it applies."""
        def before(opt: Optimizer, args: Any, kwargs: Any) -> None:
            self._stepped, self._skipped = True, failed()
            if self._skipped:
                for group in opt.param_groups:
                    for p in group["params"]:
                        p.grad = None
                drop()  # frees at once the survivors that wait for this rank

        def after(opt: Optimizer, args: Any, kwargs: Any) -> None:
            self.applied += not self._skipped

        optimizer.register_step_pre_hook(before)
        optimizer.register_step_post_hook(after)

    def commit(self, job: Job) -> None:
        """Keep the small tracked states as they stand at this step boundary."""
        self._kept = copy.deepcopy(job._small_states())
        self._stepped = self._skipped = False

    def boundary(self, job: Job, leaving: tuple[int, ...], joining: int) -> bool:
        """At ``job``'s step boundary, after the vote (which named the ranks ``leaving``
        and the number of processes ``joining``): go on in place, or take today's path.
        Returns whether this rank stops (it leaves, or today's path stops them all)."""
        engine = job.engine
        if engine.failure is not None:
            return self._lost(job, engine.failure)
        # Workers leave and join by whole copies of the model's state (HSDP: a group).
        size = engine.replica_size
        noticed, leaving = leaving, _copies_of(leaving, size)
        joining -= joining % size  # the rest are counted again at the next vote
        if not (leaving or joining):
            self.commit(job)
            return False
        job._wait_for_saves()
        members = list(self.generation.members)
        stay = [m for r, m in enumerate(members) if r not in leaving]
        if leaving and (why := _cannot_go_on(job, len(stay) + joining, self.options)):
            return job._stop_all(f"{len(leaving)} worker(s) leave and {why}")
        if leaving and self.options.save_on_leave:
            job.save(background=False)
        if job.rank in leaving:
            job._leave("a notice on this worker's node: the others go on in place"
                       if job.rank in noticed else "a notice on a node of this worker's "
                       "group (HSDP), which leaves whole: the others go on in place")
            return True
        # Those joining are taken in at the next step's start (step_starts), where they
        # begin: what the members do until then (a save, say) is theirs alone.
        self._joining = joining
        if leaving:
            nxt = self.rendezvous.record(self.generation.number + 1, stay,
                                         self.generation.admitted)
            self._form(job, nxt, "leave", time.monotonic())
        else:
            self.commit(job)
        return False

    @property
    def counted_out(self) -> bool:
        """Counted out by the roll call and not yet taken in again: no member, so this
        process writes nothing of the job's (a checkpoint's part, the summary)."""
        return self._rejoining is not None

    def step_starts(self, job: Job) -> None:
        """Before the first micro-batch of a step is drawn: the processes the last vote let
        in become members, and every member takes the same state."""
        if self.counted_out:
            self._rejoin(job)
            return
        if not self._joining:
            return
        started, joining, self._joining = time.monotonic(), self._joining, 0
        job._wait_for_saves()  # a save begun since the boundary ends in its own group
        newcomers = self.rendezvous.joiners(self.generation, joining)
        nxt = self.rendezvous.record(self.generation.number + 1,
                                     [*self.generation.members, *newcomers],
                                     self.generation.admitted + joining)
        self._form(job, nxt, "join", started)

    def _lost(self, job: Job, error: BaseException) -> bool:
        """A collective of this step failed: the roll call, the group formed anew, the
        step dropped (taken again, split over the ranks there are) unless this rank took
        it already; today's path where the rest cannot go on."""
        started, self._joining = time.monotonic(), 0  # the next vote counts them again
        log.warning("a worker was lost (%s: %s); the others go on in place",
                    type(error).__name__, str(error).splitlines()[0][:200])
        job._abandon_saves()
        job._drop_group()  # frees the survivors still waiting on this rank
        if self._stepped and not self._skipped:
            self.commit(job)  # this rank's update went through: the step counts here
        else:
            job._load_small_states(copy.deepcopy(self._kept))
        members, size = self.generation.members, job.engine.replica_size
        nxt = self.rendezvous.survivors(
            self.generation, keep=lambda answered: _whole_copies(members, answered, size))
        if not nxt.members:
            exit_peer_lost(f"rank {job.rank}: every group of {size} workers (HSDP) lost one: "
                           "no whole copy of the model's state is left to go on in place "
                           "with; today's path: exit 69, and the job restarts from its "
                           "last checkpoint")
        if self.rendezvous.name not in nxt.members:
            if size > 1:
                # Its group lost a worker (or it answered too late): it exits as a worker
                # of such a group does where FSDP's own forward or backward met the loss,
                # whichever collective met it first.
                exit_peer_lost(f"rank {job.rank}: this worker's group of {size} (HSDP) "
                               "lost a worker, or it answered the roll call too late: the "
                               "whole groups go on in place without it (exit 69: started "
                               "again, it joins)")
            # Counted out (its heartbeat still through the roll call: a host too busy to
            # answer). It asks to join again, and is taken in where the members take in
            # any newcomer: at a step's start (step_starts). Until then its failure stays
            # kept, so that what the script does after should_stop (a save) starts no
            # collective.
            log.warning("this worker answered the roll call too late: it joins again at "
                        "the next step's start")
            self.rendezvous.ask_to_join()
            self._rejoining = nxt.number
            return False
        self._form(job, nxt, "lost", started)
        if why := _cannot_go_on(job, len(nxt.members), self.options):
            job.save(background=False)
            return job._stop_all(f"a worker was lost and {why}")
        return False

    def finishing(self, job: Job) -> None:
        """``job.finish()``: a worker counted out at the job's last step (its update went
        through, so its script ended too) is taken in by no step of the members; it waits
        for them to end the job, and exits 0."""
        if self.counted_out:
            log.warning("this worker was counted out at the job's last step: the others "
                        "end the job")
            self._rejoin(job)

    def _rejoin(self, job: Job) -> None:
        """A counted-out worker taken in again, as any process joining (``join``)."""
        started = time.monotonic()
        generation = self._admitted(job, self._rejoining)
        self._rejoining = None
        self._form(job, generation, "joined", started)

    def join(self, job: Job) -> int | None:
        """``job.restore()`` of a process that is joining: ask the members to take it in,
        wait for the generation that does (engine.timeout_s), form the group with them
        and take the state from the rank with the most steps. Returns the step it joins
        at. Exits 0 where the job ends before it is taken in: nothing is left to do."""
        started = time.monotonic()
        self.rendezvous.ask_to_join()
        log.warning("asked to join the job at %s as %s", self.options.rendezvous,
                    self.rendezvous.name)
        nxt = self._admitted(job, self.generation.number)
        self.joining = False
        self._form(job, nxt, "joined", started)
        return job.step_count

    def _admitted(self, job: Job, number: int) -> Generation:
        """The generation after ``number`` that takes in this process, which asked to join
        (engine.timeout_s). Exits 0 where the job ends first: nothing is left to do."""
        try:
            return self.rendezvous.admitted(number)
        except JobEnded as e:
            log.warning("%s: nothing is left to do; exit 0", e)
            job.close()
            sys.exit(0)

    def _form(self, job: Job, generation: Generation, why: str, started: float) -> None:
        """Form ``generation``'s group, and every rank takes the state of the one that
        has taken the most steps where they differ (a rank whose update of a failed step
        went through is ahead), or where one is new (its state is its own)."""
        with self._switch:
            before, self.generation = len(self.generation.members), generation
            job.engine.failure = None  # the last generation's
        job._regroup(self._group(generation))
        # Decided from what every rank says, so that all take part in the sending or none.
        said = job.engine.all_gather_object(
            (self.applied, why in ("join", "joined"), before, self.changes))
        steps = [applied for applied, *_ in said]
        source = steps.index(max(steps))
        if min(steps) != max(steps) or any(new for _, new, *_ in said):
            _send_state(job, source)
            self.applied = steps[source]
        self.commit(job)
        # The job's history and workers as rank 0 saw them (a member before the change,
        # as the members come first), so that a process that joined has them too.
        before, self.changes = said[0][2], list(said[0][3])
        seconds = time.monotonic() - started
        self.changes.append({"step": job.step_count, "why": "join" if why == "joined" else why,
                             "workers": [before, len(generation.members)],
                             "seconds": round(seconds, 3)})
        log.warning("in place: %d -> %d workers at step %d (%s) in %.2f s", before,
                    len(generation.members), job.step_count, why, seconds)


def _copies_of(ranks: tuple[int, ...], size: int) -> tuple[int, ...]:
    """``ranks`` and the other ranks of their copies of the model's state (groups of
    ``size`` consecutive ranks)."""
    return tuple(sorted({r // size * size + i for r in ranks for i in range(size)}))


def _whole_copies(members: tuple[str, ...], present: list[str], size: int) -> list[str]:
    """The ``members`` (in order, each consecutive ``size`` of them a copy of the model's
    state) of the copies whose every member is ``present``."""
    rows = [members[i:i + size] for i in range(0, len(members), size)]
    return [m for row in rows if all(m in present for m in row) for m in row]


def _cannot_go_on(job: Job, workers: int, options: ElasticOptions) -> str | None:
    """Why ``workers`` cannot go on in place with the job's global batch, or None."""
    if workers < options.min_workers:
        return (f"{workers} would be left, fewer than elastic.min_workers="
                f"{options.min_workers}: today's path (a checkpoint, exit 75)")
    loaders = [o for o in job._tracked.values() if isinstance(o, DataLoader)]
    for loader in loaders:
        try:
            split_global_batch(loader.global_batch, workers, loader.batch_size_cap)
        except ConfigError:
            return (f"the global batch of {loader.global_batch} does not split over "
                    f"{workers} workers: today's path (a checkpoint, exit 75)")
    return None


def _send_state(job: Job, source: int) -> None:
    """Rank ``source``'s model (weights and buffers), optimizer state and small states, on
    every rank (a collective): the copies of a job in place are one again."""
    from spotring.checkpoint.manager import unwrap

    for obj in job._tracked.values():
        if isinstance(obj, nn.Module):
            job.engine.send_model(unwrap(obj), source)
        elif isinstance(obj, Optimizer):
            job.engine.send_optimizer(obj, source)
    small = [job._small_states()]
    dist.broadcast_object_list(small, src=source)
    job._load_small_states(small[0])
