"""spotring in a user's own training script: join, wrap, sample, checkpoint, stop.

    import spotring

    with spotring.init() as job:                  # rank, device, process group
        loader = job.loader(dataset, global_batch=256, num_workers=2)
        model, optimizer = job.wrap(model, optimizer)
        job.track(model=model, optimizer=optimizer, loader=loader)
        job.restore()                             # the newest valid checkpoint, if any
        for epoch in range(loader.epoch, epochs):
            loader.set_epoch(epoch)
            for x, y in loader:
                loss = criterion(model(x.to(job.device)), y.to(job.device))
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
                if job.should_stop():             # a notice or signal on any rank
                    job.save_and_exit()           # checkpoint, exit 75
            job.save()
        job.finish(test_accuracy=accuracy)        # summary.json

The contract (docs/api.md):

- ``init`` reads the launcher's environment (torchrun, horovodrun, mpirun, srun, or
  none: one process), pins the local rank's GPU, and joins the process group (DDP over
  NCCL, Gloo or MPI) or Horovod, with ``timeout_s`` on every collective. Bad input
  (an engine that cannot run here) exits 2 before anything starts.
- ``loader`` (spotring.DataLoader): global batch i of an epoch is the same samples for
  any number of workers; its position is part of every checkpoint.
- ``should_stop`` is a collective: every rank calls it once per step, and it is true
  on every rank at the same step (the ranks vote every few steps) once any rank saw
  SIGTERM, SIGUSR1 or a spot notice (EC2, GCP, Azure). ``save_and_exit`` writes a
  checkpoint and exits 75.
- Inside ``with``: a lost or hung rank ends the others with 69, naming it; a
  ``check_finite`` that failed ends every rank with 65; ConfigError with 2. Any other
  way out (sys.exit, an exception) first lets a background save in flight finish.
- Checkpoints: every rank writes its part (spotring/checkpoint/manager.py), a periodic ``save`` in
  the background; ``restore`` reads each rank's part back onto any world size and engine.
- Only rank 0 writes metrics.jsonl, TensorBoard and summary.json in ``run_dir``.

Exit codes: spotring/exits.py; what checkpoints hold and how: spotring/checkpoint/manager.py.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.optim import Optimizer

from spotring import contract, engines, runtime, torch_compat, versions
from spotring.checkpoint.layout import Checkpoint, Checkpoints, note_where
from spotring.checkpoint.manager import Checkpointer, unwrap
from spotring.elastic.in_place import InPlace
from spotring.engines.process_group import Group
from spotring.exits import (
    DIVERGED,
    EXIT_CONFIG,
    EXIT_DIVERGED,
    EXIT_PREEMPTED,
    PREEMPTED,
    ConfigError,
    Diverged,
    exit_peer_lost,
    report_bad_input,
)
from spotring.loader import DataLoader
from spotring.options import (
    CheckpointOptions,
    Device,
    ElasticOptions,
    EngineOptions,
    Precision,
    PreemptionOptions,
    require_one_of,
)
from spotring.position import Position, Resharded
from spotring.preemption import Preemption, notice_budget
from spotring.shards.dataset import gather_reads
from spotring.stores import write_atomic
from spotring.telemetry import Telemetry

log = logging.getLogger("spotring")

_AUTOCAST = {"bf16": torch.bfloat16, "fp16": torch.float16}


def init(*, engine: str | EngineOptions = "ddp", backend: str | None = None,
         timeout_s: float | None = None, bucket_mb: float | None = None,
         sync_bn: bool | None = None, compression: str | None = None, device: str = "auto",
         run_dir: str | os.PathLike | None = None,
         checkpoint: CheckpointOptions | Checkpoints | None = None,
         checkpoint_dir: str | os.PathLike | None = None, checkpoint_uri: str | None = None,
         keep: int | None = None, preemption: PreemptionOptions | None = None,
         notices: str | None = None, check_every_steps: int | None = None,
         elastic: ElasticOptions | None = None, in_place: str | None = None,
         min_workers: int | None = None, threads: int | None = None, seed: int = 0) -> Job:
    """Join the job this process was started in (see the module docstring): read the
    launcher's environment, take the local rank's GPU or the CPU, join the process group.
    Bad input (a value below, an engine this launch cannot run, an S3 bucket out of
    reach) exits 2 with one paragraph naming it and the valid values, before any process
    group exists.

    engine: "ddp" (PyTorch DDP), "fsdp" (PyTorch's FSDP2: parameters, gradients and
        optimizer state sharded) or "horovod" (Horovod's DistributedOptimizer; under
        horovodrun or mpirun), or the engine's options object, such as
        ``spotring.DDPOptions(bucket_mb=50)`` or ``spotring.FSDPOptions(blocks=[Block])``;
        the engines registered in spotring/engines/ are valid.
    backend, timeout_s, bucket_mb, sync_bn, compression: the engine's options of those
        names (spotring.EngineOptions, DDPOptions, HorovodOptions document them), in
        place of the defaults or of the options object's; an option the engine does not
        have is bad input. Not given: the engine's defaults (backend "auto": NCCL on GPUs,
        Gloo on CPUs; timeout_s 300 seconds for every collective).
    device: "auto" (the local rank's GPU where torch sees one, else the CPU), "cpu" or
        "cuda".
    run_dir: where rank 0 writes metrics.jsonl, tensorboard/, summary.json and the notes
        of why it stopped (made by init); default $SPOTRING_RUN_DIR (set by spotring's
        launchers), else ./runs/<script name>.
    checkpoint: a spotring.CheckpointOptions (dir, uri, keep, background, sharded);
        checkpoint_dir, checkpoint_uri and keep, where given, replace its fields.
        Defaults: the run_dir's checkpoints/; the store $SPOTRING_CHECKPOINT_URI names
        (s3://, gs://, az://; a directory as file:///path), else none; 3 kept. Or the
        stores CheckpointOptions.open already opened (and checked), which are taken as
        they are.
    preemption: a spotring.PreemptionOptions (notices, poll_seconds, check_every_steps);
        notices and check_every_steps, where given, replace its fields. Defaults: watch
        the metadata service of the cloud found (EC2, GCP or Azure) for spot notices
        (GCP's holds each request until its flag changes; EC2's and Azure's are asked
        every 0.5 s); vote as often as keeps the vote near 1% of the steps' time while a
        notice is acted on within about a second.
    elastic: a spotring.ElasticOptions (in_place, min_workers, rendezvous,
        save_on_leave); in_place and min_workers, where given, replace its fields.
        Default: off, a lost worker stops every rank. in_place="auto": the others train
        on in place with the same global batches, and a process started with the job's
        rendezvous ($SPOTRING_RENDEZVOUS) joins at a step boundary (docs/elastic.md).
    threads: torch threads per process; default this machine's cores / local workers.
    seed: seeds torch and random the same on every rank (the same initial weights);
        after ``wrap`` every rank gets its own stream.
    """
    launch = runtime.detect()
    try:
        options = engines.options_for(engine, backend=backend, timeout_s=timeout_s,
                                      bucket_mb=bucket_mb, sync_bn=sync_bn,
                                      compression=compression)
        notices = (preemption or PreemptionOptions()).replaced(
            "preemption", notices=notices, check_every_steps=check_every_steps)
        elastic = (elastic or ElasticOptions()).replaced(
            "elastic", in_place=in_place, min_workers=min_workers).resolved()
        problems = []
        if not isinstance(checkpoint, Checkpoints):
            checkpoint = (checkpoint or CheckpointOptions()).replaced(
                "checkpoint", dir=checkpoint_dir, uri=checkpoint_uri, keep=keep)
            problems = checkpoint.problems("checkpoint.")
        if problems := (problems + notices.problems("preemption.")
                        + elastic.problems("elastic.")):
            raise ConfigError("; ".join(problems))
        require_one_of("device", device, Device)
        torch_device = runtime.pick_device(device, launch.local_rank)
        engines.check(options, launch, torch_device)
        elastic = _in_place_here(elastic, options, launch)
        run_dir = Path(run_dir or contract.run_dir()
                       or Path("runs") / Path(sys.argv[0]).stem).absolute()
        checkpoints = (checkpoint if isinstance(checkpoint, Checkpoints)
                       else checkpoint.open(run_dir))
        if launch.rank == 0:
            checkpoints.check_access()
        membership, group = (InPlace.begin(elastic, launch.rank, launch.world_size,
                                           options.timeout_s)
                             if elastic.in_place != "off" else (None, None))
    except ConfigError as e:
        report_bad_input(e, launch.rank, launch.world_size)
        sys.exit(EXIT_CONFIG)
    _announce(launch.rank)
    if launch.rank == 0 and (untested := versions.torch_untested(torch.__version__)):
        log.warning("%s", untested)
    runtime.set_threads(threads, launch.local_world_size)
    runtime.seed_all(seed)
    return Job(launch, options, torch_device, run_dir, checkpoints, notices, seed, membership,
               group)


def _in_place_here(elastic: ElasticOptions, engine: EngineOptions,
                   launch: runtime.Launch) -> ElasticOptions:
    """``elastic`` as this job can run it: ConfigError for in place demanded (on) where
    it cannot run, or asked for without a rendezvous store or with a minimum above the
    workers there are; in place off, said in a line, where it was only asked for
    (auto)."""
    if elastic.in_place == "off":
        return elastic
    if elastic.rendezvous is None:
        raise ConfigError(
            f"elastic.in_place={elastic.in_place} needs a rendezvous store that outlives "
            "every training node: give its host:port as elastic.rendezvous or "
            "$SPOTRING_RENDEZVOUS (`spotring rendezvous` serves one; `spotring launch` "
            "runs it), or elastic.in_place=off")
    if elastic.min_workers > launch.world_size:
        raise ConfigError(
            f"elastic.min_workers={elastic.min_workers} with {launch.world_size} workers: "
            f"the job would stop at its first loss; valid here: 1 to {launch.world_size}")
    if why := engines.in_place_problem(engine, launch.world_size):
        if elastic.in_place == "on":
            raise ConfigError(f"elastic.in_place=on: {why}; or elastic.in_place=auto "
                              "(today's path for this engine)")
        if launch.rank == 0:
            log.warning("in place: off (%s): a lost worker stops every rank", why)
        return dataclasses.replace(elastic, in_place="off")
    return elastic


def _announce(rank: int) -> None:
    """spotring's lines on stderr ("resumed from ... at step N", checkpoints), rank 0's
    only, where the script configured no logging of its own: what a launcher shows, and
    what `spotring launch` reads a resumed step from."""
    if log.handlers or logging.getLogger().handlers:
        return
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("spotring: %(message)s"))
    log.addHandler(handler)
    log.setLevel(logging.INFO if rank == 0 else logging.WARNING)


class Job:
    """This process's part of a data-parallel job: what ``spotring.init`` returns, having
    checked its input; its arguments are init's, checked and resolved: the ``launch``
    (spotring.runtime.detect), the ``engine``'s options, the torch ``device``, the
    ``run_dir``, the ``checkpoints`` (CheckpointOptions.open: the stores and how to save
    to them), the ``preemption`` options and the ``seed``; in a job in place
    (spotring.ElasticOptions), ``in_place``, its membership (spotring/elastic/), and
    ``group``, the process group it forms first.

    rank, world_size, local_rank, device: this process's place in the job; is_main: rank
    0, the one process that writes files; options: the engine's options; engine: the
    spotring engine averaging the gradients; precision: ``wrap``'s, as resolved ("fp32",
    "bf16" or "fp16"); run_dir: where rank 0 writes (rank 0 makes it); checkpoints: where
    every rank writes its part of each checkpoint, in rank 0's directory on every rank."""

    def __init__(self, launch: runtime.Launch, engine: EngineOptions, device: torch.device,
                 run_dir: Path, checkpoints: Checkpoints, preemption: PreemptionOptions,
                 seed: int, in_place: InPlace | None = None, group: Group | None = None
                 ) -> None:
        self.launch, self.run_dir = launch, run_dir
        self.seed, self.options = seed, engine
        self._in_place = in_place  # the membership of a job in place (spotring/elastic/)
        self.engine = engines.create(engine, launch, device, group)
        if in_place is not None:
            in_place.engine = self.engine
        self.rank, self.world_size = self.engine.rank, self.engine.world_size
        self.local_rank, self.device = self.engine.local_rank, device
        if self.world_size > 1:  # rank 0's directory, whatever the others' defaults say
            checkpoints = checkpoints.in_directory(
                self.engine.broadcast_object(str(checkpoints.local.path)))
        self.checkpoints = checkpoints
        if self.is_main:
            run_dir.mkdir(parents=True, exist_ok=True)
        self.preemption = Preemption(
            preemption, self.engine, self.local_rank,
            None if in_place is None else lambda: in_place.rendezvous.waiting(
                in_place.generation))
        self.scaler = torch.amp.GradScaler(device.type, enabled=False)
        self.precision = "fp32"
        self._checkpointer = Checkpointer(checkpoints, self.engine, seed, checkpoints.sharded,
                                          lambda: self.preemption.notice_seconds,
                                          timeout_s=engine.timeout_s)
        self._noted_where = False  # rank 0's note of where the checkpoints are
        self._position: Position | None = None  # the tracked one
        self._steps = 0  # should_stop's count, where no position is tracked
        self._start_step = 0  # the step this process started from (restored, or 0)
        self._datasets: list[Any] = []  # whose reads summary.json gives (``count_reads``)
        self._loader: DataLoader | None = None
        self._model: nn.Module | None = None  # the wrapped model, for no_sync
        self._accumulation = 1  # micro-batches per optimizer step (wrap's)
        self._micro_steps = 0  # taken since the last optimizer step, where no loader counts
        self._started = time.perf_counter()
        self._telemetry: Telemetry | None = None
        self._stop_reason: str | None = None
        self._leaving = False  # in place: this rank leaves, the others go on
        self._closed = False

    @property
    def telemetry(self) -> Telemetry:
        """Where ``log`` writes (rank 0): metrics.jsonl and TensorBoard in run_dir. The
        built-in trainer puts its own here, with a progress bar."""
        if self._telemetry is None:
            self._telemetry = Telemetry(self.run_dir, self.is_main, progress=False,
                                        total_steps=0, done_steps=0)
        return self._telemetry

    @telemetry.setter
    def telemetry(self, telemetry: Telemetry) -> None:
        self._telemetry = telemetry

    @property
    def is_main(self) -> bool:
        """Rank 0: the one process that writes files (not a worker counted out of a job in
        place)."""
        return self.rank == 0 and not self._counted_out

    @property
    def _counted_out(self) -> bool:
        """A worker the roll call of a job in place counted out: no member until it is
        taken in again, so it writes nothing of the job's."""
        return self._in_place is not None and self._in_place.counted_out

    # ----------------------------------------------------------------- data and model

    def loader(self, dataset: torch.utils.data.Dataset, global_batch: int, *,
               batch_size: int | None = None, seed: int | None = None,
               **dataloader_kwargs: Any) -> DataLoader:
        """A spotring.DataLoader over ``dataset`` for this rank: its share of every global
        batch, in an order that is the same on any number of workers.

        dataset: any map-style Dataset (__len__ and __getitem__).
        global_batch: samples per optimizer step over all workers; the world size must
            divide it (ConfigError naming the worker counts that can).
        batch_size: the most samples one worker takes per micro-step; where the share is
            larger, it is taken in several micro-steps (accumulation). Default: the whole
            share in one.
        seed: of the order (one permutation per epoch); default ``init``'s seed.
        dataloader_kwargs: to torch's DataLoader (num_workers, pin_memory,
            persistent_workers, collate_fn, ...); pin_memory defaults to True on a GPU.
        """
        dataloader_kwargs.setdefault("pin_memory", self.device.type == "cuda")
        loader = DataLoader(dataset, global_batch, batch_size=batch_size,
                            seed=self.seed if seed is None else seed, rank=self.rank,
                            world_size=self.world_size, **dataloader_kwargs)
        self._loader = loader
        self._hook(loader)
        self.count_reads(dataset)
        return loader

    def wrap(self, model: nn.Module, optimizer: Optimizer | engines.OptimizerFactory, *,
             precision: str = "fp32", channels_last: bool = False, compile: bool = False,
             accumulation: int | None = None) -> tuple[nn.Module, Optimizer]:
        """The model on this rank's device, every rank starting from rank 0's weights and
        optimizer state, gradients averaged over all ranks: DDP (buckets overlapping
        backward), FSDP (each rank holding a shard of the parameters, gradients and
        optimizer state) or Horovod's DistributedOptimizer. Returns (model, optimizer) to
        use from now on; one process alone gets both back unwrapped, except under fsdp,
        which shards alone too (a group of one).

        model: the network. Under fsdp it is sharded in place: its parameters become
            DTensors (``p.full_tensor()`` is the whole of one), and it is still itself
            (``unwrap`` returns it; in a job in place, a module around it, as each change
            of workers shards it anew).
        optimizer: built over the model's parameters, without state yet (under fsdp it is
            pointed at the sharded parameters in place, so a scheduler built on it stays
            valid); or a function that builds it from the parameters it is to step, for
            any engine: ``job.wrap(model, lambda params: torch.optim.AdamW(params,
            lr=1e-3))``.
        precision: "fp32"; "bf16" or "fp16" (the forward pass under ``autocast()``; fp16
            with a gradient scaler, which ``backward`` and ``step`` apply); "auto": bf16
            where the device computes it natively, else fp32 (always fp32 for a float64
            model). Under fsdp, bf16 also gathers the parameters and reduces the
            gradients in bfloat16 (the shards and the optimizer stay float32), and fp16 is
            refused.
        channels_last: the model in NHWC memory order (convolutions on GPUs).
        compile: torch.compile the model before the engine wraps it; ConfigError where
            torch.compile cannot run here, or the engine's options cannot go with it.
        accumulation: micro-batches per optimizer step; default the loader's (1 without
            one). ``micro_step``, ``backward`` and ``step`` go by it.
        """
        require_one_of("precision", precision, Precision)
        dtype = next(model.parameters(), torch.empty(0)).dtype
        self.precision = runtime.pick_precision(precision, self.device,
                                                str(dtype).removeprefix("torch."))
        why = torch_compat.compile_problem(self.device) if compile else None
        problems = [f"compile=True: {why}"] if why else []
        if problems := problems + self.options.problems(compile=compile,
                                                        precision=self.precision):
            raise ConfigError("; ".join(problems))
        self.scaler = torch.amp.GradScaler(self.device.type, enabled=self.precision == "fp16")
        model = model.to(self.device)
        if channels_last and not self.engine.contiguous_only:
            model = model.to(memory_format=torch.channels_last)
        if compile:
            model = torch.compile(model)
        # A loader's truth is its length: an epoch handed out is False.
        k = accumulation or (self._loader.accumulation if self._loader is not None else 1)
        self._accumulation, self._micro_steps = k, 0
        model, optimizer = self.engine.prepare(model, optimizer, k, precision=self.precision)
        if self._in_place is not None:  # a step whose collectives failed is not applied
            self._in_place.watch(optimizer, lambda: self.engine.failure is not None,
                                 self._drop_group)
        # From here on every rank draws its own random numbers (dropout, augmentation).
        runtime.seed_all(hash((self.seed, self.rank)))
        self._model = model
        return model, optimizer

    @staticmethod
    def unwrap(model: nn.Module) -> nn.Module:
        """The plain module under ``wrap``'s DDP and torch.compile wrappers: what to save
        or evaluate outside the job (its state_dict has no "module." prefixes)."""
        return unwrap(model)

    def autocast(self) -> contextlib.AbstractContextManager:
        """torch.autocast for the forward pass and loss at ``wrap``'s precision; a context
        that does nothing at fp32."""
        if self.precision in _AUTOCAST:
            return torch.autocast(self.device.type, dtype=_AUTOCAST[self.precision])
        return contextlib.nullcontext()

    @contextlib.contextmanager
    def micro_step(self):
        """Around forward and ``backward`` of one micro-batch: gradients are only
        accumulated (no allreduce) except on the last micro-batch of a global batch, and
        the forward pass runs under ``autocast``. Which one is last: the tracked loader's
        position says, else the count of micro-steps since ``step`` (``wrap``'s
        accumulation of them make a step). Needed where a step has several micro-batches;
        harmless otherwise."""
        self._micro_steps += 1
        with (contextlib.nullcontext() if self._at_step_boundary() or self._model is None
              else self.engine.no_sync(self._model)), self.autocast():
            yield

    def backward(self, loss: torch.Tensor) -> None:
        """loss.backward() for one micro-batch's ``loss``, divided by the accumulation (the
        step averages over the whole global batch) and scaled for fp16."""
        self.scaler.scale(loss * (self.engine.loss_scale / self._accumulation)).backward()

    def step(self, optimizer: Optimizer) -> bool:
        """After ``backward``: at the end of a global batch, ``optimizer``'s step (``wrap``'s
        optimizer) on the averaged gradients (unscaled, skipped where fp16 overflowed) and
        zero_grad; True then, False on the micro-batches before."""
        if not self._at_step_boundary():
            return False
        self.engine.step(optimizer, self.scaler)
        optimizer.zero_grad()
        self._micro_steps = 0
        return True

    def _at_step_boundary(self) -> bool:
        """Whether the micro-batch in hand completes the global batch."""
        if self._loader is not None:
            return self._loader.is_step_boundary
        return self._micro_steps % self._accumulation == 0

    # ----------------------------------------------------------------------- collectives

    def all_reduce(self, value: torch.Tensor | float, op: str = "mean") -> torch.Tensor:
        """``value`` (a number or a tensor, the same shape on every rank) summed
        (op="sum") or averaged (op="mean") over all ranks, as a float64 tensor on the
        device; a collective: every rank calls it."""
        require_one_of("op", op, ("mean", "sum"))
        tensor = torch.as_tensor(value, dtype=torch.float64, device=self.device).clone()
        self.engine.all_reduce_sum(tensor, "user")
        return tensor / self.world_size if op == "mean" else tensor

    def check_finite(self, loss: torch.Tensor | float) -> None:
        """Raise Diverged on every rank (exit 65 inside ``with``) when ``loss`` (this
        rank's) is NaN or infinite on any rank; a collective."""
        total = float(self.all_reduce(float(loss), "sum"))
        if not torch.isfinite(torch.tensor(total)):
            raise Diverged(self.step_count, total)

    # -------------------------------------------------------------------- checkpoints

    def track(self, **state: Any) -> None:
        """What every checkpoint holds: ``state``, by name (the keywords): objects with
        state_dict() and load_state_dict() (model, optimizer, scheduler, GradScaler,
        spotring.DataLoader) or plain dicts (restored in place). A wrapped or compiled
        model is saved as the plain module, so checkpoints load in any world size or
        engine. A tracked position (spotring.position.Position: a spotring.DataLoader, or
        the trainer's) gives ``step_count``; a tracked loader's dataset counts its reads
        (``count_reads``)."""
        self._checkpointer.tracked.update(state)
        for obj in state.values():
            if isinstance(obj, Position):
                self._position = obj
            if isinstance(obj, Resharded):
                self._hook(obj)
            if isinstance(obj, DataLoader):
                self.count_reads(obj.dataset)
        self._kept_in_place()

    def _hook(self, position: Resharded) -> None:
        """In place: processes join at the start of a step, before its first micro-batch
        is drawn by the position that counts the steps: where a process that joins
        begins too (after ``restore``), so that the members make no collective it does
        not (a save after should_stop, say)."""
        if self._in_place is not None:
            position.before_step = lambda: (
                self._in_place.step_starts(self)
                if position is (self._position or self._loader) else None)

    def count_reads(self, *datasets: Any) -> None:
        """Give the reads of ``datasets`` (those that count theirs: spotring.Shards) in
        summary.json, every rank's per epoch (``finish``). A loader's dataset, made by
        ``loader`` or tracked, counts already."""
        self._datasets += [d for d in datasets if hasattr(d, "reads")
                           and all(d is not known for known in self._datasets)]

    def annotate(self, **fields: Any) -> None:
        """``fields`` (JSON values: what the run trains) every checkpoint's manifest carries
        from now on. ``restore`` refuses a checkpoint whose manifest gives one of them
        another value (ConfigError, exit 2): annotate before you restore."""
        self._checkpointer.annotations.update(fields)

    @property
    def step_count(self) -> int:
        """Optimizer steps taken: the tracked position's (the same on every world size),
        else the calls of ``should_stop``."""
        return self._steps if self._position is None else self._position.step

    @property
    def saved_step(self) -> int | None:
        """The step of the newest checkpoint written or restored; None before either."""
        return self._checkpointer.saved_step

    @property
    def resumed_from(self) -> str | None:
        """Where the checkpoint ``restore`` loaded was; None on a fresh start."""
        return self._checkpointer.resumed_from

    def save(self, background: bool | None = None) -> int:
        """Checkpoint the tracked state (every rank calls it; every rank writes its part,
        spotring/checkpoint/manager.py): read back on disk and in the uri's store and published by
        its manifest, the oldest beyond ``keep`` dropped. Returns its step. Raises
        Diverged where a tracked model's weights are not finite: never a checkpoint to
        resume a diverged run from. Rank 0 notes in run_dir where the checkpoints are
        (spotring.checkpoint.directory_of reads it), wherever checkpoint.dir put them.

        background: return once the state is copied to CPU memory, and write while
            training goes on (a save in flight is waited for first); default
            CheckpointOptions.background. Its line ("spotring: checkpoint ...") comes
            from the training thread once it is published: at the next should_stop, save
            or close, never in the middle of a line the script prints. False: complete
            (and said) before it returns."""
        if self._counted_out:
            log.warning("the checkpoint of step %d is the others': this worker is no member "
                        "until it is taken in again", self.step_count)
            return self.step_count
        if self.is_main and not self._noted_where:
            note_where(self.run_dir, self.checkpoints)
            self._noted_where = True
        try:
            self._checkpointer.save(self.step_count, self._position, self.scaler,
                                    self.checkpoints.background if background is None
                                    else background)
            return self.step_count
        except Exception as e:
            # In place, a worker lost while the parts were written (one of the save's
            # collectives failed, or met the group a failed one dropped): the one before
            # stands, and the next step boundary goes on without the lost worker.
            if self._in_place is None or self.engine.failure is None and not (
                    engines.is_collective_failure(e.__cause__ or e)
                    or "Connection closed" in str(e)):  # DCP's, naming each rank's
                raise
            log.warning("the checkpoint of step %d was not saved: a worker was lost "
                        "while it was written", self.step_count)
            # Kept as its text alone: the error's frames hold the checkpoint's process
            # group, which must close its connections as it is dropped (below).
            self.engine.failed(ConnectionError(f"{type(e).__name__}: {e}"))
        self._checkpointer.drop_collectives()  # out of ``except``: ``e`` is let go
        return self.step_count

    def restore(self, source: str | Checkpoint | None = "auto") -> int | None:
        """Load a checkpoint into the tracked objects, on any world size; returns its step,
        or None where there is none (a fresh start). Every rank calls it, checks its share
        of the parts against the manifest (a checkpoint with a part missing, short or
        corrupt is skipped for the one before, naming the part) and reads the pieces its
        own tensors hold, whatever the world size and engine that wrote it.

        source (rank 0's counts): "auto", the newest valid checkpoint of the checkpoint
        directory and uri; "never", none (ConfigError where checkpoints exist, which new
        ones would mix with); the path of a manifest (ckpt-N.json), of a checkpoint's
        folder, or of a single-file checkpoint's .pt (older spotring); a Checkpoint
        already found, or a list of them found by spotring.checkpoint.layout.find_resume,
        tried as "auto" tries its own (None: none)."""
        if self._in_place is not None and self._in_place.joining:
            # A process that joins a job in place takes the members' state, not a
            # checkpoint's.
            step = self._in_place.join(self)
        else:
            step = self._checkpointer.restore(source, self.scaler)
        if step is not None:
            self._steps = self._start_step = step
        self._kept_in_place()
        return step

    # ---------------------------------------------------------------------------- stop

    def should_stop(self) -> bool:
        """True on every rank at the same step once any rank saw SIGTERM, SIGUSR1 or a
        spot notice (a collective: every rank calls it once per optimizer step; the ranks
        vote every PreemptionOptions.check_every_steps, by default as often as keeps the
        vote near 1% of the steps' time). An EC2 rebalance recommendation checkpoints
        here and goes on."""
        self._steps += 1
        self._checkpointer.step_taken()
        decision = self.preemption.decide()
        if self._in_place is not None and decision.stop is None and self._in_place.boundary(
                self, decision.leaving, decision.joining):
            return True
        if decision.checkpoint and self.saved_step != self.step_count:
            self.save()
        self._stop_reason = decision.stop
        return decision.stop is not None

    def save_and_exit(self) -> None:
        """Checkpoint (unless this step's is written), leave preempted.json in run_dir
        with the notice budget's times, and exit 75: run the same command again to
        continue."""
        if self.saved_step != self.step_count:
            self.save(background=False)
        self._checkpointer.wait()  # this step's checkpoint, begun in the background: finish it
        reason = self._stop_reason or "stop requested"
        saved = self._checkpointer.saved
        if self.is_main and not self._leaving:  # a job in place goes on without this rank
            timing = notice_budget(saved, self.checkpoints, reason, self.step_count,
                                   self.preemption.noticed_at or time.time(),
                                   notice_seconds=self.preemption.notice_seconds)
            write_atomic(self.run_dir / PREEMPTED, json.dumps(
                {"reason": reason, "step": self.step_count,
                 "checkpoint": saved.location, **timing}).encode())
        log.warning("preempted (%s) at step %d; exit %d: run the same command again to "
                    "continue", reason, self.step_count, EXIT_PREEMPTED)
        self.close()
        sys.exit(EXIT_PREEMPTED)

    # ------------------------------------------------------------------------- metrics

    def log(self, kind: str = "train", step: int | None = None, **scalars: float) -> None:
        """Rank 0: one record of metrics.jsonl ({"kind", "step", "epoch", ...scalars}) and
        the same scalars in TensorBoard as ``kind/name``. kind="test" records are what
        ``spotring sweep`` prunes on (``accuracy``, ``loss``). step: default
        ``step_count``. Values are rank 0's own (numbers or one-element tensors); average
        them first with ``all_reduce`` where they differ by rank."""
        if not self.is_main:
            return
        step = self.step_count if step is None else step
        position = self._position or self._loader
        self.telemetry.record(kind, step, None if position is None else position.epoch,
                              **{k: float(v) for k, v in scalars.items()})

    def finish(self, **results: Any) -> dict[str, Any]:
        """Rank 0: summary.json in run_dir (what ``spotring sweep`` and the reports read:
        ``results`` such as test_accuracy, over the run's steps, workers, global batch,
        seconds and img/s); then leave the process group. Returns the summary."""
        if self._in_place is not None:
            self._in_place.finishing(self)
        seconds = time.perf_counter() - self._started
        position = self._position or self._loader
        steps = self.step_count - self._start_step
        summary: dict[str, Any] = {
            "steps": self.step_count, "steps_this_run": steps, "train_seconds": seconds,
            "world_size": self.world_size, "launcher": self.launch.launcher,
            "engine": self.engine.name, "backend": self.engine.backend,
            "precision": self.precision, "run_dir": str(self.run_dir),
            "checkpoints": self.checkpoints.where,
        }
        if position is not None:
            summary |= {"global_batch": position.global_batch,
                        "epochs": self.step_count / position.steps_per_epoch,
                        "images_per_second": steps * position.global_batch
                        / max(seconds, 1e-9)}
        if self._in_place is not None:  # each change of workers in place, in order
            summary["in_place"] = self._in_place.changes
        summary |= gather_reads(self, self._datasets) | results  # every rank's, per epoch
        if self.is_main:
            write_atomic(self.run_dir / "summary.json",
                         json.dumps(summary, indent=2, default=str).encode())
        self.close()
        return summary

    # -------------------------------------------------------------------- in place
    # The job's part that spotring/elastic/in_place.py (the membership of a job in place,
    # which the job holds) calls at a step boundary: not the user's API.

    @property
    def _tracked(self) -> dict[str, Any]:
        """What every checkpoint holds (``track``'s objects), by name."""
        return self._checkpointer.tracked

    def _small_states(self) -> dict[str, Any]:
        """The tracked objects but models and optimizers (the loader's position,
        schedulers, the script's dicts), as their state_dicts, and the step count."""
        return {name: obj.state_dict() if hasattr(obj, "state_dict") else dict(obj)
                for name, obj in self._tracked.items()
                if not isinstance(obj, nn.Module | Optimizer)} | {None: self._steps}

    def _load_small_states(self, states: dict[str, Any]) -> None:
        """Back to ``states`` (small_states'): an iteration of the loader in progress goes
        on from its position there."""
        for name, state in states.items():
            if name is None:
                self._steps = state
            elif hasattr(obj := self._tracked[name], "load_state_dict"):
                obj.load_state_dict(state)
            else:
                obj.clear()
                obj.update(state)

    def _kept_in_place(self) -> None:
        """In place: the small states as they stand before the first step, where a step
        dropped before any step boundary goes back to."""
        if self._in_place is not None:
            self._in_place.commit(self)

    def _regroup(self, group: Group) -> None:
        """Form ``group``'s process group in place of this one: the engine and DDP's
        reducer move to it, the loaders (every tracked position.Resharded) split the same
        global batches over its ranks, the vote and the checkpoints' collectives start
        anew, and its rank 0 writes."""
        self.engine.regroup(group)
        self.rank, self.world_size = self.engine.rank, self.engine.world_size
        self._checkpointer.regrouped()
        self.preemption.regrouped()
        for resharded in {id(o): o for o in [*self._tracked.values(), self._loader]
                          if isinstance(o, Resharded)}.values():
            resharded.reshard(self.rank, self.world_size)
        if isinstance(counting := self._position or self._loader, Resharded):
            self._accumulation = counting.accumulation
        if self._telemetry is not None:  # rank 0's records, by this process or no more
            self._telemetry.switch(self.is_main, self.step_count)
        if log.handlers and not logging.getLogger().handlers:  # init's own lines
            log.setLevel(logging.INFO if self.is_main else logging.WARNING)

    def _drop_group(self) -> None:
        """A worker lost: let go of every hold on the broken group at once (the engine's,
        DDP's, the vote's, the checkpoints'), so that its connections close and the
        survivors waiting in it for this rank are freed."""
        self.preemption.regrouped()
        self._checkpointer.regrouped()
        self.engine.drop_group()

    def _wait_for_saves(self) -> None:
        """The background save in flight (if any) published, with the members it began
        with."""
        self._checkpointer.wait()

    def _abandon_saves(self) -> None:
        """A worker was lost: the background save in flight cannot complete; the one
        before stands."""
        self._checkpointer.abandon()

    def _stop_all(self, reason: str) -> bool:
        """In place, where the others cannot go on: every rank stops now, as on a notice
        (save_and_exit: the checkpoint, exit 75), for ``reason``."""
        self._stop_reason = self.preemption.stop_all(reason).stop
        log.warning("in place: %s", reason)
        return True

    def _leave(self, reason: str) -> None:
        """In place: this rank leaves (save_and_exit next), the others go on."""
        self._stop_reason, self._leaving = reason, True

    # ------------------------------------------------------------------------- leaving

    def close(self) -> None:
        """Stop watching for notices, flush the metrics, leave the process group; a
        second call does nothing."""
        if self._closed:
            return
        self._closed = True
        self._checkpointer.wait()
        self.preemption.close()
        if self._telemetry is not None:
            self._telemetry.close()
        if self._leaving:
            self.engine.leave()  # the others went on: no goodbye
        else:
            self.engine.shutdown()
        if self._in_place is not None:
            self._in_place.close(self._leaving)
        self.preemption.restore_signals()

    def __enter__(self) -> Job:
        return self

    def __exit__(self, kind, error, traceback) -> bool:
        if error is None:
            self.close()
            return False
        if isinstance(error, ConfigError):
            report_bad_input(error, self.rank, self.world_size)
            sys.exit(EXIT_CONFIG)
        if isinstance(error, Diverged):
            log.error("%s; exit %d", error, EXIT_DIVERGED)
            if self.is_main:
                write_atomic(self.run_dir / DIVERGED, json.dumps(
                    {"step": error.step, "loss": error.loss, "reason": str(error)}).encode())
            self.close()
            sys.exit(EXIT_DIVERGED)
        if engines.is_collective_failure(error):
            self.preemption.close()  # the handlers stay: a SIGTERM now must not end it silently
            exit_peer_lost(self.engine.describe_failure(error))
        self._finish_save_in_flight()
        return False

    def _finish_save_in_flight(self) -> None:
        """On a way out of ``with`` other than its end or a verdict of spotring's own
        (sys.exit, an exception): let the background save in flight finish, for at most
        the collectives' timeout, rather than end the process under it; logged either way.
        Its failure is logged, not raised: what ends the process is the error to see. The
        process group is not left together here: the other ranks may still be training."""
        step = self._checkpointer.in_flight
        if step is None:
            return
        timeout = self.options.timeout_s
        log.warning("waiting for the checkpoint of step %d, written in the background, "
                    "before exiting (at most %g s)", step, timeout)
        try:
            done = self._checkpointer.wait(timeout)
        except Exception as e:
            log.error("the checkpoint of step %d was not saved (%s: %s)", step,
                      type(e).__name__, e)
            return
        if done:
            log.warning("checkpoint of step %d complete", step)
        else:
            log.error("the checkpoint of step %d did not complete within %g s: the one "
                      "before it is the newest", step, timeout)
