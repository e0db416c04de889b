"""spotring's options: one typed class for each group, and the one way a bad value is
reported.

    EngineOptions       name, backend, timeout_s; each engine's own class adds its options
                        (spotring/engines/: DDPOptions, FSDPOptions, HorovodOptions)
    CheckpointOptions   dir, uri, keep, background, sharded: where checkpoints go, how
    PreemptionOptions   notices, poll_seconds, check_every_steps: spot notices and their vote
    ElasticOptions      in_place, min_workers, rendezvous: workers lost and gained in place

Each is a dataclass that states its fields, their types and defaults once: spotring.init
builds them from its keywords or takes them as they are, and the built-in trainer's Hydra
schema is made of them (its ``engine`` node is the engine's class, its ``checkpoint`` and
``preemption`` nodes extend or are these), so a choice or a default is written here only.
Free of torch, so that a launcher can compose the trainer's config without it.

A field typed with a ``Choice`` takes no other value: OmegaConf refuses any other as a
Hydra config is composed, naming the valid ones; where a value comes from a Python call
instead (spotring.init), ``problems`` words the refusal the same way (``one_of``).
"""

from __future__ import annotations

import dataclasses
import difflib
import os
import typing
from collections.abc import Iterable
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import TYPE_CHECKING, Any

from spotring import contract, metadata
from spotring.exits import ConfigError
from spotring.stores import uri_problem

if TYPE_CHECKING:
    from spotring.checkpoint.layout import Checkpoints


class Choice(str, Enum):
    """One of a field's fixed values: a field of such a type takes no other, OmegaConf
    refuses any other as the config is composed, naming the valid ones. Each is named as
    it reads, and prints, formats, compares and hashes as that string (enum.StrEnum does
    this from Python 3.11 on)."""

    def __str__(self) -> str:
        return self.value

    def __format__(self, spec: str) -> str:
        return format(self.value, spec)


def choices(name: str, values: str) -> type[Choice]:
    """A Choice type of the space-separated ``values``: choices("Backend", "auto gloo")."""
    return Choice(name, [(value, value) for value in values.split()])


def one_of(key: str, value: Any, valid: Iterable[Any]) -> str | None:
    """A problem line if ``value`` is not in ``valid``, with a close match when there is one
    ("engine=hvd: unknown (did you mean horovod?); valid: ddp, horovod")."""
    valid = [str(v) for v in valid]
    if str(value) in valid:
        return None
    close = difflib.get_close_matches(str(value), valid, n=1)
    hint = f" (did you mean {close[0]}?)" if close else ""
    return f"{key}={value}: unknown{hint}; valid: {', '.join(valid)}"


def require_one_of(key: str, value: Any, valid: Iterable[Any]) -> None:
    """Raise ConfigError with ``one_of``'s line where ``value`` is not in ``valid``."""
    if problem := one_of(key, value, valid):
        raise ConfigError(problem)


def positive(prefix: str = "", **values: float | None) -> list[str]:
    """A problem line for each of ``values`` (by key, after ``prefix``) that is set and not
    above zero."""
    return [f"{prefix}{key}={value}: must be positive" for key, value in values.items()
            if value is not None and not value > 0]


Backend = choices("Backend", "auto nccl gloo mpi")
Device = choices("Device", "auto cpu cuda")
Precision = choices("Precision", "auto fp32 bf16 fp16")
Notices = choices("Notices", " ".join(["auto", *metadata.SOURCES, "none"]))
InPlace = choices("InPlace", "off auto on")


class Options:
    """What spotring's option classes share: ``problems``, the values the class refuses."""

    def problems(self, prefix: str = "") -> list[str]:
        """What is wrong with these values, one line each, every key after ``prefix``
        ("engine." in the trainer's config): here, a field typed with a Choice holding
        another value. Subclasses add their ranges."""
        hints = typing.get_type_hints(type(self))
        found = []
        for field in dataclasses.fields(self):  # type: ignore[arg-type]
            choice = _choice_of(hints[field.name])
            value = getattr(self, field.name)
            if choice is not None and value is not None:
                found += filter(None, [one_of(prefix + field.name, value, choice)])
        return found

    def replaced(self, what: str, **values: Any) -> Options:
        """A copy with ``values`` (those not None) in place of its own; a key the class
        lacks is a ConfigError naming it, the class and its keys, as options of ``what``
        ("engine=horovod")."""
        given = {key: value for key, value in values.items() if value is not None}
        names = [field.name for field in dataclasses.fields(self)]  # type: ignore[arg-type]
        if unknown := [key for key in given if key not in names]:
            raise ConfigError(
                f"{', '.join(unknown)}: not an option of {what} ({type(self).__name__}: "
                f"{', '.join(n for n in names if n != 'name')})")
        return dataclasses.replace(self, **given)  # type: ignore[type-var]


