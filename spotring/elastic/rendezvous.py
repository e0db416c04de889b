"""The store the workers of a job in place meet in, and the generations of members they
record there.

    spotring rendezvous --port 29400          # on a machine that outlives the nodes
    SPOTRING_RENDEZVOUS=host:29400 torchrun ... python train.py   # init(in_place="auto")

The store is a torch.distributed TCPStore served by a process of its own, on a machine
that is not a training node (``spotring launch`` runs it beside the launcher): nothing
the job needs to go on lives only on one training node. Every process group of the job
is formed through it, each generation under a prefix of its own, so that a group formed
anew never meets the keys of the one before.

A generation is the job's members in rank order, recorded once under ``gen/N``: its
first by the founders (the processes a launcher started together, each claiming the slot
of its launcher's rank), every later one by the members of the one before, who all write
the same record (compare_set: the first write stands), at a step boundary (who leaves on
a notice, who joins) or after a collective failed (who answered the roll call).

    key                  value
    generation           N, the newest generation
    gen/N                {"members": [name, ...], "admitted": n}: ranks are places in it
    slot/R               the founder that claimed launcher rank R
    ready, ready/I       how many processes asked to join, and the I-th one's name
    alive/N/NAME         NAME answered the roll call after generation N's failure
    beat/NAME            NAME's heartbeat: a count its process adds to every BEAT_S
    failed/N             a member of generation N met a lost worker: every member gives
                         up the collectives it waits in (its heartbeat's thread reads it)
    ended                set by each member whose job ends as a whole (done, or stopped
                         where the others could not go on), before it exits: a process
                         that exits without it left the job (lost, a notice, a crash),
                         which its launcher may replace (``ended``)
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta

import torch.distributed as dist

from spotring.polling import poll

_PREFIX = "spotring/"
# Every member's process adds to its heartbeat this often, from a thread of its own, so
# that it beats while its training thread computes or waits in a collective; one whose
# heartbeat stands still for DEAD_S is gone (or hung: a host cut off, a process stopped).
# After a collective failed, the roll call closes once every member answered or is gone,
# or after engine.timeout_s (a member that beats but never comes to answer, stuck in a
# wait no failure ends, is counted out: it joins again once it comes).
# A member silent for SILENT_S while the others wait in a collective is taken as lost
# (its host cut off with its connections open: no collective fails by itself then, until
# engine.timeout_s); long enough that a process descheduled on a loaded host is not. Each
# member reads the others' heartbeats for it every WATCH_S (one request per member).
BEAT_S, DEAD_S, SILENT_S, WATCH_S = 0.2, 1.0, 10.0, 1.0


class JobEnded(Exception):
    """The job ended as a whole while this process waited to join it."""


@dataclass(frozen=True)
class Generation:
    """The job's members from one change to the next: ``members`` in rank order, and how
    many of the processes that asked to join had been ``admitted`` by then."""

    number: int
    members: tuple[str, ...]
    admitted: int = 0

    def rank_of(self, name: str) -> int:
        return self.members.index(name)

    @property
    def prefix(self) -> str:
        """The prefix of this generation's process group in the store."""
        return f"{_PREFIX}pg/{self.number}/"


def connect(address: str, timeout_s: float) -> dist.Store:
    """A client of the store at ``address`` (host:port); every request waits at most
    ``timeout_s``. ConnectionError naming it where none answers."""
    host, _, port = address.rpartition(":")
    try:
        return dist.TCPStore(host, int(port), None, False, timeout=timedelta(seconds=timeout_s),
                             wait_for_workers=False)
    except (RuntimeError, dist.DistStoreError) as e:
        raise ConnectionError(f"no rendezvous store answers at {address} ({e}): start one "
                              "with `spotring rendezvous`, and give its host:port as "
                              "$SPOTRING_RENDEZVOUS") from e


