"""What every checkpoint of a job holds, and how it is saved and restored on any world size.

    state = State(checkpoints, engine, seed)
    state.track(model=model, optimizer=optimizer, loader=loader, counters={...})
    state.annotate(model="resnet20")       # every manifest carries it; restore checks it
    state.save(scaler)                     # every rank calls it; rank 0 writes
    state.restore("auto", scaler)          # rank 0 reads and verifies; every rank loads

A checkpoint holds each tracked object's state_dict (a model as the plain module under
DDP's and torch.compile's wrappers, so that it loads on any world size and under either
engine) and spotring's own part: the step, every rank's RNG state and the gradient
scaler. Its manifest carries the step, the world size, the data position and the
annotations (spotring/checkpoint.py writes and verifies both). spotring.Job holds one
State; this module knows nothing of notices, metrics or exit codes.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch import nn

from spotring import runtime
from spotring.checkpoint import Checkpoint, Checkpoints, Saved, find_resume
from spotring.engines import Engine
from spotring.exits import ConfigError, Diverged

log = logging.getLogger("spotring")

# What a tracked object has that makes it the job's position in the data.
_POSITION = ("epoch", "offset", "global_batch", "steps_per_epoch")


class State:
    """The tracked objects of a job, its annotations, and where it stands: the step of
    the newest checkpoint written (``saved_step``) and the one resumed from."""

    def __init__(self, checkpoints: Checkpoints, engine: Engine, seed: int) -> None:
        self.checkpoints, self.engine, self.seed = checkpoints, engine, seed
        self.tracked: dict[str, Any] = {}
        self.annotations: dict[str, Any] = {}
        self.steps = 0  # optimizer steps, counted by the caller where no position is tracked
        self.start_step = 0  # the step this process started from (resumed, or 0)
        self.saved: Saved | None = None  # rank 0's newest checkpoint
        self.saved_step: int | None = None  # the step of the newest checkpoint written
        self.resumed_from: str | None = None  # the checkpoint restore() loaded

    def position(self) -> Any:
        """The tracked object that knows where in the data the run stands: a
        spotring.DataLoader, or another with the same position (epoch, offset,
        global_batch, steps_per_epoch), as the trainer's in-memory batches; or None."""
        return next((o for o in self.tracked.values()
                     if all(hasattr(o, a) for a in _POSITION)), None)

    @property
    def step_count(self) -> int:
        """Optimizer steps taken: from the tracked position (the same on every world
        size), else ``steps``."""
        position = self.position()
        if position is None:
            return self.steps
        if hasattr(position, "step"):  # a position that counts its steps itself
            return position.step
        return position.epoch * position.steps_per_epoch \
            + position.offset // position.global_batch

    def save(self, scaler: torch.amp.GradScaler) -> Saved | None:
        """Checkpoint the tracked state (a collective: rank 0 writes, and returns what it
        wrote; the others None). Raises Diverged where a tracked model's weights are not
        finite."""
        step = self.step_count
        for obj in self.tracked.values():
            # The ranks hold the same weights, so each comes to the same answer.
            if isinstance(obj, nn.Module) and not all(
                    bool(torch.isfinite(p).all()) for p in obj.parameters()):
                raise Diverged(step, float("nan"), "weights")
        rngs = self.engine.all_gather_object(runtime.rng_state())
        if self.engine.rank == 0:
            state = {name: _state_of(obj) for name, obj in self.tracked.items()}
            state["spotring"] = {"step": step, "rng": rngs,
                                 "world_size": self.engine.world_size,
                                 "scaler": scaler.state_dict()}
            position = self.position()
            meta = {"step": step, "world_size": self.engine.world_size, **self.annotations}
            if position is not None:
                meta |= {"epoch": position.epoch, "offset": position.offset,
                         "global_batch": position.global_batch}
            self.saved = self.checkpoints.save(state, meta)
            log.info("checkpoint %s, %s", self.saved.location, self.saved.describe())
        self.saved_step = step
        return self.saved

    def restore(self, source: str | Checkpoint | None,
                scaler: torch.amp.GradScaler) -> int | None:
        """Load a checkpoint into the tracked objects (a collective); its step, or None
        where there is none. ``source``: spotring.Job.restore's."""
        found = None
        if self.engine.rank == 0:
            checkpoint = (find_resume(source, self.checkpoints) if isinstance(source, str)
                          else source)
            if checkpoint is not None:
                checkpoint.check_matches(self.annotations)
            found = None if checkpoint is None else checkpoint.load() | {
                "source": checkpoint.location}
        found = self.engine.broadcast_object(found)
        if found is None:
            return None
        for name, obj in self.tracked.items():
            if name not in found:
                raise ConfigError(f"the checkpoint {found['source']} holds no {name!r} "
                                  f"(it holds {', '.join(k for k in found if k != 'source')})")
            _load_state(obj, found[name])
        meta = found["spotring"]
        if scaler.is_enabled() and meta.get("scaler"):
            scaler.load_state_dict(meta["scaler"])
        rank, world_size = self.engine.rank, self.engine.world_size
        if len(meta["rng"]) == world_size:
            runtime.set_rng_state(meta["rng"][rank])
        else:  # another world size: fresh, reproducible per-rank streams
            runtime.seed_all(hash((self.seed, rank, meta["step"])))
        self.steps = self.start_step = self.saved_step = meta["step"]
        self.resumed_from = found["source"]
        log.info("resumed from %s at step %d (%d workers then, %d now)", found["source"],
                 meta["step"], meta["world_size"], world_size)
        return meta["step"]


def unwrap(model: nn.Module) -> nn.Module:
    """The plain module under DDP's and torch.compile's wrappers: what to save or
    evaluate outside the job."""
    while True:
        inner = next((m for m in (getattr(model, "module", None),
                                  getattr(model, "_orig_mod", None))
                      if isinstance(m, nn.Module)), None)
        if inner is None:
            return model
        model = inner


def _state_of(obj: Any) -> Any:
    if isinstance(obj, nn.Module):
        return unwrap(obj).state_dict()
    if hasattr(obj, "state_dict"):
        return obj.state_dict()
    if isinstance(obj, dict):
        return dict(obj)
    raise TypeError(f"cannot checkpoint a {type(obj).__name__}: track objects with "
                    "state_dict() and load_state_dict(), or dicts")


def _load_state(obj: Any, state: Any) -> None:
    if isinstance(obj, nn.Module):
        unwrap(obj).load_state_dict(state)
    elif hasattr(obj, "load_state_dict"):
        obj.load_state_dict(state)
    else:
        obj.clear()
        obj.update(state)
