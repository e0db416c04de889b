"""Where nodes come from: one small interface, two providers.

    aws_spot   EC2 spot instances (launch/aws/)
    local      network namespaces on this machine, each with its own sshd (launch/local/)

The steps (up, run, down) see only this interface, so preemption recovery can ask
any provider to replace lost nodes and carry on with the same hostfile and job code.
Every provider is all or nothing: ``create`` returns ``count`` nodes or raises, having
removed what it made; ``destroy`` is idempotent and finds its resources by name or tag,
not by what this process remembers, so it also cleans up after a crash.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass


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
        dependency order; one line per deletion, none when nothing was left."""

    def prices(self) -> list[tuple[str, str, float]]:
        """(instance type, zone, $/hour) of each type in the config, where known."""
        return []