def _choice_of(hint: Any) -> type[Choice] | None:
    """The Choice type a field's annotation names, alone or with None."""
    for candidate in (hint, *typing.get_args(hint)):
        if isinstance(candidate, type) and issubclass(candidate, Choice):
            return candidate
    return None


@dataclass
class EngineOptions(Options):
    """What every engine takes; each engine's own class (spotring/engines/) extends it with
    its own options and sets ``name``.

    name: the engine, as spotring.init's ``engine=`` and the trainer's ``engine=`` name it.
    backend: the transport of the gradients' allreduce. auto: NCCL on GPUs, Gloo on CPUs;
        mpi: over MPI on CPUs, under mpirun (ddp through mpi4py, horovod its own); nccl,
        gloo: that one.
    timeout_s: seconds a collective waits for a peer before the job fails naming the
        missing rank (exit 69). Generous by default: a first NCCL allreduce can take a while.
    """

    name: str = ""
    backend: Backend = Backend.auto
    timeout_s: float = 300.0

    def problems(self, prefix: str = "", *, compile: bool = False,
                 precision: str = "fp32") -> list[str]:
        """What is wrong with these values, one line each, every key after ``prefix``;
        ``compile``: the model will be torch.compiled, ``precision``: it will train at this
        precision (auto, fp32, bf16, fp16), either of which some engines cannot go with."""
        return super().problems(prefix) + positive(prefix, timeout_s=self.timeout_s)

    def in_place_problem(self, world_size: int) -> str | None:
        """Why an engine that runs in place cannot with these options on ``world_size``
        workers, or None."""
        return None


@dataclass
class CheckpointOptions(Options):
    """Where the job's checkpoints go.

    dir: the checkpoint directory, where every rank writes its part (rank 0's path, on
        each host); default the run directory's checkpoints/.
    uri: the store every checkpoint is also uploaded to (so that a new node resumes after
        the old one vanished): s3://bucket/prefix, gs://bucket/prefix,
        az://container/prefix, or a directory every host mounts (spotring/stores/);
        default $SPOTRING_CHECKPOINT_URI, which spotring's launchers set
        (spotring/contract.py), else none.
    keep: checkpoints kept in each store; older ones are deleted.
    background: a periodic save (spotring.Job.save) returns once the state is copied to
        CPU memory and is written, uploaded and verified while training goes on (at most
        one in flight); the save on a notice is always written at once. False: every save
        is complete before it returns.
    sharded: every rank writes its part of each checkpoint and reads back what it needs
        (spotring/checkpoint/manager.py). Default (None): where every rank can read every part, that
        is on one host or with a uri; else rank 0 gathers the state and writes it alone.
        False: rank 0 alone, always.
    """

    dir: str | None = None
    uri: str | None = None
    keep: int = 3
    background: bool = True
    sharded: bool | None = None

    def problems(self, prefix: str = "") -> list[str]:
        """Options.problems (keys after ``prefix``), and keep's and uri's."""
        found = super().problems(prefix) + positive(prefix, keep=self.keep)
        if self.uri is not None and (problem := uri_problem(self.uri, f"{prefix}uri")):
            found.append(problem)
        return found

    def open(self, run_dir: str | os.PathLike) -> Checkpoints:
        """The checkpoint stores of a run writing in ``run_dir``, with the defaults above
        applied; ConfigError for a uri of no store, the option's or the launcher's
        variable's (spotring.stores.uri_problem, naming which). Makes no request:
        Checkpoints.check_access does."""
        from spotring.checkpoint.layout import Checkpoints

        uri, key = ((self.uri, "checkpoint.uri") if self.uri
                    else (contract.checkpoint_uri(), contract.CHECKPOINT_URI))
        return Checkpoints(self.dir or Path(run_dir) / "checkpoints", self.keep, uri,
                           background=self.background, sharded=self.sharded, key=key)


