"""Validation of the trainer's config: what its schema's types cannot say (trainer/config.py).

``validate`` checks ranges, combinations and torchvision's model names, and applies
spotring's own rules to the options that are spotring's (engine, checkpoint, preemption,
elastic: their classes' ``problems``). It runs on every rank before any process group exists
(and in a launcher's check, before any node starts), so a bad value ends the job with one
clear paragraph listing every problem instead of a hang or a traceback on N machines.
"""

from __future__ import annotations

from functools import cache
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from spotring.exits import ConfigError
from spotring.options import one_of, positive
from spotring.stores import uri_problem
from spotring.trainer.config import DatasetName, ModelName


@cache
def torchvision_archs() -> list[str]:
    """The valid values of model.arch: torchvision's classification models."""
    import torchvision  # imports torch: only when model=torchvision

    return sorted(torchvision.models.list_models(module=torchvision.models))


def validate(cfg: DictConfig) -> None:
    """Raise ConfigError listing every problem in ``cfg``, or return if there is none."""
    problems: list[str] = []

    def need(ok: bool, line: str) -> None:
        if not ok:
            problems.append(line)

    # The zoo's names and keys, checked where no _target_ of the user's replaces them.
    model = None if cfg.model._target_ else cfg.model.name
    dataset = None if cfg.dataset._target_ else cfg.dataset.name
    if model is not None:
        problems += filter(None, [one_of("model.name", model, [str(m) for m in ModelName])])
    if dataset is not None:
        problems += filter(None, [one_of("dataset.name", dataset,
                                         [str(d) for d in DatasetName])])
    if model == "torchvision":
        problems += filter(None, [one_of("model.arch", cfg.model.arch, torchvision_archs())])

    positive_values = {  # those that are None are not set: left out
        "train.epochs": cfg.train.epochs,
        "train.batch_size": cfg.train.batch_size,
        "train.accumulation": cfg.train.accumulation,
        "train.eval_batch_size": cfg.train.eval_batch_size,
        "train.max_steps": cfg.train.max_steps,
        "train.global_batch": cfg.train.global_batch,
        "train.threads": cfg.train.threads,
        "train.eval_samples": cfg.train.eval_samples,
        "optim.lr": cfg.optim.lr,
        "optim.reference_batch": cfg.optim.reference_batch,
        "telemetry.log_every": cfg.telemetry.log_every,
        # synthetic's, or one added for a _target_
        "dataset.num_classes": cfg.dataset.get("num_classes"),
    }
    if model == "cifar_convnet":
        positive_values["model.width"] = cfg.model.width
    if dataset == "synthetic":
        positive_values |= {
            "dataset.train_size": cfg.dataset.train_size,
            "dataset.test_size": cfg.dataset.test_size,
        }
        need(len(cfg.dataset.shape) == 3 and all(s > 0 for s in cfg.dataset.shape),
             f"dataset.shape={list(cfg.dataset.shape)}: must be three positive sizes [C, H, W]")
    if dataset == "image_folder":
        positive_values["dataset.size"] = cfg.dataset.size
        problems += image_folder_problems(cfg.dataset)
    if dataset == "shards":
        positive_values["dataset.cache_limit_gb"] = cfg.dataset.cache_limit_gb
        need(cfg.dataset.uri is not None,
             "dataset.uri: required with dataset=shards: the shards' store and prefix "
             "(s3://bucket/prefix, gs://..., az://..., or a directory)")
        for key in ("uri", "test_uri"):
            where = cfg.dataset[key]
            if where is not None and (problem := uri_problem(where, f"dataset.{key}",
                                                              paths=True)):
                problems.append(problem)
    problems += positive(**positive_values)

    for key, value in {
        "optim.weight_decay": cfg.optim.weight_decay,
        "model.l1": cfg.model.l1,
        "schedule.warmup_epochs": cfg.schedule.warmup_epochs,
        "checkpoint.every_steps": cfg.checkpoint.every_steps,
        "train.eval_every_steps": cfg.train.eval_every_steps,
        "data.workers": cfg.data.workers,
    }.items():
        need(value >= 0, f"{key}={value}: must be zero or positive")
    need(0 <= cfg.train.label_smoothing < 1,
         f"train.label_smoothing={cfg.train.label_smoothing}: must be in [0, 1)")
    need(not (cfg.model.l1 and cfg.engine.name == "fsdp"),
         f"model.l1={cfg.model.l1} with engine=fsdp: the penalty reads the whole weights "
         "outside the forward pass, where FSDP holds only this worker's shard of them; "
         "valid with fsdp: model.l1=0")
    if cfg.schedule.decay == "step":
        need(len(cfg.schedule.milestones) > 0,
             "schedule.milestones=[]: decay=step needs at least one epoch, e.g. [30,60,80]")
    if model == "convnet":
        need(len(cfg.model.channels) == 2 and len(cfg.model.kernels) == 2,
             f"model.channels={list(cfg.model.channels)}, model.kernels="
             f"{list(cfg.model.kernels)}: the convnet has exactly two conv stages")
    if model == "cifar_convnet":
        problems += cifar_convnet_problems(cfg)
    if model == "cifar_resnet":
        need(cfg.model.depth >= 8 and (cfg.model.depth - 2) % 6 == 0,
             f"model.depth={cfg.model.depth}: a CIFAR ResNet has depth 6n+2 (20, 32, 44, 56, 110)")
    # spotring's own options: their rules are spotring's.
    problems += OmegaConf.to_object(cfg.engine).problems(
        "engine.", compile=bool(cfg.train.compile), precision=str(cfg.train.precision))
    problems += OmegaConf.to_object(cfg.checkpoint).problems("checkpoint.")
    problems += OmegaConf.to_object(cfg.preemption).problems("preemption.")
    problems += elastic_problems(cfg)
    need(cfg.resume in ("auto", "never") or str(cfg.resume).endswith((".json", ".pt"))
         or Path(str(cfg.resume)).is_dir(),
         f"resume={cfg.resume}: must be auto, never, or the path of a checkpoint: its "
         "manifest (.json), its folder, or an older spotring's single .pt file")
    problems += gpu_path_problems(cfg)

    if problems:
        raise ConfigError(
            "bad configuration:\n  - " + "\n  - ".join(problems)
            + "\nSee the groups under conf/ or print the composed config with "
            "`spotring train --cfg job`."
        )


