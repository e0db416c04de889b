"""One training job, start to end, as every rank runs it.

    1. check the config, find the data, pick the device   (no network yet: bad input
    2. rank 0: find the checkpoint to resume from          fails here, on every rank,
                                                           with one clear paragraph)
    3. join the process group (the engine)
    4. rank 0's checkpoint to every rank; train; evaluate
    5. rank 0: summary.json and the closing lines

Exit codes: trainer/exits.py (0 done, 1 failed, 2 bad input, 65 diverged, 69 a rank
lost, 75 preempted).
"""

from __future__ import annotations

import json
import logging
import socket
import sys
import time
from pathlib import Path
from typing import Any

import torch
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

from trainer import datasets, engines, runtime
from trainer.checkpoint import Checkpoints, check_compatible, find_resume
from trainer.config import ConfigError, global_batch, validate
from trainer.exits import (
    DIVERGED,
    EXIT_CONFIG,
    EXIT_DIVERGED,
    EXIT_OK,
    EXIT_PREEMPTED,
    PREEMPTED,
    exit_peer_lost,
)
from trainer.loop import Diverged, Trainer
from trainer.preemption import Preempted
from trainer.stores import write_atomic

log = logging.getLogger("trainer")

# torchrun and horovodrun stop every rank as soon as one exits: on bad input each rank
# waits this long after its message, so that every rank (rank 0 first) gets to say it.
BAD_INPUT_GRACE_S = 3.0


def run(cfg: DictConfig) -> int:
    launch = runtime.detect()
    try:
        checkpoints, found, dataset, device = _prepare(cfg, launch)
    except ConfigError as e:
        report_bad_input(e, launch)
        return EXIT_CONFIG

    engine = engines.create(cfg.engine, launch, device)
    try:
        summary = _fit(cfg, engine, dataset, checkpoints, found) | {"launcher": launch.launcher}
    except Preempted as e:
        log.warning("%s; exit %d: run again with resume=auto to continue", e, EXIT_PREEMPTED)
        _leave_note(engine, PREEMPTED, reason=e.reason, step=e.step, checkpoint=e.checkpoint,
                    **e.timing)
        code = EXIT_PREEMPTED
    except Diverged as e:
        log.error("%s; exit %d", e, EXIT_DIVERGED)
        _leave_note(engine, DIVERGED, step=e.step, loss=e.loss, reason=str(e))
        code = EXIT_DIVERGED
    except Exception as e:
        if not _is_collective_failure(e):
            raise
        exit_peer_lost(engine.describe_failure(e))
    else:
        if engine.rank == 0:
            _report(cfg, summary, checkpoints)
        code = EXIT_OK
    # Outside the except clauses, so that no traceback keeps the trainer (and through its
    # wrapped model, the process group) alive past the engine's shutdown.
    engine.shutdown()
    return code


def _leave_note(engine: engines.Engine, name: str, **fields: Any) -> None:
    """Rank 0's note in the run dir of why the run stopped, for launchers that do not
    pass exit codes on (torchrun). preempted.json: reason, step, checkpoint, and the
    notice budget's times (noticed_at, local_saved_at, saved_at; upload_seconds and
    upload_bytes with S3: Trainer._notice_budget)."""
    if engine.rank == 0:
        write_atomic(_run_dir() / name, json.dumps(fields).encode())


def _fit(cfg: DictConfig, engine: engines.Engine, dataset, checkpoints: Checkpoints,
         found) -> dict[str, Any]:
    """Rank 0's checkpoint (if any) to every rank, then training; the trainer, its model
    and optimizer are garbage once this returns."""
    resume = engine.broadcast_object(_load(found))
    return Trainer(cfg, engine, dataset, _run_dir(), checkpoints, resume).fit()


