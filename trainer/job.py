"""One training job, start to end, as every rank runs it.

    1. check the config, load the data, build the model   (no network yet: bad input,
    2. open the checkpoint stores; rank 0 checks the       a user's _target_ too, fails
       uri's and finds the checkpoints to resume from,     here, on every rank, with
       the newest of which must match                      one clear paragraph)
    3. spotring.init with those stores: the device, the
       engine checked, the process group joined (the API
       a user's script uses, with the config's options)
    4. restore from what rank 0 found (each rank its part); train; evaluate
    5. rank 0: summary.json and the closing lines

The run reads the launch contract as any script does (spotring/contract.py): its run
directory is Hydra's, which conf/config.yaml takes from $SPOTRING_RUN_DIR where a
launcher set it, and checkpoint.uri defaults to $SPOTRING_CHECKPOINT_URI
(spotring.CheckpointOptions).

Exit codes: spotring/exits.py (0 done, 1 failed, 2 bad input, 65 diverged, 69 a rank
lost, 75 preempted); spotring.init and the Job make them.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf
from torch import nn

import spotring
from spotring import exits, runtime
from spotring.checkpoint.layout import Checkpoint, Checkpoints, find_resume
from spotring.exits import EXIT_CONFIG, EXIT_OK, ConfigError
from spotring.global_batch import split_global_batch
from spotring.position import refuse_another_global_batch
from spotring.trainer import datasets
from spotring.trainer.config import global_batch
from spotring.trainer.loop import Trainer, annotations
from spotring.trainer.models import build_model
from spotring.trainer.validation import validate

log = logging.getLogger("trainer")


def run(cfg: DictConfig) -> int:
    launch = runtime.detect()
    try:
        dataset, model = _prepare(cfg, launch)
        checkpoints, resume = _resume_from(cfg, launch)
    except ConfigError as e:
        report_bad_input(e, launch)
        return EXIT_CONFIG
    # init exits 2 itself on bad input. From here the job's signal handlers turn SIGTERM
    # and SIGUSR1 into a stop at a step boundary, and leaving the with block makes the
    # exit code (75, 65, 69).
    with spotring.init(engine=OmegaConf.to_object(cfg.engine), device=str(cfg.train.device),
                       run_dir=_run_dir(), checkpoint=checkpoints,
                       preemption=OmegaConf.to_object(cfg.preemption),
                       elastic=OmegaConf.to_object(cfg.elastic),
                       threads=cfg.train.threads, seed=cfg.train.seed) as job:
        results = Trainer(cfg, job, dataset, model).fit(resume)
        summary = job.finish(**results, model=_model_option(cfg),
                             tensorboard=str(_run_dir() / "tensorboard"),
                             metrics=str(_run_dir() / "metrics.jsonl"))
        if job.is_main:
            _report(cfg, summary)
    return EXIT_OK


def _prepare(cfg: DictConfig, launch: runtime.Launch
             ) -> tuple[datasets.Dataset | datasets.MapDataset, nn.Module]:
    """Everything of the trainer's own that can fail on bad input, done before any
    process group exists: the data and the model too (a _target_ of the user's fails
    here, with exit code 2)."""
    validate(cfg)
    runtime.set_threads(cfg.train.threads, launch.local_world_size)
    runtime.keep_freed_memory()
    dataset = datasets.load(cfg.dataset, cfg.data, cfg.train.seed)
    runtime.seed_all(cfg.train.seed)  # the same initial weights on every rank
    model = build_model(cfg.model, dataset.shape, dataset.num_classes)
    # What ran, for the log, summary.json and the checkpoints: a _target_ by its name.
    cfg.dataset.name = dataset.name
    cfg.model.name = cfg.model._target_ or cfg.model.name
    batch = global_batch(cfg, launch.world_size)
    # Split over the workers by the trainer's position (trainer/loop.py), in micro-batches
    # of at most train.batch_size: checked here, before any process group.
    split_global_batch(batch, launch.world_size, cfg.train.batch_size)
    if batch > len(dataset.train):
        made = ("train.global_batch" if cfg.train.global_batch is not None else
                f"train.batch_size={cfg.train.batch_size} x {launch.world_size} workers x "
                f"train.accumulation={cfg.train.accumulation}")
        raise ConfigError(f"global batch {batch} ({made}) is larger than the "
                          f"{len(dataset.train)} training samples of {dataset.name}")
    return dataset, model


def _resume_from(cfg: DictConfig, launch: runtime.Launch
                 ) -> tuple[Checkpoints, Sequence[Checkpoint] | Checkpoint | None]:
    """The run's checkpoint stores, opened once for the whole job, and what its restore
    starts from (rank 0's counts: job.restore's source). Rank 0 checks the uri's store and
    finds the checkpoints resume= names, before any process group: the newest must match
    the run (annotations, global batch) or the run stops with exit 2; the restore then
    checks their parts, all ranks together, newest first."""
    checkpoints = OmegaConf.to_object(cfg.checkpoint).open(_run_dir())
    if launch.rank != 0:
        return checkpoints, None
    checkpoints.check_access()
    found = find_resume(cfg.resume, checkpoints)
    if found:
        found[0].check_matches(annotations(cfg))
        if "global_batch" in found[0].manifest:
            refuse_another_global_batch(found[0].manifest["global_batch"],
                                        global_batch(cfg, launch.world_size),
                                        "train.global_batch")
    return checkpoints, found if cfg.resume == "auto" else (found[0] if found else None)


def _run_dir() -> Path:
    return Path(HydraConfig.get().runtime.output_dir)


def _model_option(cfg: DictConfig) -> str:
    """What ran: model._target_ where one is given, else the model group option the run
    was composed with (model=fast_convnet), where several options share one builder
    (cfg.model.name, convnet)."""
    return cfg.model._target_ or HydraConfig.get().runtime.choices["model"]


def report_bad_input(error: ConfigError, launch: runtime.Launch) -> None:
    # Data is each host's own: every rank that lacks it says so.
    exits.report_bad_input(error, launch.rank, launch.world_size,
                           everyone=isinstance(error, datasets.DataError))


def _report(cfg: DictConfig, summary: dict[str, Any]) -> None:
    """Rank 0's closing lines: what summary.json (job.finish) holds, for a reader."""
    run_dir = _run_dir()
    log_file = run_dir / f"{HydraConfig.get().job.name}.log"
    compiling = (f"{summary['compile_seconds']:.1f} s compiling (first steps, not counted), "
                 if summary["compile"] else "")
    print(
        f"\nspotring: {summary['model']} on {cfg.dataset.name}: test accuracy "
        f"{100 * summary['test_accuracy']:.2f}% (loss {summary['test_loss']:.4f}) "
        f"after {summary['epochs']:.2f} epochs, {summary['steps']} steps\n"
        f"  time        {summary['train_seconds']:.1f} s training, {compiling}"
        f"{summary['images_per_second']:.0f} img/s "
        f"({summary['images_per_second_per_worker']:.0f} per worker)\n"
        f"  workers     {summary['world_size']} x batch {summary['batch_size']} x "
        f"{summary['accumulation']} accumulation = {summary['global_batch']}, "
        f"engine {summary['engine']} ({summary['backend']}), {summary['precision']}, "
        f"final LR {summary['final_lr']:.4g}\n"
        f"  logs        {log_file if log_file.exists() else run_dir}, {summary['metrics']}\n"
        f"  tensorboard {summary['tensorboard']}  (tensorboard --logdir {summary['tensorboard']})\n"
        f"  checkpoints {summary['checkpoints']}\n"
        f"  summary     {run_dir / 'summary.json'}",
        flush=True,
    )