def elastic_problems(cfg: DictConfig) -> list[str]:
    """spotring's rules for the elastic options, and the trainer's: in place (set here or
    by the launcher's $SPOTRING_IN_PLACE) needs train.global_batch, which a process that
    joins (a world of one until it is taken in) then makes the same as the others'."""
    elastic = OmegaConf.to_object(cfg.elastic)
    problems = elastic.problems("elastic.")
    in_place = str(elastic.resolved().in_place)
    if in_place != "off" and cfg.train.global_batch is None:
        problems.append(
            f"elastic.in_place={in_place} with train.global_batch unset: the global batch "
            "would be train.batch_size x workers x train.accumulation, which a worker that "
            "joins (alone until it is taken in) would make another than the others'; set "
            "train.global_batch (`spotring launch` and `spotring sbatch` write it out)")
    return problems


def image_folder_problems(dataset: DictConfig) -> list[str]:
    """dataset=image_folder needs its folder, and RGB statistics to normalise by."""
    problems = []
    if dataset.root is None:
        problems.append("dataset.root: required with dataset=image_folder: a folder holding "
                        "train/<class>/*.jpg|png and val/<class>/... (or test/)")
    for key in ("mean", "std"):
        if len(dataset[key]) != 3:
            problems.append(f"dataset.{key}={list(dataset[key])}: must be three values, one "
                            "per RGB channel (ImageFolder reads every image as RGB)")
    if any(s <= 0 for s in dataset.std):
        problems.append(f"dataset.std={list(dataset.std)}: must be positive")
    return problems


# The image side of each named dataset (synthetic ones give dataset.shape).
IMAGE_SIDE = {"mnist": 28, "cifar10": 32}
MAX_STAGES = 4  # of cifar_convnet: MathWorks' family


def image_side(cfg: DictConfig) -> int | None:
    """The smaller side of the dataset's images; None for a dataset._target_'s, which is
    known only once it is built."""
    if cfg.dataset._target_:
        return None
    if cfg.dataset.name == "synthetic":
        return min(cfg.dataset.shape[1:], default=0)
    if cfg.dataset.name == "image_folder":
        return cfg.dataset.size
    return IMAGE_SIDE[cfg.dataset.name]


def cifar_convnet_problems(cfg: DictConfig) -> list[str]:
    """model.depth is 1 to 4 stages, as many as leave a pixel after their 3x3 stride-2
    pools (32 -> 15 -> 7 -> 3 -> 1: four on CIFAR-10, three on MNIST's 28 -> 13 -> 6 -> 2),
    and model.kernel is odd, so that padding kernel//2 keeps the size."""
    model, problems = cfg.model, []
    side = image_side(cfg)
    most = 0 if side is not None else MAX_STAGES
    while side is not None and side >= 3 and most < MAX_STAGES:
        side, most = (side - 3) // 2 + 1, most + 1
    if not 1 <= model.depth <= most:
        valid = f"1 to {most}" if most else "none (images smaller than the 3x3 pool)"
        dataset = cfg.dataset._target_ or cfg.dataset.name
        problems.append(f"model.depth={model.depth}: valid with dataset={dataset}: "
                        f"{valid}; each stage's 3x3 stride-2 pool halves the image")
    if model.kernel < 1 or model.kernel % 2 == 0:
        problems.append(f"model.kernel={model.kernel}: must be odd and positive "
                        "(1, 3, 5, 7, 9...), so that padding kernel//2 keeps the size")
    return problems


def gpu_path_problems(cfg: DictConfig) -> list[str]:
    """What train.precision and train.compile cannot do with train.dtype, the engine and
    the device the run will get (the CPU for train.device=cpu, or auto where torch sees
    no GPU, as runtime.pick_device decides). channels_last needs 4-D input, and every
    dataset here gives C x H x W images, so it is never refused."""
    train, problems = cfg.train, []
    if train.precision in ("bf16", "fp16") and train.dtype == "float64":
        problems.append(
            f"train.precision={train.precision} with train.dtype=float64: autocast would "
            "compute in less than the float64 the run asks for; valid with float64: fp32 "
            "(or train.dtype=float32)")
    if train.precision != "fp16" and not train.compile:
        return problems
    import torch  # only for these two options: the rest of validate needs no torch

    from spotring.torch_compat import compile_problem

    on_cpu = train.device == "cpu" or (train.device == "auto" and not torch.cuda.is_available())
    if train.precision == "fp16" and on_cpu:
        problems.append(
            f"train.precision=fp16 on the CPU (train.device={train.device}"
            f"{'' if train.device == 'cpu' else ', and torch sees no GPU'}): float16 with a "
            "gradient scaler is a GPU path; valid on the CPU: fp32, bf16")
    if train.compile:
        why = compile_problem(torch.device("cpu" if on_cpu else "cuda"))
        if why:
            problems.append(f"train.compile=true: {why}; valid here: train.compile=false")
    return problems
