"""Structured configs (Hydra schemas) and their validation.

The YAML files under conf/ choose values; the dataclasses here fix the keys and
their types, so a typo such as ``train.batchsize=64``, or a value outside a field's
choices (an enum: ``schedule.decay=linear``), fails in Hydra before anything runs.
``validate`` then checks what types cannot: ranges, combinations, torchvision's model
names. It runs on every rank before any process group exists, so a bad value ends the
job with one clear paragraph instead of a hang or a traceback on N machines.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from functools import cache
from typing import Any

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, DictConfig, OmegaConf

from spotring.exits import ConfigError
from spotring.global_batch import split_global_batch
from spotring.options import choices, one_of
from spotring.trainer.compose import compose_checked

# conf/ is a package of its own, so that it ships in the wheel (pkg://spotring.conf for Hydra).
CONF_MODULE = "spotring.conf"

# ----------------------------------------------------------------------------- choices


DatasetName = choices("DatasetName", "mnist cifar10 synthetic image_folder")
ModelName = choices("ModelName", "convnet lenet cifar_convnet cifar_resnet torchvision")
OptimizerName = choices("OptimizerName", "sgd adamw")
Decay = choices("Decay", "cosine step none")
EngineName = choices("EngineName", "ddp horovod")
Backend = choices("Backend", "auto nccl gloo mpi")
Compression = choices("Compression", "none fp16")
ReduceOp = choices("ReduceOp", "average adasum")
Device = choices("Device", "auto cpu cuda")
DType = choices("DType", "float32 float64")
Precision = choices("Precision", "auto fp32 bf16 fp16")

# ----------------------------------------------------------------------------- schemas


@dataclass
class DatasetConfig:
    # A DatasetName; where _target_ is given, the run sets it to the target, which
    # summary.json and the checkpoints then name. (A str, not the enum, for that reason:
    # validate refuses any other name.)
    name: str = MISSING
    # mypkg.data.build: your own (train, test) Datasets; what it is called with and must
    # return: trainer/datasets.py. Keys added with +dataset.KEY=... are its arguments.
    _target_: str | None = None
    # Random crop (4 px padding) and horizontal flip, on tensors; meant for CIFAR.
    # image_folder: RandomResizedCrop and flip. Not used with _target_ (the builder's).
    augment: bool = False


@dataclass
class SyntheticDatasetConfig(DatasetConfig):
    """Random images of any shape, for throughput benchmarks and tests."""

    shape: list[int] = field(default_factory=lambda: [3, 32, 32])  # C, H, W
    num_classes: int = 10
    train_size: int = 10240
    test_size: int = 1024


@dataclass
class ImageFolderDatasetConfig(DatasetConfig):
    """torchvision's ImageFolder layout: root/train/<class>/*.jpg|png and root/val/<class>/...
    (or test/), resized to ``size`` and normalised by ``mean`` and ``std`` (per RGB channel)."""

    root: str | None = None  # required
    size: int = 224  # the side of the square crops the model sees
    mean: list[float] = field(default_factory=lambda: [0.485, 0.456, 0.406])  # ImageNet's
    std: list[float] = field(default_factory=lambda: [0.229, 0.224, 0.225])


@dataclass
class ModelConfig:
    # A ModelName; where _target_ is given, the run sets it to the target (see
    # DatasetConfig.name).
    name: str = MISSING
    # mypkg.nets.build: your own torch.nn.Module; what it is called with: trainer/models.py.
    # Keys added with +model.KEY=... are its arguments.
    _target_: str | None = None
    # L1 penalty on weights (not biases) added to the loss, as in Bras & Valadao.
    l1: float = 0.0


@dataclass
class ConvNetConfig(ModelConfig):
    """Two conv + ReLU + 2x2 max-pool stages, a fully connected ReLU layer, the classes."""

    channels: list[int] = field(default_factory=lambda: [32, 64])
    kernels: list[int] = field(default_factory=lambda: [5, 5])
    hidden: int = 128


@dataclass
class CifarConvNetConfig(ModelConfig):
    """MathWorks' CIFAR-10 network and its family: conv / ReLU / 3x3 stride-2 max-pool
    stages, local response normalisation between them, FC 64, the classes."""

    depth: int = 3  # conv stages: 1 to 4 on 32x32 images (32 -> 15 -> 7 -> 3 -> 1)
    width: int = 32  # channels of the first stage; stage i has width * 2**(i//2)
    kernel: int = 5  # odd square kernel size, padded by kernel//2


@dataclass
class ResNetConfig(ModelConfig):
    depth: int = 20  # 6n + 2: 20, 32, 44, 56, 110


@dataclass
class TorchvisionModelConfig(ModelConfig):
    arch: str = "resnet18"  # any name in torchvision.models.list_models()


@dataclass
class OptimConfig:
    name: OptimizerName = MISSING
    # The base learning rate at `reference_batch`; the run uses
    # lr x global_batch / reference_batch (Goyal et al. 2017, linear scaling rule).
    lr: float = 0.1
    reference_batch: int = 256
    weight_decay: float = 0.0


@dataclass
class SGDConfig(OptimConfig):
    momentum: float = 0.9
    nesterov: bool = False


@dataclass
class AdamWConfig(OptimConfig):
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    eps: float = 1e-8


@dataclass
class ScheduleConfig:
    # From optim.lr up to the scaled LR, linearly per iteration (Goyal et al. 2017).
    warmup_epochs: float = 0.0
    decay: Decay = Decay.cosine
    milestones: list[float] = field(default_factory=list)  # epochs, for decay=step
    gamma: float = 0.1  # factor at each milestone
    final_lr_fraction: float = 0.0  # cosine ends at this fraction of the scaled LR


@dataclass
class EngineConfig:
    name: EngineName = MISSING
    # auto: nccl on GPU, gloo on CPU; mpi: the gradients' allreduce over MPI on CPUs
    # (under mpirun: through mpi4py for ddp, Horovod's own for horovod)
    backend: Backend = Backend.auto
    # Seconds a collective may wait for a peer before the job fails, naming the
    # missing rank. Generous by default: a first NCCL allreduce can take a while.
    timeout_s: float = 300.0
    sync_bn: bool = False  # SyncBatchNorm, so batch statistics span all workers


@dataclass
class DDPConfig(EngineConfig):
    bucket_mb: float = 25.0


@dataclass
class HorovodConfig(EngineConfig):
    compression: Compression = Compression.none  # fp16: gradients travel as float16
    op: ReduceOp = ReduceOp.average
    timeline: str | None = None  # PATH: rank 0 writes a Horovod timeline (Chrome trace)


@dataclass
class DataConfig:
    # Relative to the working directory: a checkout's data/ (with MNIST) when run from one.
    root: str = "data"
    download: bool = True  # fetch a missing dataset with torchvision when online
    # Loader processes per worker for datasets read item by item (dataset._target_,
    # dataset=image_folder); 0 reads them in the training process.
    workers: int = 2


@dataclass
class TrainConfig:
    # Fractions stop mid-epoch: 0.5 trains on half of a (shuffled) epoch.
    epochs: float = 2
    max_steps: int | None = None  # stop after this many optimizer steps (tests, benchmarks)
    # Samples per optimizer step over all workers: the setting that makes a run the same
    # run on any number of workers. Set, the workers' micro-batch and accumulation follow
    # from the world size at start (spotring.split_global_batch: the fewest micro-steps
    # whose micro-batch is at most train.batch_size), and train.accumulation is ignored.
    # Unset: train.batch_size x workers x train.accumulation.
    global_batch: int | None = None
    batch_size: int = 64  # per worker and micro-step (with global_batch: the most)
    accumulation: int = 1  # micro-steps per optimizer step
    seed: int = 0
    label_smoothing: float = 0.0
    eval_batch_size: int = 1000
    eval_every_steps: int = 0  # 0: evaluate at each epoch end (and at the end of the run)
    # Evaluate on the first N test samples only (quick runs, tests); default: all of them.
    eval_samples: int | None = None
    device: Device = Device.auto
    # float64 makes float rounding too small to flip a ReLU or max-pool decision, so
    # runs that must match (N workers vs 1, engine vs engine) match to 1e-10.
    dtype: DType = DType.float32
    threads: int | None = None  # torch threads per worker; default: cores / local workers
    # The GPU paths (docs/gpu.md). bf16, fp16: the forward pass and the loss under
    # torch.autocast (parameters, gradients and their allreduce stay float32); fp16 with
    # a gradient scaler, on GPUs only; auto: bf16 where the device computes in bfloat16
    # natively, else fp32 (runtime.pick_precision).
    precision: Precision = Precision.auto
    channels_last: bool = False  # the model and its image batches in NHWC memory order
    compile: bool = False  # torch.compile; compile_seconds in summary.json


@dataclass
class CheckpointConfig:
    dir: str = "${hydra:runtime.output_dir}/checkpoints"
    uri: str | None = None  # s3://bucket/prefix: every checkpoint uploaded there too
    every_steps: int = 0  # 0: only at each epoch end and at the end of the run
    keep: int = 3


@dataclass
class PreemptionConfig:
    imds: bool = True  # poll the instance metadata service for spot notices (on EC2)
    poll_seconds: float = 5.0
    check_every_steps: int = 1  # steps between the ranks' votes (one tiny allreduce)


@dataclass
class TelemetryConfig:
    log_every: int = 10  # steps between loss/accuracy records (the LR is logged every step)
    progress: bool = True


@dataclass
class Config:
    dataset: DatasetConfig = MISSING
    model: ModelConfig = MISSING
    optim: OptimConfig = MISSING
    schedule: ScheduleConfig = MISSING
    engine: EngineConfig = MISSING
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    preemption: PreemptionConfig = field(default_factory=PreemptionConfig)
    telemetry: TelemetryConfig = field(default_factory=TelemetryConfig)
    resume: str = "auto"  # auto | never | PATH of a checkpoint file


def register() -> None:
    """Put the schemas where conf/*.yaml extend them (``defaults: [/schema/x/y@_here_]``);
    under their own group, so that they are not offered as options of dataset=, model=..."""
    cs = ConfigStore.instance()
    cs.store(name="schema", node=Config)
    for group, name, node in [
        ("dataset", "dataset", DatasetConfig),
        ("dataset", "synthetic", SyntheticDatasetConfig),
        ("dataset", "image_folder", ImageFolderDatasetConfig),
        ("model", "model", ModelConfig),
        ("model", "convnet", ConvNetConfig),
        ("model", "cifar_convnet", CifarConvNetConfig),
        ("model", "resnet", ResNetConfig),
        ("model", "torchvision", TorchvisionModelConfig),
        ("optim", "sgd", SGDConfig),
        ("optim", "adamw", AdamWConfig),
        ("schedule", "schedule", ScheduleConfig),
        ("engine", "ddp", DDPConfig),
        ("engine", "horovod", HorovodConfig),
    ]:
        cs.store(group=f"schema/{group}", name=name, node=node)


def compose(overrides: list[str]) -> DictConfig:
    """The config `python -m spotring.trainer OVERRIDES` runs with, for tools that need its values
    (tests, the launcher). Overrides of Hydra itself (hydra.*) are left out, and
    ${hydra:...} values stay unresolved: there is no run directory."""
    register()
    return compose_checked("config", [o for o in overrides
                                      if not o.lstrip("+~").startswith("hydra")],
                           "See the groups under conf/ or print the composed config with "
                           "`spotring train --cfg job`.")


# -------------------------------------------------------------------------- validation

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

    if cfg.engine.name == "horovod":
        need(not cfg.engine.sync_bn,
             "engine.sync_bn=true: SyncBatchNorm is offered with engine=ddp only")
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

    positive = {
        "train.epochs": cfg.train.epochs,
        "train.batch_size": cfg.train.batch_size,
        "train.accumulation": cfg.train.accumulation,
        "train.eval_batch_size": cfg.train.eval_batch_size,
        "optim.lr": cfg.optim.lr,
        "optim.reference_batch": cfg.optim.reference_batch,
        "engine.timeout_s": cfg.engine.timeout_s,
        "checkpoint.keep": cfg.checkpoint.keep,
        "telemetry.log_every": cfg.telemetry.log_every,
        "preemption.poll_seconds": cfg.preemption.poll_seconds,
        "preemption.check_every_steps": cfg.preemption.check_every_steps,
    }
    if cfg.train.max_steps is not None:
        positive["train.max_steps"] = cfg.train.max_steps
    if cfg.train.global_batch is not None:
        positive["train.global_batch"] = cfg.train.global_batch
    if cfg.train.threads is not None:
        positive["train.threads"] = cfg.train.threads
    if cfg.train.eval_samples is not None:
        positive["train.eval_samples"] = cfg.train.eval_samples
    if model == "cifar_convnet":
        positive["model.width"] = cfg.model.width
    if cfg.dataset.get("num_classes") is not None:  # synthetic's, or one added for a _target_
        positive["dataset.num_classes"] = cfg.dataset.num_classes
    if dataset == "synthetic":
        positive |= {
            "dataset.train_size": cfg.dataset.train_size,
            "dataset.test_size": cfg.dataset.test_size,
        }
        need(len(cfg.dataset.shape) == 3 and all(s > 0 for s in cfg.dataset.shape),
             f"dataset.shape={list(cfg.dataset.shape)}: must be three positive sizes [C, H, W]")
    if dataset == "image_folder":
        positive["dataset.size"] = cfg.dataset.size
        problems += image_folder_problems(cfg.dataset)
    for key, value in positive.items():
        need(value > 0, f"{key}={value}: must be positive")

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
    if cfg.checkpoint.uri is not None:
        need(str(cfg.checkpoint.uri).startswith("s3://") and len(cfg.checkpoint.uri) > 5,
             f"checkpoint.uri={cfg.checkpoint.uri}: expected s3://bucket/prefix")
    need(cfg.resume in ("auto", "never") or str(cfg.resume).endswith(".pt"),
         f"resume={cfg.resume}: must be auto, never, or the path of a checkpoint (.pt) file")
    problems += gpu_path_problems(cfg)

    if problems:
        raise ConfigError(
            "bad configuration:\n  - " + "\n  - ".join(problems)
            + "\nSee the groups under conf/ or print the composed config with "
            "`spotring train --cfg job`."
        )


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

    on_cpu = train.device == "cpu" or (train.device == "auto" and not torch.cuda.is_available())
    if train.precision == "fp16" and on_cpu:
        problems.append(
            f"train.precision=fp16 on the CPU (train.device={train.device}"
            f"{'' if train.device == 'cpu' else ', and torch sees no GPU'}): float16 with a "
            "gradient scaler is a GPU path; valid on the CPU: fp32, bf16")
    if train.compile:
        why = compile_unavailable(on_cpu)
        if why:
            problems.append(f"train.compile=true: {why}; valid here: train.compile=false")
        if cfg.engine.name == "ddp" and cfg.engine.bucket_mb < 1:
            problems.append(
                f"engine.bucket_mb={cfg.engine.bucket_mb} with train.compile=true: DDP's "
                "first bucket holds 1 MB, and torch.compile's DDPOptimizer refuses later "
                "buckets smaller than that; valid with compile: 1 or more")
    return problems


def compile_unavailable(on_cpu: bool) -> str | None:
    """Why torch.compile (its default backend, inductor) cannot run here, or None."""
    import torch._dynamo

    try:
        torch._dynamo.eval_frame.check_if_dynamo_supported()
    except Exception as e:
        return f"torch.compile does not run on this platform ({e})"
    if on_cpu:
        from torch._inductor import config as inductor_config
        from torch._inductor import cpp_builder

        try:  # the search inductor itself makes: $CXX, else g++
            cpp_builder.get_cpp_compiler()
        except RuntimeError:
            names = ", ".join(c for c in inductor_config.cpp.cxx if c)
            return (f"inductor compiles C++ for the CPU and finds no C++ compiler here "
                    f"(looked for {names}; set CXX or install g++)")
    else:
        from torch.utils._triton import has_triton

        if not has_triton():
            return "inductor needs Triton for GPU kernels, and it is not installed"
    return None


# ------------------------------------------------------------ your own builders (_target_)

def added_keys(node: DictConfig) -> dict[str, Any]:
    """The keys of a group's config that its schema does not declare: those added with
    +model.KEY=VALUE, the arguments of its _target_ (plain Python values). The schema's
    own (name, l1, augment, the zoo option's channels...) are the trainer's."""
    declared = {f.name for f in dataclasses.fields(OmegaConf.get_type(node))}
    values = OmegaConf.to_container(node, resolve=True)
    return {key: value for key, value in values.items() if key not in declared}


def instantiate(group: str, node: DictConfig, **arguments: Any) -> Any:
    """What ``node._target_`` returns, called with ``added_keys(node)`` (through
    hydra.utils.instantiate: a nested node with a _target_ of its own is instantiated
    first) and ``arguments`` as they are (Hydra would make a tuple a list). A target that
    cannot be imported or is not callable, or a call that raises, is a ConfigError naming
    the target (as ``group``._target_) and why: nothing of the run has started then."""
    from hydra.utils import instantiate as hydra_instantiate

    target, keys = node._target_, added_keys(node)
    if clash := sorted(keys.keys() & arguments.keys()):
        raise ConfigError(f"{group}.{clash[0]}: the trainer gives {group}._target_={target} "
                          f"{', '.join(clash)} itself; remove the key")
    try:
        build = hydra_instantiate({"_target_": target, **keys}, _partial_=True,
                                  _convert_="all")
    except Exception as e:
        if str(e).startswith("Error locating target"):  # Hydra's words for a failed import
            why = "import failed: " + " ".join(str(e.__cause__).split())
        else:  # not callable, or a nested _target_ failed: Hydra's message says which
            why = " ".join(str(e).split())
        raise ConfigError(f"{group}._target_={target}: {why}") from e
    try:
        return build(**arguments)
    except Exception as e:
        call = ", ".join(f"{k}={v!r}" for k, v in {**keys, **arguments}.items())
        raise ConfigError(f"{group}._target_={target}: {target}({call}) raised "
                          f"{type(e).__name__}: {e}") from e


def describe(value: Any) -> str:
    """A short account of a value a builder returned, for an error message: its type and
    a glimpse of it (a tensor's or array's dtype and shape, a tuple's first items)."""
    if hasattr(value, "dtype") and hasattr(value, "shape"):
        return f"a {type(value).__name__} of {value.dtype} {list(value.shape)}"
    if isinstance(value, tuple | list):
        items = ", ".join(describe(v) for v in value[:3]) + (", ..." if len(value) > 3 else "")
        return f"a {type(value).__name__} of {len(value)} ({items})"
    text = " ".join(repr(value).split())
    return f"a {type(value).__name__} ({text if len(text) <= 60 else text[:57] + '...'})"


def global_batch(cfg: DictConfig, world_size: int) -> int:
    """The samples of one optimizer step on ``world_size`` workers: train.global_batch,
    else train.batch_size x workers x train.accumulation."""
    if cfg.train.global_batch is not None:
        return cfg.train.global_batch
    return cfg.train.batch_size * world_size * cfg.train.accumulation


def check_world_sizes(cfg: DictConfig, world_sizes: list[int]) -> None:
    """Refuse world sizes that cannot share the run's global batch (that of the largest,
    where train.global_batch is not given), naming those that can."""
    batch = global_batch(cfg, max(world_sizes))
    for world_size in world_sizes:
        split_global_batch(batch, world_size, cfg.train.batch_size)
