"""One training job, start to end, as every rank runs it.

    1. check the config, load the data, build the model   (no network yet: bad input,
    2. rank 0: the newest checkpoint, which must match     a user's _target_ too, fails
    3. spotring.init: the device, the engine checked,      here, on every rank, with
       the process group joined (the API a user's          one clear paragraph)
       script uses, with the config's option objects)
    4. restore (each rank its part); train; evaluate
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
from pathlib import Path
from typing import Any

from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf
from torch import nn

import spotring
from spotring import exits, runtime
from spotring.checkpoint import find_resume
from spotring.exits import EXIT_CONFIG, EXIT_OK, ConfigError
from spotring.global_batch import split_global_batch
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
    except ConfigError as e:
        report_bad_input(e, launch)
        return EXIT_CONFIG
    # init exits 2 itself on bad input. From here the job's signal handlers turn SIGTERM
    # and SIGUSR1 into a stop at a step boundary, and leaving the with block makes the
    # exit code (75, 65, 69).
    with spotring.init(engine=OmegaConf.to_object(cfg.engine), device=str(cfg.train.device),
                       run_dir=_run_dir(), checkpoint=OmegaConf.to_object(cfg.checkpoint),
                       preemption=OmegaConf.to_object(cfg.preemption),
                       threads=cfg.train.threads, seed=cfg.train.seed) as job:
        results = Trainer(cfg, job, dataset, model).fit(cfg.resume)
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
    here, with exit code 2), and the newest checkpoint to resume from, which must match
    them (the job's restore then checks its parts, all ranks together)."""
    validate(cfg)
    runtime.set_threads(cfg.train.threads, launch.local_world_size)
    runtime.keep_freed_memory()
    dataset = datasets.load(cfg.dataset, cfg.data, cfg.train.seed)
    runtime.seed_all(cfg.train.seed)  # the same initial weights on every rank
    model = build_model(cfg.model, dataset.shape, dataset.num_classes)
    # What ran, for the log, summary.json and the checkpoints: a _target_ by its name.
    cfg.dataset.name = dataset.name
    cfg.model.name = cfg.model._target_ or cfg.model.name
    if cfg.train.global_batch is not None:
        # The setting that keeps a run the same on any number of workers: this world
        # size's share of it, in micro-batches of at most train.batch_size.
        cfg.train.batch_size, cfg.train.accumulation = split_global_batch(
            cfg.train.global_batch, launch.world_size, cfg.train.batch_size)
    batch = global_batch(cfg, launch.world_size)
    if batch > len(dataset.train):
        raise ConfigError(
            f"global batch {batch} (train.batch_size={cfg.train.batch_size} x "
            f"{launch.world_size} workers x train.accumulation={cfg.train.accumulation}) "
            f"is larger than the {len(dataset.train)} training samples of {dataset.name}")
    if launch.rank == 0:  # rank 0 says which checkpoints a restore will try
        checkpoints = OmegaConf.to_object(cfg.checkpoint).open(_run_dir())
        if checkpoints.remote is not None:
            checkpoints.remote.check_access()
        if found := find_resume(cfg.resume, checkpoints):
            found[0].check_matches(annotations(cfg))
    return dataset, model


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
