"""What every checkpoint of a job holds, and how it is saved and restored on any world size.

    state = State(checkpoints, engine, seed)
    state.tracked.update(model=model, optimizer=optimizer, loader=loader, counters={...})
    state.annotations.update(model="resnet20")   # every manifest carries it; restore checks it
    state.save(scaler, background=True)          # every rank calls it; every rank writes
    state.restore("auto", scaler)                # every rank reads what it needs

A checkpoint holds each tracked model's and optimizer's state as
torch.distributed.checkpoint's state dicts (``get_state_dict``: keyed by parameter names,
whatever wraps the model, sharded where FSDP shards it), which every rank writes its part
of and reads back onto any world size and any engine (spotring/sharded.py), and beside
them, written by rank 0, the other tracked objects' states and spotring's own: the step,
every rank's RNG state and the gradient scaler (spotring/checkpoint.py publishes and
verifies the parts).

Who writes: every rank its part where every rank can read every part back, that is where
the ranks share one host (one disk) or checkpoint.uri names S3; where they run on hosts
of their own with nothing shared, rank 0 gathers the whole state and writes it alone,
and restores it by sending each rank its part.

A background save (``background=True``) returns once this rank's share of the state (the
pieces it will write) is copied to CPU memory; a thread writes, uploads and publishes it
while training goes on; at most one is in flight, and any other save, a restore or the
end of the job first waits for it.
spotring.Job holds one State; this module knows nothing of notices, metrics or exit codes.
"""

from __future__ import annotations

import io
import logging
import math
import socket
import threading
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.optim import Optimizer

from spotring import runtime, sharded
from spotring.checkpoint import (
    EXTRAS,
    SINGLE_FILE,
    Checkpoint,
    Checkpoints,
    Saved,
    find_resume,
)
from spotring.engines import Engine
from spotring.exits import ConfigError, Diverged
from spotring.stores import DirectoryStore

log = logging.getLogger("spotring")

# What a tracked object has that makes it the job's position in the data.
_POSITION = ("epoch", "offset", "global_batch", "steps_per_epoch")
_FULL = StateDictOptions(full_state_dict=True, cpu_offload=True)