def _prepare(cfg: DictConfig, launch: runtime.Launch):
    """Everything that can fail on bad input, done before any process group exists."""
    validate(cfg)
    if cfg.engine.name == "horovod":
        from trainer.engines.horovod import require_horovod

        require_horovod(cfg.engine, launch)
    device = runtime.pick_device(cfg.train.device, launch.local_rank)
    cfg.train.precision = runtime.pick_precision(cfg.train.precision, device, cfg.train.dtype)
    if cfg.engine.backend == "mpi" and (launch.launcher != "mpi" or device.type == "cuda"):
        raise ConfigError(
            f"engine.backend=mpi averages gradients over MPI on CPUs: start the job with "
            f"mpirun on CPU workers (here: {launch.launcher}, {device.type}); on GPUs NCCL "
            "is the fast path (engine.backend=auto)")
    runtime.set_threads(cfg.train.threads, launch.local_world_size)
    runtime.keep_freed_memory()
    dataset = datasets.load(cfg.dataset, cfg.data, cfg.train.seed)
    batch = global_batch(cfg, launch.world_size)
    if batch > len(dataset.train):
        raise ConfigError(
            f"global batch {batch} (train.batch_size={cfg.train.batch_size} x "
            f"{launch.world_size} workers x train.accumulation={cfg.train.accumulation}) "
            f"is larger than the {len(dataset.train)} training samples of {dataset.name}")
    checkpoints = Checkpoints(cfg.checkpoint.dir, cfg.checkpoint.keep, cfg.checkpoint.uri)
    found = None
    if launch.rank == 0:  # only rank 0 reads checkpoints; the others get its copy
        if checkpoints.remote is not None:
            checkpoints.remote.check_access()
        found = find_resume(cfg.resume, checkpoints)
        if found is not None:
            model = OmegaConf.to_container(cfg.model, resolve=True, enum_to_str=True)
            check_compatible(found, model, cfg.dataset.name)
    return checkpoints, found, dataset, device


def _load(found) -> dict[str, Any] | None:
    if found is None:
        return None
    return found.load() | {"source": found.location}


def _run_dir() -> Path:
    return Path(HydraConfig.get().runtime.output_dir)


def report_bad_input(error: ConfigError, launch: runtime.Launch) -> None:
    where = "" if launch.world_size == 1 else f"rank {launch.rank} ({socket.gethostname()}): "
    if launch.rank == 0 or isinstance(error, datasets.DataError):  # data is per host
        print(f"spotring: {where}error: {error}", file=sys.stderr)
    else:  # the same config fails the same way on every rank: one full copy is enough
        print(f"spotring: {where}stopped: bad configuration (rank 0 says which)", file=sys.stderr)
    if launch.world_size > 1:
        time.sleep(BAD_INPUT_GRACE_S)


def _is_collective_failure(error: BaseException) -> bool:
    if isinstance(error, torch.distributed.DistError):
        return True
    name = type(error).__name__
    text = str(error).lower()
    # DDP's reducer raises a plain RuntimeError with the transport's message, such as
    # "Application timeout caused pair closure" when an earlier collective on the same
    # connection (the vote in flight) timed out first.
    return name == "HorovodInternalError" or (
        isinstance(error, RuntimeError)
        and any(s in text for s in ("gloo", "nccl", "connection closed", "timed out",
                                    "pair closure")))


def _report(cfg: DictConfig, summary: dict[str, Any], checkpoints: Checkpoints) -> None:
    run_dir = _run_dir()
    summary = {
        **summary,
        "run_dir": str(run_dir),
        "tensorboard": str(run_dir / "tensorboard"),
        "metrics": str(run_dir / "metrics.jsonl"),
        "checkpoints": checkpoints.where,
    }
    write_atomic(run_dir / "summary.json", json.dumps(summary, indent=2).encode())
    log_file = run_dir / f"{HydraConfig.get().job.name}.log"
    compiling = (f"{summary['compile_seconds']:.1f} s compiling (first steps, not counted), "
                 if summary["compile"] else "")
    print(
        f"\nspotring: {cfg.model.name} on {cfg.dataset.name}: test accuracy "
        f"{100 * summary['test_accuracy']:.2f}% (loss {summary['test_loss']:.4f}) "
        f"after {summary['epochs']:.2f} epochs, {summary['steps']} steps\n"
        f"  time        {summary['train_seconds']:.1f} s training, {compiling}"
        f"{summary['images_per_second']:.0f} img/s "
        f"({summary['images_per_second_per_worker']:.0f} per worker)\n"
        f"  workers     {summary['world_size']} x batch {cfg.train.batch_size} x "
        f"{cfg.train.accumulation} accumulation = {summary['global_batch']}, "
        f"engine {summary['engine']} ({summary['backend']}), {summary['precision']}, "
        f"final LR {summary['final_lr']:.4g}\n"
        f"  logs        {log_file if log_file.exists() else run_dir}, {summary['metrics']}\n"
        f"  tensorboard {summary['tensorboard']}  (tensorboard --logdir {summary['tensorboard']})\n"
        f"  checkpoints {summary['checkpoints']}\n"
        f"  summary     {run_dir / 'summary.json'}",
        flush=True,
    )
