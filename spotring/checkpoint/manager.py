"""The checkpoint manager: what a job's checkpoints hold, and how its ranks save and
restore them on any world size, under any engine, in any store.

    checkpointer = Checkpointer(checkpoints, engine, seed, timeout_s=300)
    checkpointer.tracked.update(model=model, optimizer=optimizer, loader=loader)
    checkpointer.annotations.update(model="resnet20")     # every manifest carries it
    checkpointer.save(step, position, scaler, background=True)   # every rank writes
    restored = checkpointer.restore("auto", scaler)       # every rank reads what it needs

spotring.Job holds one (``job.save``, ``job.restore``). This package's other modules are
what it stands on, and neither calls back into it: layout.py, what a checkpoint is in a
store (names, manifest, verification; torch-free, the launchers read it), and parts.py,
the adapter to torch.distributed.checkpoint (DCP) that writes and reads each rank's part.

A save, top to bottom (``save``, then ``_publish``):

 1. wait for the save in flight (at most one); refuse weights that are not finite
    (Diverged: never a checkpoint to resume a diverged run from)
 2. what: the tracked models' and optimizers' state dicts, as DCP's ``get_state_dict``
    gives them (keyed by parameter names whatever wraps the model, sharded where FSDP
    shards it); rank 0's extras beside them (the other tracked objects' states, the
    step, every rank's RNG state, the gradient scaler); the manifest's meta
 3. who writes: every rank its part where every rank can read every part back (the
    ranks share one host, or a checkpoint.uri names a store all reach); else rank 0
    gathers the whole state and writes it alone
 4. in the background: copy this rank's share to CPU memory (parts.Stager) and publish
    on a thread while training goes on; else publish now. ``_publish``:
 5. every rank writes its part into the checkpoint directory (parts.write), rank 0
    spotring.pt
 6. each reads its files back (size and sha256) and uploads them to the uri's store,
    checking the size stored (``_stored``)
 7. the ranks gather their reports: a failure on any rank is raised on every rank,
    naming the rank and the object, and the checkpoints before are all kept
 8. rank 0 writes the manifest (layout.manifest_bytes), last, to every store that holds
    every part, reads it back, and drops what is beyond checkpoint.keep there
    (layout.Checkpoints.drop_old); each host from its directory

A restore, top to bottom (``restore``):

 1. rank 0 finds the candidates (layout.find_resume: resume=auto, every store's, newest
    first; or the one named; or those the caller found) and sends them to the others
 2. each candidate in turn: every rank checks its share of the parts against the
    manifest (layout.Checkpoint.problems); one with a part missing, short or corrupt is
    reported, naming the part, and skipped (or refused, where it was named)
 3. its manifest's annotations must be the job's (ConfigError otherwise)
 4. every rank reads the pieces its own tensors hold, from any world size that wrote
    them (parts.read: DCP's reader, by ranged reads from a bucket store); or, where the
    ranks do not share the directory that holds it, rank 0 reads it whole
    (parts.load_whole) and sends each its part
 5. the other tracked objects (a position continues there), the RNG states (fresh ones
    on another world size) and the scaler; the step is returned
"""

from __future__ import annotations

import gc
import io
import logging
import math
import socket
import threading
import time
from collections.abc import Callable, Sequence
from datetime import timedelta
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

from spotring import runtime
from spotring.checkpoint import parts
from spotring.checkpoint.layout import (
    EXTRAS,
    SINGLE_FILE,
    Checkpoint,
    CheckpointNotSaved,
    Checkpoints,
    Saved,
    find_resume,
    folder_name,
    manifest_bytes,
)
from spotring.engines import Engine
from spotring.exits import ConfigError, Diverged
from spotring.position import Position
from spotring.stores import DirectoryStore

log = logging.getLogger("spotring")

_FULL = StateDictOptions(full_state_dict=True, cpu_offload=True)


