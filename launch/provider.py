"""Where nodes come from: one small interface, two providers.

    aws_spot   EC2 spot instances (launch/aws/)
    local      network namespaces on this machine, each with its own sshd (launch/local/)

The steps (up, run, down) see only this interface, so preemption recovery can ask
any provider to replace lost nodes and carry on with the same hostfile and job code.
Every provider is all or nothing: ``create`` returns ``count`` nodes or raises, having
removed what it made; ``destroy`` is idempotent and finds its resources by name or tag,
not by what this process remembers, so it also cleans up after a crash. It tries every
resource even when some deletions fail, then looks again and raises Leftovers naming
what is still there.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Node:
    id: str  # instance id, or the network namespace
    address: str  # where this machine reaches its sshd
    private_address: str  # where the other nodes reach it (the hostfile)
    slots: int  # ranks to start on it: its GPUs, or 1 without any
    type: str  # instance type, or "netns"
    zone: str
    lifecycle: str  # spot | on-demand | local
    state: str = "running"
    launched_at: float = 0.0  # seconds since the epoch
    price: float | None = None  # $/hour, where known

    def summary(self) -> str:
        where = (self.address if self.address == self.private_address
                 else f"{self.address} (private {self.private_address})")
        price = f", ${self.price:.4f}/hour" if self.price is not None else ""
        slots = f"{self.slots} slot{'s' if self.slots != 1 else ''}"
        return (f"{self.id} ({self.type}, {self.lifecycle}, {self.zone}) at {where}: {slots}, "
                f"{self.state}{price}")


class NoCapacity(RuntimeError):
    """No attempt got all the nodes; the message lists each attempt and why."""


class Leftovers(RuntimeError):
    """A teardown tried every resource and some are still there (or could not be looked
    up). The message names each and the command that tries again; ``deleted`` lists
    what went, one line each, as ``destroy`` returns them."""

    def __init__(self, teardown: Teardown, run_id: str, all_mine: bool):
        whose, again = (("your resources", "spotring down --all-mine") if all_mine else
                        (f"run {run_id}", f"spotring down run_id={run_id}"))
        lines = [f"{whose}: still there after every deletion was tried:",
                 *(f"  - {what}" for what in teardown.left)]
        if teardown.failed:
            lines += ["  because:", *(f"  - {why}" for why in teardown.failed)]
        lines.append(f"  `{again}` tries again")
        super().__init__("\n".join(lines))
        self.deleted = teardown.done


@dataclass
class Teardown:
    """A provider's deletions, each tried whatever became of the others: ``done``, one
    line per deletion; ``failed``, one line per call that failed with one of ``errors``
    (what may pass, or concerns one resource only); ``left``, what a last look found."""
    errors: tuple[type[BaseException], ...]
    done: list[str] = field(default_factory=list)
    failed: list[str] = field(default_factory=list)
    left: list[str] = field(default_factory=list)

    def attempt(self, what: str, call: Callable[[], object]) -> bool:
        """``call()``; one of ``errors`` is noted against ``what``, and False returned."""
        try:
            call()
            return True
        except self.errors as e:
            self.failed.append(f"{what}: {' '.join(str(e).split())}")  # one line
            return False

    def outcome(self, run_id: str, all_mine: bool) -> list[str]:
        """What ``destroy`` returns: ``done``; Leftovers if anything is ``left``."""
        if self.left:
            raise Leftovers(self, run_id, all_mine)
        return self.done


class Provider(ABC):
    name: str

    @property
    @abstractmethod
    def workdir(self) -> str:
        """Where the code goes: the same absolute path on every node."""

    @abstractmethod
    def plan(self, count: int) -> list[str]:
        """What ``create(count)`` would do, one line each; no side effect, no API call."""

    @abstractmethod
    def check(self) -> None:
        """Raise ConfigError on bad input; read-only. Runs before any resource exists."""

    @abstractmethod
    def create(self, count: int) -> list[Node]:
        """``count`` new nodes ready for SSH, or NoCapacity with nothing left behind."""

    @abstractmethod
    def describe(self) -> list[Node]:
        """The run's nodes as they are now (state included), node 0 first."""

    @abstractmethod
    def replace(self, lost: Sequence[Node]) -> list[Node]:
        """Remove ``lost`` and return as many new nodes (all or nothing)."""

    @abstractmethod
    def destroy(self, all_mine: bool = False) -> list[str]:
        """Delete the run's resources (all_mine: every run's of this owner), in
        dependency order; one line per deletion, none when nothing was left. A failed
        deletion does not stop the others; Leftovers if anything is still there."""

    def prices(self) -> list[tuple[str, str, float]]:
        """(instance type, zone, $/hour) of each type in the config, where known."""
        return []
