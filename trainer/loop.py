"""The training loop: one file a reader can hold in their head.

Every optimizer step:

    lr = schedule(step)                        linear scaling + warmup + decay
    for each of K micro-batches:               this rank's slice of the global batch
        with job.micro_step():                 all but the last without the allreduce,
                                               which runs once per step; autocast for
                                               train.precision=bf16|fp16
            loss = criterion(model(x), y)
            job.backward(loss)                 loss / K (x the engine's loss scale),
                                               scaled for fp16
    job.step(optimizer)                        gradients are the average over all
                                               G = B x W x K samples of the global batch
    every log_every steps: metrics summed over ranks, logged by rank 0
    every checkpoint.every_steps and at each epoch end: checkpoint (every rank writes its part)
    every step: the ranks vote on spot notices; on one, checkpoint and stop (exit 75)
    a NaN or infinite loss in those metrics or a test: every rank stops (exit 65)

The loop knows neither the engine nor the launcher: it calls the spotring Job it is given
(spotring/job.py), the API a user's script uses: the micro-steps, backward and step,
checkpoints, the vote, the exit codes; and the engine's sums for its metrics.
"""

from __future__ import annotations

import logging
import math
import resource
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from omegaconf import DictConfig, OmegaConf

from spotring.exits import Diverged
from spotring.global_batch import split_global_batch
from spotring.job import Job
from spotring.position import refuse_another_global_batch
from spotring.sampler import steps_in_epoch
from spotring.telemetry import Telemetry, epoch_number
from spotring.torch_compat import compiled_graphs
from spotring.trainer.config import DType, global_batch
from spotring.trainer.data import Batch, Batches, LoaderBatches
from spotring.trainer.datasets import Dataset, MapDataset
from spotring.trainer.models import l1_penalty
from spotring.trainer.schedule import build_optimizer, lr_schedule

log = logging.getLogger(__name__)

DTYPES = {DType.float32: torch.float32, DType.float64: torch.float64}
# What a diverged run is told to try.
DIVERGED_HINT = "try a lower optim.lr (or more schedule.warmup_epochs)"


@dataclass
class Position:
    """Where a run is (a spotring.position.Position, as a spotring.DataLoader is for a
    user's script); every checkpoint holds it (job.track) and a resume starts from it, on
    any number of workers, refusing a checkpoint of another global batch as the library
    does (train.global_batch keeps it).

    It also holds this worker's split of the global batch: ``micro`` samples in each of
    ``accumulation`` micro-steps, the fewest that keep to ``batch_size`` (train.batch_size).
    A job in place splits it anew as its workers change (``reshard``: a
    spotring.position.Resharded), and ``moved`` tells the loop to draw its batches anew
    from the position: split anew, or set again (restored, or a step dropped)."""

    global_batch: int
    steps_per_epoch: int
    batch_size: int  # the most samples per micro-step
    rank: int
    world_size: int
    step: int = 0  # optimizer steps taken
    epoch: int = 0  # the epoch in progress (0-based)
    offset: int = 0  # samples of this epoch's order already consumed
    moved: bool = False
    before_step: Callable[[], None] | None = None  # the job's, in place

    def __post_init__(self) -> None:
        self.reshard(self.rank, self.world_size)
        self.moved = False

    def reshard(self, rank: int, world_size: int) -> None:
        self.micro, self.accumulation = split_global_batch(self.global_batch, world_size,
                                                           self.batch_size)
        self.rank, self.world_size, self.moved = rank, world_size, True

    def state_dict(self) -> dict[str, int]:
        return {"step": self.step, "epoch": self.epoch, "offset": self.offset,
                "global_batch": self.global_batch}

    def load_state_dict(self, state: dict[str, int]) -> None:
        refuse_another_global_batch(state["global_batch"], self.global_batch,
                                    "train.global_batch")
        self.step, self.epoch, self.offset = state["step"], state["epoch"], state["offset"]
        self.moved = True