class Checkpointer:
    """The tracked objects of a job, its annotations, and its checkpoints: the step of
    the newest begun (``saved_step``), the newest published (``saved``) and the one
    resumed from (``resumed_from``).

    checkpoints: the job's stores, opened (layout.Checkpoints; its directory the same on
    every rank). background, sharded: CheckpointOptions'. notice_seconds: how long the
    cloud's notice gives (read after each save, to warn once where a checkpoint would not
    fit in it). timeout_s: how long each of the checkpoint's collectives waits for a peer
    (engine.timeout_s)."""

    def __init__(self, checkpoints: Checkpoints, engine: Engine, seed: int,
                 sharded: bool | None = None,
                 notice_seconds: Callable[[], float] = lambda: 120.0, *,
                 timeout_s: float) -> None:
        self.checkpoints, self.engine, self.seed = checkpoints, engine, seed
        self.timeout = timedelta(seconds=timeout_s)
        self.sharded = sharded
        self.notice_seconds = notice_seconds
        self.tracked: dict[str, Any] = {}
        self.annotations: dict[str, Any] = {}
        self.saved: Saved | None = None  # the newest checkpoint published (rank 0's view)
        self.saved_step: int | None = None  # the step of the newest checkpoint begun
        self.resumed_from: str | None = None  # the checkpoint restore() loaded
        self._comm: parts.Comm | None = None
        self._shared = True  # every rank on one host
        self._stager: parts.Stager | None = None
        self._pending: threading.Thread | None = None
        self._failed: BaseException | None = None  # the background save's
        self._warned = False

    # ------------------------------------------------------------------------------ save

    def save(self, step: int, position: Position | None, scaler: torch.amp.GradScaler,
             background: bool = False) -> Saved | None:
        """Checkpoint the tracked state as step ``step`` (a collective), the manifest
        giving ``position``'s epoch, offset and global batch where there is one. Blocking:
        returns once it is published (what was written, on every rank); background: once
        this rank's share is copied to CPU memory (None; ``saved`` follows when done).
        Raises Diverged where a tracked model's weights are not finite on any rank."""
        self.wait()
        self._check_finite(step)
        comm = self._collectives()
        rngs = self.engine.all_gather_object(runtime.rng_state())
        extras = {name: _state_of(obj) for name, obj in self.tracked.items()
                  if not _is_tensor_state(obj)}
        extras["spotring"] = {"step": step, "rng": rngs, "world_size": self.engine.world_size,
                              "scaler": scaler.state_dict()}
        meta = {"step": step, "world_size": self.engine.world_size, **self.annotations}
        if position is not None:
            meta |= {"epoch": position.epoch, "offset": position.offset,
                     "global_batch": position.global_batch}
        whole = not self.sharded if self.sharded is not None else not (
            self._shared or self.checkpoints.remote is not None)
        state = self._tensor_state(_FULL if whole else None)
        self.saved_step = step
        if whole:  # rank 0 alone writes, the others are done
            comm = parts.ALONE
            if self.engine.rank != 0:
                return None
        if background:
            if self._stager is None:
                self._stager = parts.Stager(pinned=self.engine.device.type == "cuda")
            state = self._stager.stage(state, comm)
            self._pending = threading.Thread(
                target=self._publish_in_background, args=(state, meta, extras, comm),
                name=f"spotring-checkpoint-{step}", daemon=True)
            self._pending.start()
            return None
        saved = self._publish(state, meta, extras, comm)
        self._report(saved)
        return saved

    def _publish(self, state: dict[str, Any] | parts.Staged, meta: dict[str, Any],
                 extras: dict[str, Any], comm: parts.Comm) -> Saved:
        saved = publish(self.checkpoints, state, meta, extras, comm,
                        cleans=self.engine.local_rank == 0)
        self.saved = saved
        return saved

    def _report(self, saved: Saved) -> None:
        """Rank 0, on the training thread: the checkpoint's line, and the warning where it
        took longer than a notice gives. Never from the background save's thread: its
        line on stderr could fall between the text and the newline of a line the script
        prints (two writes where the streams are unbuffered, as launchers make them)."""
        if self.engine.rank == 0:
            log.info("checkpoint %s, %s", saved.location, saved.describe())
            self._warn_if_too_slow(saved)

    def _publish_in_background(self, *args: Any) -> None:
        try:
            self._publish(*args)
        except BaseException as e:  # raised on the training thread, by wait()
            if threading.current_thread() is self._pending:  # not one given up
                self._failed = e

    def step_taken(self) -> None:
        """Once per optimizer step, on the training thread: where the background save in
        flight is published by now, say so (``wait``, which returns at once). A failed one
        is left for the next ``wait`` to raise: at the next save, or at the end."""
        if self._pending is not None and not self._pending.is_alive() and self._failed is None:
            self.wait()

    @property
    def in_flight(self) -> int | None:
        """The step of the background save in flight, if one is."""
        return self.saved_step if self._pending is not None else None

    def wait(self, timeout: float | None = None) -> bool:
        """Until the background save in flight (if any) is published, then reported
        (``_report``), or ``timeout`` seconds have passed (False: it is still in flight);
        re-raises its error."""
        if self._pending is not None:
            self._pending.join(timeout)
            if self._pending.is_alive():
                return False
            self._pending = None
            if (failed := self._failed) is not None:
                self._failed = None
                raise failed
            self._report(self.saved)
        return True

    def abandon(self) -> None:
        """In place, a worker lost: the background save in flight (its collectives met
        the lost worker, or will) is given up, said in a line; the checkpoint before it
        stands, and its thread ends once the group it waits in is gone (regrouped)."""
        if self._pending is None:
            return
        step = self.saved_step
        self._pending, self._failed = None, None
        log.warning("the checkpoint of step %s, begun in the background, was given up: a "
                    "worker was lost while it was written", step)

    def regrouped(self) -> None:
        """In place: the ranks are others now; the checkpoints' collectives are formed
        again over them at the next save or restore."""
        self._comm = None

    def drop_collectives(self) -> None:
        """In place, a save that met a lost worker: leave the checkpoint's process group
        now, so that its connections close and a peer still waiting in it for this rank
        (a coordinator's scatter, say, that this rank left) fails at once rather than at
        engine.timeout_s. Formed again at the next save or restore."""
        group = None if self._comm is None else self._comm.group
        self._comm = None
        if group is not None:
            # Gloo closes a group's connections only as the group itself goes (abort and
            # shutdown do not): its last holders go here, the failed collective's frames
            # among them (reference cycles, hence the collection).
            dist.destroy_process_group(group)
            del group
            gc.collect()

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

    def restore(self, source: str | Checkpoint | Sequence[Checkpoint] | None,
                scaler: torch.amp.GradScaler) -> int | None:
        """Load a checkpoint into the tracked objects (a collective); its step, or None
        where there is none. ``source``: spotring.Job.restore's (rank 0's counts). The
        candidates of "auto" (or a list already found) are tried newest first; one with a
        part missing, short or corrupt (each rank checks its share of the parts) is
        reported and skipped. A checkpoint named (a path, a Checkpoint) with such a part
        is refused, ConfigError."""
        self.wait()
        comm = self._collectives()
        named = isinstance(source, Checkpoint) or source not in ("auto", None) \
            and isinstance(source, str)
        candidates = None
        if self.engine.rank == 0:  # a store pickles as its location
            candidates = (find_resume(source, self.checkpoints) if isinstance(source, str)
                          else [] if source is None
                          else [source] if isinstance(source, Checkpoint) else list(source))
        for checkpoint in comm.broadcast(candidates):
            whole = checkpoint.format == SINGLE_FILE or (
                isinstance(checkpoint.store, DirectoryStore) and not self._shared)
            if problems := self._problems(checkpoint, comm, whole):
                if named:  # the checkpoint asked for by name: none other
                    raise ConfigError(f"resume={checkpoint.location}: "
                                      + "; ".join(problems))
                if self.engine.rank == 0:
                    log.warning("skipping checkpoint: %s", "; ".join(problems))
                continue
            checkpoint.check_matches(self.annotations)
            extras = self._load(checkpoint, comm, whole)
            return self._resumed(checkpoint, extras, scaler)
        return None

    def _problems(self, checkpoint: Checkpoint, comm: parts.Comm, whole: bool) -> list[str]:
        """What the ranks found wrong with ``checkpoint``: rank 0 alone checks every part
        where it alone reads them (``whole``), else each rank its share."""
        if whole:
            return comm.broadcast(checkpoint.problems(checkpoint.parts())
                                  if comm.rank == 0 else None)
        share = sorted(checkpoint.parts())[comm.rank::comm.world_size]
        return sorted({p for found in comm.all_gather(checkpoint.problems(share)) for p in found})

    def _load(self, checkpoint: Checkpoint, comm: parts.Comm, whole: bool) -> dict[str, Any]:
        """The tensors into the tracked models and optimizers; returns the rest."""
        if not whole:
            state = self._tensor_state()
            parts.read(state, checkpoint.store, checkpoint.folder, comm)
            self._apply(state, None)
            extras = checkpoint.store.read(f"{checkpoint.folder}/{EXTRAS}")
            return torch.load(io.BytesIO(extras), map_location="cpu", weights_only=True)
        loaded = parts.load_whole(checkpoint) if comm.rank == 0 else {}
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
        self.saved_step, self.resumed_from = meta["step"], checkpoint.location
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

    def _collectives(self) -> parts.Comm:
        """The checkpoint's own Gloo process group (a background save's collectives run
        beside training's), made on the first save or restore; and whether the ranks
        share one host."""
        if self._comm is None:
            if self.engine.world_size == 1:
                self._comm = parts.ALONE
            else:
                if not dist.is_initialized():
                    raise RuntimeError(f"engine {self.engine.name} joined no torch.distributed "
                                       "process group, which sharded checkpoints need")
                # engine.timeout_s, not torch's 30 minutes for a group made here.
                group = dist.new_group(backend="gloo", timeout=self.timeout)
                self._comm = parts.Comm(group, self.engine.rank, self.engine.world_size)
                self._shared = len(set(self._comm.all_gather(socket.gethostname()))) == 1
        return self._comm


