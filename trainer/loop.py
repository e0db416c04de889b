"""The training loop: one file a reader can hold in their head.

Every optimizer step:

    lr = schedule(step)                        linear scaling + warmup + decay
    for each of K micro-batches:               this rank's slice of the global batch
        loss = criterion(model(x), y) / K      (x engine.loss_scale: 1, or 1/W where
                                               the engine's allreduce sums; under
                                               autocast for train.precision=bf16|fp16)
        scaler.scale(loss).backward()          all but the last inside engine.no_sync:
                                               the allreduce runs once per step
    engine.step(optimizer, scaler)             gradients are the average over all
                                               G = B x W x K samples of the global batch
                                               (the scaler: fp16 only; else a no-op)
    every log_every steps: metrics summed over ranks, logged by rank 0
    every checkpoint.every_steps and at each epoch end: checkpoint (rank 0 writes)
    every step: the ranks vote on spot notices; on one, checkpoint and stop (exit 75)
    a NaN or infinite loss in those metrics or a test: every rank stops (exit 65)

The loop knows neither the engine nor the launcher: it only calls the Engine interface.
"""

from __future__ import annotations

import contextlib
import logging
import math
import resource
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from omegaconf import DictConfig, OmegaConf

from trainer import runtime
from trainer.checkpoint import Checkpoints, Saved
from trainer.config import DType, Precision, global_batch
from trainer.data import Batch, Batches
from trainer.datasets import Dataset
from trainer.engines import Engine
from trainer.models import build_model, l1_penalty
from trainer.preemption import NOTICE_SECONDS, Preempted, Preemption
from trainer.schedule import LRSchedule, build_optimizer
from trainer.telemetry import Telemetry

log = logging.getLogger(__name__)

DTYPES = {DType.float32: torch.float32, DType.float64: torch.float64}
AUTOCAST = {Precision.bf16: torch.bfloat16, Precision.fp16: torch.float16}


@dataclass
class Position:
    """Where a run is; a checkpoint stores it and a resume starts from it."""

    step: int = 0  # optimizer steps taken
    epoch: int = 0  # the epoch in progress (0-based)
    offset: int = 0  # samples of this epoch's order already consumed


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


def compiled_graphs() -> int:
    """How many graphs torch.compile has compiled in this process so far."""
    from torch._dynamo.utils import counters

    return counters["stats"]["unique_graphs"]


def _every(step: int, interval: int) -> bool:
    return interval > 0 and step % interval == 0


class Diverged(Exception):
    """Raised on every rank at the same step once a loss the ranks agreed on (the train
    loss summed at a log line, or the test loss) is NaN or infinite."""

    def __init__(self, step: int, loss: float, kind: str = "train") -> None:
        what = "the weights are not finite" if kind == "weights" else f"the {kind} loss is {loss}"
        super().__init__(f"{what} at step {step}: training diverged; try a lower optim.lr "
                         "(or more schedule.warmup_epochs)")
        self.step, self.loss = step, loss