class State:
    """The tracked objects of a job, its annotations, and where it stands: the step of
    the newest checkpoint written (``saved_step``) and the one resumed from.

    sharded: CheckpointOptions.sharded (None: where every rank reads every part back).
    notice_seconds: how long the cloud's notice gives (read after each save, to warn
    once where a checkpoint would not fit in it)."""

    def __init__(self, checkpoints: Checkpoints, engine: Engine, seed: int,
                 sharded: bool | None = None,
                 notice_seconds: Callable[[], float] = lambda: 120.0) -> None:
        self.checkpoints, self.engine, self.seed = checkpoints, engine, seed
        self.sharded = sharded
        self.notice_seconds = notice_seconds
        self.tracked: dict[str, Any] = {}
        self.annotations: dict[str, Any] = {}
        self.steps = 0  # optimizer steps, counted by the caller where no position is tracked
        self.start_step = 0  # the step this process started from (resumed, or 0)
        self.saved: Saved | None = None  # the newest checkpoint published (rank 0's view)
        self.saved_step: int | None = None  # the step of the newest checkpoint begun
        self.resumed_from: str | None = None  # the checkpoint restore() loaded
        self._comm: sharded.Comm | None = None
        self._shared = True  # every rank on one host
        self._stager: sharded.Stager | None = None
        self._pending: threading.Thread | None = None
        self._failed: BaseException | None = None  # the background save's
        self._warned = False

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

    # ------------------------------------------------------------------------------ save

    def save(self, scaler: torch.amp.GradScaler, background: bool = False) -> Saved | None:
        """Checkpoint the tracked state (a collective). Blocking: returns once it is
        published (rank 0 gets what was written, the others too); background: once it is
        copied to CPU memory (None; ``saved`` follows when done). Raises Diverged where a
        tracked model's weights are not finite on any rank."""
        self.wait()
        step = self.step_count
        self._check_finite(step)
        comm = self._collectives()
        rngs = self.engine.all_gather_object(runtime.rng_state())
        extras = {name: _state_of(obj) for name, obj in self.tracked.items()
                  if not _is_tensor_state(obj)}
        extras["spotring"] = {"step": step, "rng": rngs, "world_size": self.engine.world_size,
                              "scaler": scaler.state_dict()}
        meta = {"step": step, "world_size": self.engine.world_size, **self.annotations}
        if (position := self.position()) is not None:
            meta |= {"epoch": position.epoch, "offset": position.offset,
                     "global_batch": position.global_batch}
        whole = not self.sharded if self.sharded is not None else not (
            self._shared or self.checkpoints.remote is not None)
        state = self._tensor_state(_FULL if whole else None)
        if whole:  # rank 0 alone writes, the others are done
            comm = sharded.ALONE
            if self.engine.rank != 0:
                self.saved_step = step
                return None
        if background:
            if self._stager is None:
                self._stager = sharded.Stager(pinned=self.engine.device.type == "cuda")
            state = self._stager.stage(state, comm)
            self._pending = threading.Thread(
                target=self._write_in_background, args=(state, meta, extras, comm),
                name=f"spotring-checkpoint-{step}", daemon=True)
            self.saved_step = step
            self._pending.start()
            return None
        self.saved_step = step
        return self._write(state, meta, extras, comm)

    def _write(self, state: dict[str, Any] | sharded.Staged, meta: dict[str, Any],
               extras: dict[str, Any], comm: sharded.Comm) -> Saved:
        saved = self.checkpoints.save(state, meta, extras, comm,
                                      cleans=self.engine.local_rank == 0)
        self.saved = saved
        if self.engine.rank == 0:
            log.info("checkpoint %s, %s", saved.location, saved.describe())
            self._warn_if_too_slow(saved)
        return saved

    def _write_in_background(self, *args: Any) -> None:
        try:
            self._write(*args)
        except BaseException as e:  # raised on the training thread, by wait()
            self._failed = e

    def wait(self) -> None:
        """Until the background save in flight (if any) is published; re-raises its error."""
        if self._pending is not None:
            self._pending.join()
            self._pending = None
        if (failed := self._failed) is not None:
            self._failed = None
            raise failed

    def _warn_if_too_slow(self, saved: Saved) -> None:
        """Rank 0, once: say so where a checkpoint takes longer than the notice gives."""
        window = self.notice_seconds()
        spent = max(saved.seconds.values())
        if self._warned or spent <= window:
            return
        self._warned = True
        world = self.engine.world_size
        log.warning(
            "a checkpoint took %.1f s from its start to verified on every store (%.1f MB "
            "from the busiest of %d ranks), more than the %g s a spot notice gives: a notice "
            "would lose it and the steps since the last one. About %d workers would write "
            "their shares in time (each writes about 1/W of the state), or save more often "
            "in the background (checkpoint.background=true), so that a notice costs fewer "
            "steps", spent, saved.rank_bytes / 1e6, world, window,
            math.ceil(world * spent / window))

    def _check_finite(self, step: int) -> None:
        # A sum is NaN or infinite where any element is (or where the weights are so
        # large that it overflows: diverged too), at a tenth of isfinite's cost, which a
        # background save's stall would pay. Summed in float32 at least: a float16 sum of
        # a large layer of ones would overflow.
        sums = [_local(p).sum(dtype=torch.promote_types(p.dtype, torch.float32)).double()
                for obj in self.tracked.values() if isinstance(obj, nn.Module)
                for p in obj.parameters()]
        bad = bool(sums) and not bool(torch.isfinite(torch.stack(sums)).all())
        if self.engine.world_size > 1:  # FSDP's ranks hold different shards: agree
            votes = torch.tensor([float(bad)], device=self.engine.device)
            bad = bool(self.engine.all_reduce_sum(votes, "finite").item() > 0)
        if bad:
            raise Diverged(step, float("nan"), "weights")

    # --------------------------------------------------------------------------- restore

    def restore(self, source: str | Checkpoint | None,
                scaler: torch.amp.GradScaler) -> int | None:
        """Load a checkpoint into the tracked objects (a collective); its step, or None
        where there is none. ``source``: spotring.Job.restore's (rank 0's counts). With
        "auto" the candidates are tried newest first; one with a part missing, short or
        corrupt (each rank checks its share of the parts) is reported and skipped. A
        checkpoint named (a path, a Checkpoint) with such a part is refused, ConfigError."""
        self.wait()
        comm = self._collectives()
        candidates = None
        if self.engine.rank == 0:
            found = (find_resume(source, self.checkpoints) if isinstance(source, str)
                     else [] if source is None else [source])
            candidates = [self._portable(c) for c in found]
        for portable in comm.broadcast(candidates):
            checkpoint = self._rebuild(portable)
            whole = checkpoint.format == SINGLE_FILE or (
                isinstance(checkpoint.store, DirectoryStore) and not self._shared)
            if problems := self._problems(checkpoint, comm, whole):
                if source != "auto":  # the checkpoint asked for by name: none other
                    raise ConfigError(f"resume={checkpoint.location}: "
                                      + "; ".join(problems))
                if self.engine.rank == 0:
                    log.warning("skipping checkpoint: %s", "; ".join(problems))
                continue
            checkpoint.check_matches(self.annotations)
            extras = self._load(checkpoint, comm, whole)
            return self._resumed(checkpoint, extras, scaler)
        return None

    def _problems(self, checkpoint: Checkpoint, comm: sharded.Comm, whole: bool) -> list[str]:
        """What the ranks found wrong with ``checkpoint``: rank 0 alone checks every part
        where it alone reads them (``whole``), else each rank its share."""
        if whole:
            return comm.broadcast(checkpoint.problems(checkpoint.parts())
                                  if comm.rank == 0 else None)
        share = sorted(checkpoint.parts())[comm.rank::comm.world_size]
        return sorted({p for found in comm.all_gather(checkpoint.problems(share)) for p in found})

    def _load(self, checkpoint: Checkpoint, comm: sharded.Comm, whole: bool) -> dict[str, Any]:
        """The tensors into the tracked models and optimizers; returns the rest."""
        if not whole:
            state = self._tensor_state()
            source = (sharded.LocalFolder(checkpoint.store.path / checkpoint.folder)
                      if isinstance(checkpoint.store, DirectoryStore)
                      else sharded.S3Folder(checkpoint.store, checkpoint.folder))
            sharded.read(state, source, comm)
            self._apply(state, None)
            extras = checkpoint.store.read(f"{checkpoint.folder}/{EXTRAS}")
            return torch.load(io.BytesIO(extras), map_location="cpu", weights_only=True)
        loaded = checkpoint.load() if comm.rank == 0 else {}
        if comm.rank == 0 and checkpoint.format == SINGLE_FILE:
            loaded = self._named_optimizer_states(loaded)
        full = StateDictOptions(full_state_dict=True, broadcast_from_rank0=not comm.alone)
        self._apply(loaded, full)
        return comm.broadcast({k: v for k, v in loaded.items()
                               if k not in self.tracked or not _is_tensor_state(self.tracked[k])}
                              if comm.rank == 0 else None)

    def _resumed(self, checkpoint: Checkpoint, extras: dict[str, Any],
                 scaler: torch.amp.GradScaler) -> int:
        for name, obj in self.tracked.items():
            if _is_tensor_state(obj):
                continue
            if name not in extras:
                raise ConfigError(f"the checkpoint {checkpoint.location} holds no {name!r} "
                                  f"(it holds {', '.join(k for k in extras if k != 'spotring')})")
            _load_state(obj, extras[name])
        meta = extras["spotring"]
        if scaler.is_enabled() and meta.get("scaler"):
            scaler.load_state_dict(meta["scaler"])
        rank, world_size = self.engine.rank, self.engine.world_size
        if len(meta["rng"]) == world_size:
            runtime.set_rng_state(meta["rng"][rank])
        else:  # another world size: fresh, reproducible per-rank streams
            runtime.seed_all(hash((self.seed, rank, meta["step"])))
        self.steps = self.start_step = self.saved_step = meta["step"]
        self.resumed_from = checkpoint.location
        log.info("resumed from %s at step %d (%d workers then, %d now)", checkpoint.location,
                 meta["step"], meta["world_size"], world_size)
        return meta["step"]

    # ---------------------------------------------------------------------- the tensors

    def _tensor_state(self, options: StateDictOptions | None = None) -> dict[str, Any]:
        """The tracked models' and optimizers' state dicts, by tracked name, keyed by
        parameter name (sharded where the engine shards; whole on rank 0 with _FULL)."""
        state = {}
        for name, obj in self.tracked.items():
            if isinstance(obj, nn.Module):
                state[name] = get_model_state_dict(unwrap(obj), options=options)
            elif isinstance(obj, Optimizer):
                state[name] = get_optimizer_state_dict(self._model_of(name, obj), obj,
                                                       options=options)
        return state

    def _apply(self, state: dict[str, Any], options: StateDictOptions | None) -> None:
        """``state``'s tensors into the tracked models and optimizers (with broadcast
        options: rank 0's whole state, sent to the others)."""
        for name, obj in self.tracked.items():
            if _is_tensor_state(obj) and name not in state and self.engine.rank == 0:
                raise ConfigError(f"the checkpoint holds no {name!r} (it holds "
                                  f"{', '.join(k for k in state if k != 'spotring')})")
        for name, obj in self.tracked.items():
            if isinstance(obj, nn.Module):
                set_model_state_dict(unwrap(obj), state.get(name, {}), options=options)
        for name, obj in self.tracked.items():
            if isinstance(obj, Optimizer):
                set_optimizer_state_dict(self._model_of(name, obj), obj, state.get(name, {}),
                                         options=options)

    def _model_of(self, name: str, optimizer: Optimizer) -> nn.Module:
        """The tracked model whose parameters ``optimizer`` steps (its state is keyed by
        their names in it)."""
        params = {id(p) for group in optimizer.param_groups for p in group["params"]}
        for obj in self.tracked.values():
            if isinstance(obj, nn.Module) and params <= {id(p) for p in unwrap(obj).parameters()}:
                return unwrap(obj)
        raise ConfigError(f"the optimizer tracked as {name!r} steps parameters of no tracked "
                          "model: track the model too (job.track(model=model, "
                          f"{name}=optimizer)), whose names its state is saved under")

    def _named_optimizer_states(self, loaded: dict[str, Any]) -> dict[str, Any]:
        """A format-1 checkpoint's optimizer states (keyed by position, as
        Optimizer.state_dict() keys them) keyed by parameter name instead."""
        for name, obj in self.tracked.items():
            if isinstance(obj, Optimizer) and name in loaded:
                model = self._model_of(name, obj)
                names = {id(p): n for n, p in model.named_parameters()}
                order = [names[id(p)] for group in obj.param_groups for p in group["params"]]
                old = loaded[name]
                loaded[name] = {
                    "state": {order[i]: s for i, s in old["state"].items()},
                    "param_groups": [g | {"params": [order[i] for i in g["params"]]}
                                     for g in old["param_groups"]]}
        return loaded

    # --------------------------------------------------------------------- collectives

    def _collectives(self) -> sharded.Comm:
        """The checkpoint's own Gloo process group (a background save's collectives run
        beside training's), made on the first save or restore; and whether the ranks
        share one host."""
        if self._comm is None:
            if self.engine.world_size == 1:
                self._comm = sharded.ALONE
            else:
                if not dist.is_initialized():
                    raise RuntimeError(f"engine {self.engine.name} joined no torch.distributed "
                                       "process group, which sharded checkpoints need")
                group = dist.new_group(backend="gloo")
                self._comm = sharded.Comm(group, self.engine.rank, self.engine.world_size)
                self._shared = len(set(self._comm.all_gather(socket.gethostname()))) == 1
                # Rank 0's checkpoint directory is the run's, whatever the others'
                # defaults made of theirs (a run directory stamped with their own start).
                self.checkpoints.use_directory(self._comm.broadcast(
                    str(self.checkpoints.local.path)))
        return self._comm

    def _portable(self, checkpoint: Checkpoint) -> tuple:
        """``checkpoint`` as rank 0 sends it to the others: its store by index (or
        directory), its manifest's name, the manifest and its location."""
        stores = self.checkpoints.stores
        where = (stores.index(checkpoint.store) if checkpoint.store in stores
                 else str(checkpoint.store.path))
        return where, checkpoint.name, checkpoint.manifest, checkpoint.location

    def _rebuild(self, portable: tuple) -> Checkpoint:
        where, name, manifest, location = portable
        store = (self.checkpoints.stores[where] if isinstance(where, int)
                 else DirectoryStore(where))
        return Checkpoint(location, manifest, store, name)


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


def _is_tensor_state(obj: Any) -> bool:
    """Saved through DCP, every rank its part: models and optimizers."""
    return isinstance(obj, nn.Module | Optimizer)


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a DTensor (FSDP), or the tensor."""
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def _state_of(obj: Any) -> Any:
    if hasattr(obj, "state_dict"):
        return obj.state_dict()
    if isinstance(obj, dict):
        return dict(obj)
    raise TypeError(f"cannot checkpoint a {type(obj).__name__}: track objects with "
                    "state_dict() and load_state_dict(), or dicts")


def _load_state(obj: Any, state: Any) -> None:
    if hasattr(obj, "load_state_dict"):
        obj.load_state_dict(state)
    else:
        obj.clear()
        obj.update(state)