def annotations(cfg: DictConfig) -> dict[str, Any]:
    """What every checkpoint's manifest says the run trains, and a resume must match
    (Job.annotate): the network's settings and the dataset. Not model.l1, a term of the
    loss, which a run may change and go on."""
    model = OmegaConf.to_container(cfg.model, resolve=True, enum_to_str=True)
    return {"model": {k: v for k, v in model.items() if k != "l1"},
            "dataset": cfg.dataset.name}


class Stopwatch:
    """Wall time of training steps only: paused around evaluation and checkpoints.
    Waits for the GPU at each pause, so asynchronous kernels are counted."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.total = 0.0
        self._start: float | None = None

    def start(self) -> None:
        if self._start is None:
            self._start = time.perf_counter()

    def pause(self) -> None:
        if self._start is not None:
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            self.total += time.perf_counter() - self._start
            self._start = None

    def read(self) -> float:
        self.pause()
        self.start()
        return self.total

    def add(self, seconds: float) -> None:
        """Count a stretch timed apart (a step that turned out not to compile)."""
        self.total += seconds


def _every(step: int, interval: int) -> bool:
    return interval > 0 and step % interval == 0


def _check_finite(loss: float, step: int, kind: str) -> None:
    if not math.isfinite(loss):
        raise Diverged(step, loss, kind, DIVERGED_HINT)


def _memory(model: torch.nn.Module, device: torch.device) -> dict[str, float]:
    """What the model takes, and the most this process has held."""
    params = list(model.parameters())
    if device.type == "cuda":
        # The most GPU memory tensors have taken at once (weights, gradients, optimizer
        # state, activations), not what the caching allocator reserved.
        peak = torch.cuda.max_memory_allocated(device) / 2**20
    else:
        # The process's peak resident set: the model and its tensors, and also the
        # dataset in memory, Python and torch's own libraries. KiB on Linux, bytes on macOS.
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / (
            2**20 if sys.platform == "darwin" else 2**10)
    return {
        "parameters": sum(p.numel() for p in params),  # the model's weights, counted
        "parameter_mb": sum(p.numel() * p.element_size() for p in params) / 2**20,  # MiB
        "peak_memory_mb": peak,  # MiB (summary.json: rank 0's)
    }


class Trainer:
    """The built-in trainer's loop over a spotring Job: the job joined the process group
    and owns the checkpoints, the vote on notices and the exit codes; the trainer trains
    ``model`` (trainer/models.py build_model, the same weights on every rank), feeds it
    this rank's batches and keeps the metrics."""

    def __init__(self, cfg: DictConfig, job: Job, dataset: Dataset | MapDataset,
                 model: torch.nn.Module) -> None:
        self.cfg, self.job, self.engine = cfg, job, job.engine
        self.global_batch = global_batch(cfg, job.world_size)
        # This worker's split of it (micro-batches x accumulation), made anew by a job in
        # place as its workers change.
        self.position = pos = Position(
            self.global_batch, steps_in_epoch(len(dataset.train), self.global_batch, 0),
            cfg.train.batch_size, job.rank, job.world_size)
        common = dict(global_batch=self.global_batch, rank=pos.rank, world_size=pos.world_size,
                      accumulation=pos.accumulation, seed=cfg.train.seed,
                      device=job.device, dtype=DTYPES[cfg.train.dtype],
                      memory_format=torch.channels_last if cfg.train.channels_last
                      else torch.contiguous_format)
        if isinstance(dataset, MapDataset):  # read item by item, by loader processes
            self.batches = LoaderBatches(dataset, workers=cfg.data.workers, **common)
        else:  # uint8 tensors in memory: sliced on the spot, faster
            self.batches = Batches(dataset, augment=cfg.dataset.augment, **common)
        self.schedule = lr_schedule(cfg, self.global_batch, self.batches.steps_per_epoch)
        self.total_steps = self.schedule.total_steps
        if cfg.train.max_steps is not None:
            self.total_steps = min(self.total_steps, cfg.train.max_steps)

        model = model.to(job.device, DTYPES[cfg.train.dtype])
        optimizer = build_optimizer(cfg.optim, model.parameters())
        # NHWC weights unless the engine's collectives need them contiguous (the image
        # batches come NHWC from self.batches). With train.compile, the model is compiled
        # before DDP wraps it: the compiled module then runs inside DDP's forward, where
        # torch.compile's DDPOptimizer splits the graph at DDP's gradient buckets, so the
        # allreduce still overlaps backward. (Compiling the DDP wrapper instead, as
        # PyTorch's notes suggest, compiles nothing of a torch.nn.Sequential in torch
        # 2.14: dynamo skips torch.nn's own forward frames after the graph break in DDP's
        # forward.) Horovod's hooks sit on the parameters, which the compiled module shares.
        self.model, self.optimizer = job.wrap(
            model, optimizer, precision=str(cfg.train.precision),
            channels_last=cfg.train.channels_last, compile=cfg.train.compile,
            accumulation=pos.accumulation)
        # Checkpoints hold the plain module's state (the job unwraps it), so that compiled
        # and plain runs resume each other.
        job.track(model=self.model, optimizer=optimizer, position=pos)
        job.count_reads(dataset.train, dataset.test)  # where they count theirs: Shards
        job.annotate(**annotations(cfg))
        self._compiling = bool(cfg.train.compile)  # until a step compiles nothing
        self.compile_seconds, self.compile_steps = 0.0, 0
        self.criterion = torch.nn.CrossEntropyLoss(label_smoothing=cfg.train.label_smoothing)
        self.stopwatch = Stopwatch(job.device)
        self.resumed_from: str | None = None
        # Running sums since the last log line, on the device: loss x n, correct, n.
        self._sums = torch.zeros(3, device=job.device, dtype=torch.float64)

    @property
    def raw_model(self) -> torch.nn.Module:
        """The plain module under the engine's and torch.compile's wrappers, which
        evaluation runs (under FSDP in place, the one sharded over the workers now)."""
        return self.job.unwrap(self.model)

    # ----------------------------------------------------------------------- the loop

    def fit(self, resume: Any = "auto") -> dict[str, Any]:
        """Resume (``resume``: job.restore's source), train to the end (or
        train.max_steps), evaluate, checkpoint. A notice ends the process with exit 75
        (job.save_and_exit), a divergence raises Diverged."""
        self._restore(resume)
        self.telemetry = Telemetry(self.job.run_dir, self.job.is_main, self.cfg.telemetry.progress,
                                   self.total_steps, self.position.step)
        self.job.telemetry = self.telemetry  # the job's records go to the same files
        try:
            return self._fit()
        finally:
            self.telemetry.close()

    def _fit(self) -> dict[str, Any]:
        pos, cfg, job = self.position, self.cfg, self.job
        start_step, last_log = pos.step, (self._timed_steps(), 0.0)
        evaluated_at = None
        lr = self.schedule(pos.step)
        log.info("training %s on %s: %d workers x batch %d x %d accumulation = global batch "
                 "%d, %d steps per epoch, LR %.4g -> %.4g (x%.3g, linear scaling rule); "
                 "precision %s, channels_last %s, compile %s",
                 cfg.model.name, cfg.dataset.name, pos.world_size, pos.micro,
                 pos.accumulation, self.global_batch, self.batches.steps_per_epoch,
                 self.schedule.base_lr, self.schedule.peak_lr,
                 self.global_batch / cfg.optim.reference_batch, job.precision,
                 str(cfg.train.channels_last).lower(), str(cfg.train.compile).lower())
        while pos.epoch < cfg.train.epochs and pos.step < self.total_steps:
            epoch_start = (self._timed_steps(), self.stopwatch.total)
            for batch in self._steps():
                self.stopwatch.start()
                lr = self.schedule.apply(self.optimizer, pos.step)
                take = self._compiling_step if self._compiling else self._train_step
                sums = take(batch)
                stepped = pos.step = pos.step + 1
                pos.offset = batch.offset
                if job.should_stop():
                    self.stopwatch.pause()
                    job.save_and_exit()
                if pos.step != stepped:  # a job in place dropped it (a worker lost): again
                    continue
                self._sums += sums
                self.telemetry.step(pos.step, lr)
                if _every(pos.step, cfg.telemetry.log_every):
                    last_log = self._log_interval(last_log, lr)
                if _every(pos.step, cfg.train.eval_every_steps):
                    test, evaluated_at = self.evaluate(), pos.step
                if _every(pos.step, cfg.checkpoint.every_steps):
                    self._checkpoint()
                if pos.step >= self.total_steps:
                    break
            self.stopwatch.pause()
            if self.batches.steps_left(pos.offset) == 0:  # the epoch is complete
                steps = self._timed_steps() - epoch_start[0]
                seconds = self.stopwatch.total - epoch_start[1]
                self.telemetry.epoch(pos.step, pos.epoch, seconds,
                                     steps * self.global_batch / max(seconds, 1e-9))
                pos.epoch, pos.offset = pos.epoch + 1, 0
                if evaluated_at != pos.step:
                    test, evaluated_at = self.evaluate(), pos.step
                self._checkpoint()
        if evaluated_at != pos.step:
            test = self.evaluate()
        self._checkpoint()
        steps = pos.step - start_step
        seconds = self.stopwatch.total
        # A run resumed at its last step trains for no time.
        images_per_second = (steps - self.compile_steps) * self.global_batch / max(seconds, 1e-9)
        return {
            "test_accuracy": test["accuracy"],
            "test_loss": test["loss"],
            "train_seconds": seconds,
            "images_per_second": images_per_second,
            # The workers at the end (a job in place changes them).
            "images_per_second_per_worker": images_per_second / pos.world_size,
            "world_size": pos.world_size,
            "global_batch": self.global_batch,
            "batch_size": pos.micro,
            "accumulation": pos.accumulation,
            "steps": pos.step,
            "steps_this_run": steps,
            "epochs": pos.step / self.batches.steps_per_epoch,
            "engine": self.engine.name,
            "backend": self.engine.backend,
            "final_lr": lr,
            "peak_lr": self.schedule.peak_lr,
            "dataset": cfg.dataset.name,
            "model_builder": cfg.model.name,  # trainer/models.py's; job.py adds "model"
            "resumed_from": self.resumed_from,
            "precision": job.precision,
            "channels_last": cfg.train.channels_last,
            "compile": cfg.train.compile,
            "compile_seconds": self.compile_seconds,
            "compile_steps": self.compile_steps,
            **_memory(self.raw_model, self.engine.device),
        }

    def _steps(self) -> Iterator[Batch]:
        """This rank's steps of the epoch in progress, from the position on: drawn anew
        where the position moved (a job in place split the batches anew, or dropped a
        step), each only once a job in place took in the processes that join it
        (``before_step``, which may split them anew)."""
        pos, epoch, steps = self.position, self.position.epoch, None
        while True:
            if pos.epoch == epoch - 1 and self.batches.steps_left(pos.offset) == 0:
                # The first step of the epoch dropped: the end of the one before is this
                # one's start (its end's evaluation and checkpoint are done).
                pos.epoch, pos.offset = epoch, 0
            if pos.epoch != epoch or self.batches.steps_left(pos.offset) == 0:
                return
            if pos.before_step is not None:
                pos.before_step()
            if steps is None or pos.moved:
                self._split()
                steps, pos.moved = self.batches.train(pos.epoch, pos.offset), False
            yield next(steps)

    def _split(self) -> None:
        """The batches split as the position says: this rank's share, in micro-batches."""
        pos = self.position
        self.batches.reshard(pos.rank, pos.world_size, pos.accumulation)

    def _timed_steps(self) -> int:
        """Steps whose time the stopwatch holds: all but those that compiled."""
        return self.position.step - self.compile_steps

    def _compiling_step(self, batch: Batch) -> torch.Tensor:
        """A training step while torch.compile may still compile, timed on its own
        (``_train_step``'s, returning its sums).

        compile_seconds is the whole wall time (the GPU waited for) of each step of this
        run, from the first on, in which torch.compile compiled a graph: tracing and
        compiling forward and backward, and that step's own computation, allreduce and
        optimizer step. Those steps are left out of train_seconds and of every img/s.
        The first step that compiles nothing counts as training, and from then on steps
        are not timed apart (a later recompilation would count as training time).
        Evaluation runs the module uncompiled.
        """
        self.stopwatch.pause()
        graphs = compiled_graphs()
        started = time.perf_counter()
        sums = self._train_step(batch)
        if self.engine.device.type == "cuda":
            torch.cuda.synchronize(self.engine.device)
        seconds = time.perf_counter() - started
        if compiled_graphs() > graphs:
            self.compile_seconds += seconds
            self.compile_steps += 1
        else:
            self.stopwatch.add(seconds)
            self._compiling = False
        self.stopwatch.start()
        return sums

    def _train_step(self, batch: Batch) -> torch.Tensor:
        """One optimizer step over the batch's micro-batches, as a script on the API
        takes it: the job's micro-steps (the allreduce on the last one only, autocast),
        its backward (divided by the accumulation, scaled for fp16) and its step. Returns
        this rank's sums of its loss x n, correct and n, for the metrics."""
        sums = torch.zeros(3, device=self.engine.device, dtype=torch.float64)
        for x, y in batch.micro:
            with self.job.micro_step():  # the loss comes out float32 under autocast too
                logits = self.model(x)
                loss = self.criterion(logits, y)
                with torch.no_grad():
                    sums += torch.stack([loss * len(y), (logits.argmax(1) == y).sum(),
                                         torch.tensor(len(y), device=y.device)])
                if self.cfg.model.l1:
                    loss = loss + self.cfg.model.l1 * l1_penalty(self.raw_model)
                self.job.backward(loss)
        stepped = self.job.step(self.optimizer)  # zero_grad too: grads to None
        assert stepped, "a global batch of other than the position's accumulation micro-batches"
        return sums

    def _log_interval(self, last: tuple[int, float], lr: float) -> tuple[int, float]:
        """Loss and accuracy over all ranks since the last log line (one small allreduce)."""
        sums = self.engine.all_reduce_sum(self._sums, "train_metrics").tolist()
        self._sums.zero_()
        now = self.stopwatch.read()
        step, timed = self.position.step, self._timed_steps()
        rate = (timed - last[0]) * self.global_batch / max(now - last[1], 1e-9)
        self.telemetry.train(step, self.position.epoch, lr, sums[0] / sums[2], sums[1] / sums[2],
                             rate)
        _check_finite(sums[0] / sums[2], step, "train")  # the same sum on every rank
        return timed, now

    @torch.no_grad()
    def evaluate(self) -> dict[str, float]:
        """Loss and accuracy on the test set (its first train.eval_samples), each sample
        counted once across ranks."""
        self.stopwatch.pause()
        self.raw_model.eval()
        self._split()  # the workers of a job in place may have changed since a step
        sums = torch.zeros(3, device=self.engine.device, dtype=torch.float64)
        for x, y in self.batches.test(self.cfg.train.eval_batch_size,
                                      self.cfg.train.eval_samples):
            with self.job.autocast():
                logits = self.raw_model(x)
            # Scored in the model's dtype (float64 runs in float64; bf16 logits of autocast
            # in the float32 of the weights).
            logits = logits.to(DTYPES[self.cfg.train.dtype])
            sums += torch.stack([F.cross_entropy(logits, y, reduction="sum"),
                                 (logits.argmax(1) == y).sum(),
                                 torch.tensor(len(y), device=y.device)])
        self.raw_model.train()
        loss, correct, n = self.engine.all_reduce_sum(sums, "test_metrics").tolist()
        result = {"loss": loss / n, "accuracy": correct / n}
        step = self.position.step
        self.telemetry.test(step, step / self.batches.steps_per_epoch, self.stopwatch.total,
                            **result)
        _check_finite(result["loss"], step, "test")
        return result

    # -------------------------------------------------------------------- checkpoints

    def _checkpoint(self) -> None:
        """The job's checkpoint of this step, unless it is written (the stopwatch paused)."""
        if self.job.saved_step != self.position.step:
            self.stopwatch.pause()
            self.job.save()

    def _restore(self, source: Any) -> None:
        if self.job.restore(source) is None:
            return
        pos = self.position
        self.resumed_from = self.job.resumed_from
        log.info("resumed at step %d (epoch %d, sample %d of its order)",
                 pos.step, epoch_number(pos.epoch), pos.offset)