# --------------------------------------------------------------------------- publishing


def publish(checkpoints: Checkpoints, state: Any, meta: dict[str, Any],
            extras: dict[str, Any] | None = None, comm: parts.Comm = parts.ALONE,
            cleans: bool = True) -> Saved:
    """Write the checkpoint of step ``meta['step']`` to ``checkpoints``' stores (a
    collective over ``comm``; ALONE: this process alone): every rank its part of
    ``state`` (DCP: tensors, sharded or alike on every rank; or a parts.Staged copy of
    this rank's share) into its checkpoint directory, rank 0 ``extras`` (torch.save:
    positions, RNG states) beside them; each rank reads its files back and uploads them
    to the uri's store; rank 0 then writes the manifest to every store that holds every
    part (the checkpoint directory only where the ranks share it, or are one) and drops
    the checkpoints beyond checkpoint.keep in the uri's store; ``cleans``: this process
    also drops them from its checkpoint directory (one process per host does: local rank
    0). Raises CheckpointNotSaved on every rank, naming the rank and the object, where any
    rank failed; the checkpoints before are all kept."""
    started = time.time()
    folder = folder_name(meta["step"])
    report: dict[str, Any] = {"rank": comm.rank}
    try:
        files = parts.write(state, checkpoints.local.path / folder, comm)
        if comm.rank == 0:
            checkpoints.local.write(f"{folder}/{EXTRAS}", _bytes_of(extras or {}))
            files.append(EXTRAS)
        report |= _stored(checkpoints, folder, files, started)
    except (Exception, parts.CheckpointException) as e:
        # Every rank must hear of it, or the others wait forever. (DCP's own
        # CheckpointException, gathered from every rank, is a BaseException.)
        report["error"] = "; ".join(
            f"rank {rank}: {type(error).__name__}: {error}"
            for rank, error in parts.failures(e, comm.rank).items())
    reports = comm.all_gather(report)
    if errors := [r["error"] for r in reports if "error" in r]:
        raise CheckpointNotSaved("; ".join(errors))
    saved = None
    if comm.rank == 0:
        try:
            saved = _manifest(checkpoints, folder, meta, reports)
        except Exception as e:
            saved = CheckpointNotSaved(f"rank 0: {type(e).__name__}: {e}")
    saved = comm.broadcast(saved)
    if isinstance(saved, Exception):
        raise saved
    if cleans:
        checkpoints.drop_old(checkpoints.local)
    return saved