@dataclass
class PreemptionOptions(Options):
    """How the job watches for spot notices and agrees on them (spotring/preemption.py).

    notices: whose spot notices local rank 0 of each node watches for
        (spotring/metadata.py). auto: whichever of EC2's, GCP's and Azure's metadata
        services answers (off every cloud the watcher gives up within seconds); ec2: an
        interruption notice or a rebalance recommendation (a checkpoint, and the job goes
        on); gcp: the preempted flag of a spot or preemptible VM, in a request the
        server holds until the flag changes; azure: a Preempt scheduled event; none: no
        watching. SIGTERM and SIGUSR1 stop the job whichever it is.
    poll_seconds: between two requests to a metadata service that answers at once (EC2's,
        Azure's; GCP's where it will not hold a request), so a notice reaches the job
        within it. Each costs under a millisecond of CPU (at 0.5 s, 7 to 9 CPU seconds an
        hour); Azure's service takes at most 5 requests a second from a VM, its other
        users' included.
    check_every_steps: optimizer steps between the ranks' votes on a stop (one tiny
        allreduce each). None, the default: as many as keep the votes
        near 1% of the steps' time but span at most about a second, from the step time
        and the vote's cost as the job measures them, and the same on every rank. A
        notice is acted on within that interval and one step.
    """

    notices: Notices = Notices.auto
    poll_seconds: float = 0.5
    check_every_steps: int | None = None

    def problems(self, prefix: str = "") -> list[str]:
        """Options.problems (keys after ``prefix``), and the ranges of the numbers."""
        return super().problems(prefix) + positive(
            prefix, poll_seconds=self.poll_seconds, check_every_steps=self.check_every_steps)


@dataclass
class ElasticOptions(Options):
    """How the job goes on when it loses or gains workers (spotring/elastic/).

    in_place: default $SPOTRING_IN_PLACE (a launcher that runs jobs in place sets it),
        else off. off: a lost worker stops every rank (a notice: a checkpoint and exit 75;
        a loss without notice: exit 69), and a launcher starts the job again. auto: the
        other workers go on in place, with the same global batches, where they can (the
        DDP engine; the global batch splits over them; at least min_workers), and a
        worker started with the job's rendezvous joins at a step boundary; where they
        cannot, today's path, with a line that says why. on: as auto, and an engine or a
        launch that cannot run in place is bad input (exit 2) at init.
    min_workers: the fewest workers that go on in place; fewer take today's path.
    rendezvous: host:port of the store the job's workers meet in, which outlives every
        training node (``spotring rendezvous`` serves one; ``spotring launch`` runs it);
        default $SPOTRING_RENDEZVOUS. In place needs one.
    save_on_leave: where workers leave on a notice, every rank first writes the
        checkpoint of that step (as today's path would), so that the job could still
        start again from it; False: the others go on at once.
    """

    in_place: InPlace | None = None
    min_workers: int = 1
    rendezvous: str | None = None
    save_on_leave: bool = True

    def problems(self, prefix: str = "") -> list[str]:
        """Options.problems (keys after ``prefix``), min_workers' range and rendezvous's
        form."""
        found = super().problems(prefix) + positive(prefix, min_workers=self.min_workers)
        if self.rendezvous is not None and not _host_port(self.rendezvous):
            found.append(f"{prefix}rendezvous={self.rendezvous}: expected host:port, such "
                         "as 10.0.0.1:29400")
        return found

    def resolved(self) -> ElasticOptions:
        """These options with in_place and rendezvous from the launcher's variables
        ($SPOTRING_IN_PLACE, $SPOTRING_RENDEZVOUS) where unset; ConfigError for a variable
        of no such value."""
        in_place = self.in_place
        if in_place is None:
            in_place = contract.in_place() or "off"
            if problem := one_of(contract.IN_PLACE, in_place, InPlace):
                raise ConfigError(problem)
        return dataclasses.replace(self, in_place=in_place,
                                   rendezvous=self.rendezvous or contract.rendezvous())


def _host_port(address: str) -> bool:
    host, _, port = address.rpartition(":")
    return bool(host) and port.isdigit() and 0 < int(port) < 65536