def _check_finite(loss: float, step: int, kind: str) -> None:
    if not math.isfinite(loss):
        raise Diverged(step, loss, kind)


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
    def __init__(self, cfg: DictConfig, engine: Engine, dataset: Dataset, run_dir: Path,
                 checkpoints: Checkpoints, resume: dict[str, Any] | None) -> None:
        self.cfg, self.engine, self.run_dir, self.checkpoints = cfg, engine, run_dir, checkpoints
        self.world_size = engine.world_size
        self.global_batch = global_batch(cfg, engine.world_size)
        self.batches = Batches(
            dataset, global_batch=self.global_batch, rank=engine.rank,
            world_size=engine.world_size, accumulation=cfg.train.accumulation,
            seed=cfg.train.seed, augment=cfg.dataset.augment, device=engine.device,
            dtype=DTYPES[cfg.train.dtype],
            memory_format=torch.channels_last if cfg.train.channels_last
            else torch.contiguous_format,
        )
        self.schedule = LRSchedule.from_config(cfg, self.global_batch, self.batches.steps_per_epoch)
        self.total_steps = self.schedule.total_steps
        if cfg.train.max_steps is not None:
            self.total_steps = min(self.total_steps, cfg.train.max_steps)

        # The same seed on every rank gives every rank the same initial weights.
        runtime.seed_all(cfg.train.seed)
        model = build_model(cfg.model, dataset.shape, dataset.num_classes).to(
            engine.device, DTYPES[cfg.train.dtype])
        # NHWC: the 4-D weights (convolutions) here, unless the engine's collectives
        # need them contiguous; the image batches come NHWC from self.batches.
        if cfg.train.channels_last and not engine.contiguous_only:
            model = model.to(memory_format=torch.channels_last)
        optimizer = build_optimizer(cfg.optim, model.parameters())
        # fp16 only: float16 gradients underflow without a loss scale. The allreduce
        # averages the scaled float32 gradients; engine.step unscales them.
        self.scaler = torch.amp.GradScaler(engine.device.type,
                                           enabled=cfg.train.precision == Precision.fp16)
        self.position = Position()
        self.resumed_from = None
        if resume is not None:
            self._restore(resume, model, optimizer)
        else:
            runtime.seed_all(hash((cfg.train.seed, engine.rank)))  # per-rank randomness
        # The plain module: checkpoints hold its state (no "_orig_mod." or "module."
        # prefixes), so compiled and plain runs resume each other; evaluation runs it.
        self.raw_model = model
        if cfg.train.compile:
            # Compiled before DDP wraps it: the compiled module then runs inside DDP's
            # forward, where torch.compile's DDPOptimizer splits the graph at DDP's
            # gradient buckets, so the allreduce still overlaps backward. (Compiling the
            # DDP wrapper instead, as PyTorch's notes suggest, compiles nothing of a
            # torch.nn.Sequential in torch 2.14: dynamo skips torch.nn's own forward
            # frames after the graph break in DDP's forward.) Horovod's hooks sit on the
            # parameters, which the compiled module shares.
            model = torch.compile(model)
        self._compiling = bool(cfg.train.compile)  # until a step compiles nothing
        self.model, self.optimizer = engine.prepare(model, optimizer, cfg.train.accumulation)
        self.compile_seconds, self.compile_steps = 0.0, 0
        self.criterion = torch.nn.CrossEntropyLoss(label_smoothing=cfg.train.label_smoothing)
        self.telemetry = Telemetry(run_dir, engine.rank == 0, cfg.telemetry.progress,
                                   self.total_steps, self.position.step)
        self.stopwatch = Stopwatch(engine.device)
        self._last_saved = "(written by rank 0)"
        self._saved: Saved | None = None  # rank 0's newest checkpoint
        # Running sums since the last log line, on the device: loss x n, correct, n.
        self._sums = torch.zeros(3, device=engine.device, dtype=torch.float64)

    # ----------------------------------------------------------------------- the loop

    def fit(self) -> dict[str, Any]:
        """Train to the end (or train.max_steps), evaluate, checkpoint; raises Preempted."""
        preemption = Preemption(self.cfg.preemption, self.engine, self.engine.local_rank)
        try:
            return self._fit(preemption)
        finally:
            preemption.close()
            self.telemetry.close()

    def _fit(self, preemption: Preemption) -> dict[str, Any]:
        pos, cfg = self.position, self.cfg
        start_step, last_log = pos.step, (self._timed_steps(), 0.0)
        saved_at = evaluated_at = None
        lr = self.schedule(pos.step)
        log.info("training %s on %s: %d workers x batch %d x %d accumulation = global batch "
                 "%d, %d steps per epoch, LR %.4g -> %.4g (x%.3g, linear scaling rule); "
                 "precision %s, channels_last %s, compile %s",
                 cfg.model.name, cfg.dataset.name, self.world_size, cfg.train.batch_size,
                 cfg.train.accumulation, self.global_batch, self.batches.steps_per_epoch,
                 self.schedule.base_lr, self.schedule.peak_lr,
                 self.global_batch / cfg.optim.reference_batch, cfg.train.precision,
                 str(cfg.train.channels_last).lower(), str(cfg.train.compile).lower())
        while pos.epoch < cfg.train.epochs and pos.step < self.total_steps:
            epoch_start = (self._timed_steps(), self.stopwatch.total)
            for batch in self.batches.train(pos.epoch, pos.offset):
                self.stopwatch.start()
                lr = self.schedule.apply(self.optimizer, pos.step)
                if self._compiling:
                    self._compiling_step(batch)
                else:
                    self._train_step(batch)
                pos.step, pos.offset = pos.step + 1, batch.offset
                self.telemetry.step(pos.step, lr)
                if _every(pos.step, cfg.telemetry.log_every):
                    last_log = self._log_interval(last_log, lr)
                if _every(pos.step, cfg.train.eval_every_steps):
                    test, evaluated_at = self.evaluate(), pos.step
                if _every(pos.step, cfg.checkpoint.every_steps):
                    saved_at = self._checkpoint()
                decision = preemption.decide()
                if (decision.stop or decision.checkpoint) and saved_at != pos.step:
                    saved_at = self._checkpoint()
                if decision.stop:
                    raise Preempted(decision.stop, pos.step, self._last_saved,
                                    self._notice_budget(decision.stop, preemption.noticed_at))
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
                if saved_at != pos.step:
                    saved_at = self._checkpoint()
        if evaluated_at != pos.step:
            test = self.evaluate()
        if saved_at != pos.step:
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
            "images_per_second_per_worker": images_per_second / self.world_size,
            "world_size": self.world_size,
            "global_batch": self.global_batch,
            "batch_size": cfg.train.batch_size,
            "accumulation": cfg.train.accumulation,
            "steps": pos.step,
            "steps_this_run": steps,
            "epochs": pos.step / self.batches.steps_per_epoch,
            "engine": self.engine.name,
            "backend": self.engine.backend,
            "final_lr": lr,
            "peak_lr": self.schedule.peak_lr,
            "dataset": cfg.dataset.name,
            "model": cfg.model.name,
            "resumed_from": self.resumed_from,
            "precision": str(cfg.train.precision),
            "channels_last": cfg.train.channels_last,
            "compile": cfg.train.compile,
            "compile_seconds": self.compile_seconds,
            "compile_steps": self.compile_steps,
            **_memory(self.raw_model, self.engine.device),
        }

    def _timed_steps(self) -> int:
        """Steps whose time the stopwatch holds: all but those that compiled."""
        return self.position.step - self.compile_steps

    def _compiling_step(self, batch: Batch) -> None:
        """A training step while torch.compile may still compile, timed on its own.

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
        self._train_step(batch)
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

    def _autocast(self) -> contextlib.AbstractContextManager:
        precision = self.cfg.train.precision
        if precision == Precision.fp32:
            return contextlib.nullcontext()
        return torch.autocast(self.engine.device.type, dtype=AUTOCAST[precision])

    def _train_step(self, batch: Batch) -> None:
        k = len(batch.micro)
        for i, (x, y) in enumerate(batch.micro):
            sync = i == k - 1  # only the last micro-step's backward runs the allreduce
            with contextlib.nullcontext() if sync else self.engine.no_sync(self.model):
                with self._autocast():  # the loss comes out float32 either way
                    logits = self.model(x)
                    loss = self.criterion(logits, y)
                with torch.no_grad():
                    self._sums += torch.stack([loss * len(y), (logits.argmax(1) == y).sum(),
                                               torch.tensor(len(y), device=y.device)])
                if self.cfg.model.l1:
                    loss = loss + self.cfg.model.l1 * l1_penalty(self.raw_model)
                self.scaler.scale(loss * (self.engine.loss_scale / k)).backward()
        self.engine.step(self.optimizer, self.scaler)
        self.optimizer.zero_grad()  # sets grads to None (torch >= 2.0)

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
        sums = torch.zeros(3, device=self.engine.device, dtype=torch.float64)
        for x, y in self.batches.test(self.cfg.train.eval_batch_size,
                                      self.cfg.train.eval_samples):
            with self._autocast():
                logits = self.raw_model(x)
            sums += torch.stack([F.cross_entropy(logits.float(), y, reduction="sum"),
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

    def _checkpoint(self) -> int:
        self.stopwatch.pause()
        # Never a checkpoint of diverged weights to resume from. The ranks hold the same
        # weights, so each comes to the same answer.
        if not all(bool(torch.isfinite(p).all()) for p in self.raw_model.parameters()):
            raise Diverged(self.position.step, float("nan"), "weights")
        rng = self.engine.all_gather_object(runtime.rng_state())  # every rank's, for resume
        if self.engine.rank == 0:
            pos = self.position
            state = {
                "model": self.raw_model.state_dict(),
                "optimizer": self.optimizer.state_dict(),
                "scaler": self.scaler.state_dict(),  # {} unless train.precision=fp16
                "position": asdict(pos),
                "global_batch": self.global_batch,
                "schedule": {"step": pos.step, "peak_lr": self.schedule.peak_lr},
                "rng": rng,
                # Plain strings for the enum fields: weights_only loading takes no classes.
                "config": OmegaConf.to_container(self.cfg, resolve=True, enum_to_str=True),
            }
            meta = {
                "step": pos.step, "epoch": pos.epoch, "offset": pos.offset,
                "model": OmegaConf.to_container(self.cfg.model, resolve=True, enum_to_str=True),
                "dataset": self.cfg.dataset.name,
                "world_size": self.world_size, "global_batch": self.global_batch,
            }
            self._saved = self.checkpoints.save(state, meta)
            self._last_saved = self._saved.location
            log.info("checkpoint %s, %s", self._last_saved, self._saved.describe())
        return self.position.step

    def _notice_budget(self, reason: str, noticed_at: float) -> dict[str, float]:
        """Rank 0: how long the checkpoint the run stops with took after the notice (or
        signal) reached this process, against EC2's NOTICE_SECONDS. Logs one line and
        returns preempted.json's fields (epoch seconds; noticed_at <= local_saved_at <=
        saved_at, a time clamped to noticed_at where that checkpoint was already written
        when the notice came):

            noticed_at       the notice or signal reached rank 0 (or the others' vote did)
            local_saved_at   the checkpoint complete in checkpoint.dir
            saved_at         complete and read back on every store (S3 too)
            upload_seconds, upload_bytes   the S3 store's share (with checkpoint.uri)
        """
        if self.engine.rank != 0:
            return {}
        saved = self._saved
        fields = {"noticed_at": noticed_at,
                  "local_saved_at": max(saved.done_at[self.checkpoints.local.where], noticed_at),
                  "saved_at": max(saved.complete_at, noticed_at)}
        if self.checkpoints.remote is not None:
            fields |= {"upload_seconds": saved.seconds[self.checkpoints.remote.where],
                       "upload_bytes": saved.bytes}
        spent = fields["saved_at"] - noticed_at
        # Past the notice the instance is gone, and so is a checkpoint not yet uploaded.
        log.log(logging.INFO if spent <= NOTICE_SECONDS else logging.WARNING,
                "notice budget (%s): checkpoint of step %d, %s; notice to the local copy "
                "%.2f s, to every store and read back %.2f s: %.2f s left of EC2's %d s",
                reason, self.position.step, saved.describe(),
                fields["local_saved_at"] - noticed_at, spent, NOTICE_SECONDS - spent,
                NOTICE_SECONDS)
        return fields

    def _restore(self, state: dict[str, Any], model: torch.nn.Module,
                 optimizer: torch.optim.Optimizer) -> None:
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        if self.scaler.is_enabled() and state.get("scaler"):  # fp16 then and now
            self.scaler.load_state_dict(state["scaler"])
        self.position = Position(**state["position"])
        self.resumed_from = state.get("source")
        rngs = state["rng"]
        if len(rngs) == self.world_size:
            runtime.set_rng_state(rngs[self.engine.rank])
        else:  # another world size: fresh, but still reproducible, per-rank streams
            runtime.seed_all(hash((self.cfg.train.seed, self.engine.rank, self.position.step)))
        log.info("resumed at step %d (epoch %d, sample %d of its order)",
                 self.position.step, self.position.epoch + 1, self.position.offset)
        before = state.get("global_batch", self.global_batch)
        if before != self.global_batch:
            log.warning("the checkpoint was trained with global batch %d, this run has %d: "
                        "the steps now group other samples and the LR scales to the new batch; "
                        "keep the global batch with train.accumulation to continue the same "
                        "run", before, self.global_batch)
        elif len(rngs) != self.world_size:
            log.info("%d workers now, %d before; global batch %d kept (%d x %d x %d): "
                     "the same samples in the same steps", self.world_size, len(rngs),
                     self.global_batch, self.cfg.train.batch_size, self.world_size,
                     self.cfg.train.accumulation)