class Rendezvous:
    """This process's view of the generations in ``store``, as member ``name``."""

    def __init__(self, store: dist.Store, name: str, timeout_s: float) -> None:
        self.store, self.name, self.timeout_s = store, name, timeout_s

    def _get(self, key: str) -> str | None:
        return self.store.get(_PREFIX + key).decode() if self.store.check([_PREFIX + key]) \
            else None

    def generation(self, number: int) -> Generation | None:
        record = self._get(f"gen/{number}")
        if record is None:
            return None
        found = json.loads(record)
        return Generation(number, tuple(found["members"]), found["admitted"])

    def newest(self) -> Generation | None:
        number = self._get("generation")
        return None if number is None else self.generation(int(number))

    def record(self, number: int, members: list[str], admitted: int) -> Generation:
        """Generation ``number`` as the first of its writers proposed it (every writer of
        a planned change proposes the same)."""
        proposal = json.dumps({"members": members, "admitted": admitted})
        stood = self.store.compare_set(f"{_PREFIX}gen/{number}", "", proposal).decode()
        self.store.set(f"{_PREFIX}generation", str(number))
        found = json.loads(stood)
        return Generation(number, tuple(found["members"]), found["admitted"])

    # ------------------------------------------------------------------- founding

    def found(self, rank: int, world_size: int) -> Generation | None:
        """Generation 0 where this process is one of the ``world_size`` a launcher started
        together, as ``rank``: once every founder claimed its slot. None where the job
        began without it (a process started again, or to join): it joins instead."""
        if self.newest() is not None:
            return None
        claimed = self.store.compare_set(f"{_PREFIX}slot/{rank}", "", self.name).decode()
        if claimed != self.name:
            return None
        slots = [f"{_PREFIX}slot/{r}" for r in range(world_size)]
        try:
            self.store.wait(slots, timedelta(seconds=self.timeout_s))
        except (RuntimeError, dist.DistStoreError) as e:
            raise TimeoutError(f"{len(slots)} workers were to start the job; within "
                               f"{self.timeout_s:g} s (engine.timeout_s) only these did: "
                               f"{[r for r in range(world_size) if self.store.check([slots[r]])]}"
                               ) from e
        members = [self.store.get(slot).decode() for slot in slots]
        return self.record(0, members, 0)

    # -------------------------------------------------------------------- joining

    def ask_to_join(self) -> None:
        """Ask the members to take this process in at their next step boundary."""
        place = self.store.add(f"{_PREFIX}ready", 1) - 1
        self.store.set(f"{_PREFIX}ready/{place}", self.name)

    def waiting(self, generation: Generation) -> int:
        """How many processes asked to join since ``generation`` admitted its own."""
        return self.store.add(f"{_PREFIX}ready", 0) - generation.admitted

    def joiners(self, generation: Generation, count: int) -> list[str]:
        """The names of the ``count`` processes that asked to join after ``generation``'s."""
        return [self.store.get(f"{_PREFIX}ready/{i}").decode()
                for i in range(generation.admitted, generation.admitted + count)]

    def admitted(self, after: int) -> Generation:
        """The first generation after ``after`` that counts this process a member; waits
        for it (TimeoutError after timeout_s: no member took it in; JobEnded where the
        job ended meanwhile)."""
        def taken_in() -> Generation | None:
            if ended(self.store):
                raise JobEnded("the job ended before its members took this process in")
            newest = self.newest()
            if newest is None or newest.number <= after:
                return None
            for number in range(after + 1, newest.number + 1):
                found = self.generation(number)
                if found is not None and self.name in found.members:
                    return found
            return None

        return poll(taken_in, timeout_s=self.timeout_s, interval_s=0.02,
                    what=f"the job's members to take {self.name} in (engine.timeout_s)")

    def end(self) -> None:
        """Say that the job ends as a whole: this member exits with every other."""
        self.store.set(f"{_PREFIX}ended", self.name)

    # ---------------------------------------------------------------- the roll call

    def beat(self) -> None:
        """One heartbeat of this member (its process's beating thread calls it every
        BEAT_S, over a client of its own)."""
        self.store.add(f"{_PREFIX}beat/{self.name}", 1)

    def still(self, members: list[str], seen: dict[str, tuple[int, float]],
              seconds: float) -> list[str]:
        """Those of ``members`` whose heartbeat has stood still for ``seconds``, as the
        caller has watched them: ``seen`` (the caller's, kept from call to call) holds
        each one's last heartbeat and when it was first seen."""
        now, still = time.monotonic(), []
        for member in members:
            beat = self.store.add(f"{_PREFIX}beat/{member}", 0)
            if seen.get(member, (None,))[0] != beat:
                seen[member] = (beat, now)
            elif now - seen[member][1] >= seconds:
                still.append(member)
        return still

    def flag_failed(self, generation: int) -> None:
        """Tell every member of ``generation`` that a worker of it is lost."""
        self.store.set(f"{_PREFIX}failed/{generation}", self.name)

    def failed_in(self, generation: int) -> str | None:
        """The member that found ``generation`` lost a worker, or None."""
        return self._get(f"failed/{generation}")

    def survivors(self, generation: Generation,
                  keep: Callable[[list[str]], list[str]] = list) -> Generation:
        """Generation ``generation.number + 1`` after a collective of ``generation``
        failed: the members that answered the roll call, in their old order, those
        ``keep`` keeps of them (the whole copies of the model). Each survivor answers,
        and waits until every member answered or is gone (its heartbeat still for
        DEAD_S), for at most timeout_s; the first to be done proposes who answered, and
        every survivor takes that record, whoever is in it (one not in it joins again)."""
        number = generation.number
        self.store.set(f"{_PREFIX}alive/{number}/{self.name}", "1")
        beats: dict[str, tuple[int, float]] = {}  # a member's last heartbeat, when seen
        closes = time.monotonic() + self.timeout_s
        while True:
            stood = self.generation(number + 1)
            if stood is not None:
                return stood
            answered = [m for m in generation.members
                        if self.store.check([f"{_PREFIX}alive/{number}/{m}"])]
            gone = self.still([m for m in generation.members if m not in answered], beats,
                              DEAD_S)
            if (len(answered) + len(gone) == len(generation.members)
                    or time.monotonic() > closes):
                return self.record(number + 1, keep(answered), generation.admitted)
            time.sleep(0.02)


def ended(store: dist.Store) -> bool:
    """Whether a member of the job in ``store`` said the job ends as a whole: a process of
    it that exits now is not one to replace."""
    return store.check([f"{_PREFIX}ended"])


def serve(host: str, port: int) -> dist.TCPStore:
    """A store server at host:port (port 0: a free one; ``.port`` says which)."""
    return dist.TCPStore(host, port, None, True, timeout=timedelta(seconds=300),
                         wait_for_workers=False)


def main(argv: list[str]) -> int:
    """`spotring rendezvous`: serve the store until stopped (SIGTERM, Ctrl-C)."""
    parser = argparse.ArgumentParser(
        prog="spotring rendezvous",
        description="Serve the store the workers of a job in place meet in "
                    "(spotring.ElasticOptions, docs/elastic.md), on a machine that outlives "
                    "the training nodes. Give its host:port to every worker as "
                    "$SPOTRING_RENDEZVOUS.")
    parser.add_argument("--host", default="0.0.0.0", help="the address to listen on")
    parser.add_argument("--port", type=int, default=29400, help="0: a free port")
    args = parser.parse_args(argv)
    store = serve(args.host, args.port)
    print(f"spotring: rendezvous at {args.host}:{store.port}", flush=True)
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