def _stored(checkpoints: Checkpoints, folder: str, files: list[str],
            started: float) -> dict[str, Any]:
    """This rank's part of a save, after DCP wrote its files: each read back (size and
    sha256 from the disk), then uploaded and its stored size checked."""
    local, remote = checkpoints.local, checkpoints.remote
    written = {}
    for name in files:
        path = f"{folder}/{name}"
        written[name] = {"bytes": local.size(path), "sha256": local.sha256(path)}
    times = {local.where: (time.time() - started, time.time())}
    if remote is not None:
        for name, part in written.items():
            path = f"{folder}/{name}"
            try:
                remote.upload(path, local.path / path)
            except Exception as e:  # cut off, refused: name the object
                raise CheckpointNotSaved(f"{remote.location(path)}: not uploaded "
                                         f"({type(e).__name__}: {e})") from e
            if (size := remote.size(path)) != part["bytes"]:
                raise CheckpointNotSaved(f"{remote.location(path)}: {size} bytes "
                                         f"stored of the {part['bytes']} written")
        times[remote.where] = (time.time() - started, time.time())
    return {"parts": written, "times": times}


def _manifest(checkpoints: Checkpoints, folder: str, meta: dict[str, Any],
              reports: list[dict[str, Any]]) -> Saved:
    """Rank 0: the manifest of every rank's parts, on each store that holds them all."""
    written = {name: part for r in reports for name, part in r["parts"].items()}
    manifest = manifest_bytes(written, meta)
    rank_bytes = max(sum(p["bytes"] for p in r["parts"].values()) for r in reports)
    total = sum(p["bytes"] for p in written.values())
    location, seconds, done_at = None, {}, {}
    here = set(checkpoints.local.names())
    for store in checkpoints.stores:
        local = store is checkpoints.local
        if local and not all(f"{folder}/{name}" in here for name in written):
            continue  # the ranks write on several disks: the uri's store holds it whole
        name = folder + ".json"
        store.write(name, manifest)
        if store.read(name) != manifest:
            raise CheckpointNotSaved(f"{store.location(name)}: reads back other than written")
        seconds[store.where] = max(r["times"][store.where][0] for r in reports)
        done_at[store.where] = time.time() if not local else max(
            r["times"][store.where][1] for r in reports)
        location = location or store.location(folder)
        if not local:
            checkpoints.drop_old(store)
    if location is None:
        raise CheckpointNotSaved(
            f"{checkpoints.local.location(folder)}: the ranks wrote their parts on disks of "
            "their own and no checkpoint.uri holds them all")
    return Saved(location, total, rank_bytes, len(written), seconds, done_at)


def _bytes_of(obj: Any) -> bytes:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


# ----------------------------------------------------------------------- tracked objects


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
