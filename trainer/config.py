"""The trainer's config: its structured schemas (Hydra), and composing it.

The YAML files under conf/ choose values; the dataclasses here fix the keys and
their types, so a typo such as ``train.batchsize=64``, or a value outside a field's
choices (an enum: ``schedule.decay=linear``), fails in Hydra before anything runs.
What spotring itself takes is spotring's own classes (spotring/options.py): the
``engine`` node is the chosen engine's options class (each engine registered in
spotring/engines/ is a group option), ``preemption`` and ``elastic`` are
spotring.PreemptionOptions and spotring.ElasticOptions, and
``checkpoint`` extends spotring.CheckpointOptions, so their choices and defaults are
written there once. What types cannot say (ranges, combinations, torchvision's model
names) trainer/validation.py checks.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, DictConfig, OmegaConf

from spotring import contract
from spotring.options import (
    CheckpointOptions,
    Device,
    ElasticOptions,
    EngineOptions,
    Precision,
    PreemptionOptions,
    choices,
)
from spotring.support.compose import compose_checked

# The resolver conf/config.yaml's hydra.run.dir goes through: the launch contract's run
# directory ($SPOTRING_RUN_DIR, spotring/contract.py) where a launcher gave one, else its
# argument.
RUN_DIR_RESOLVER = "spotring.run_dir"

# ----------------------------------------------------------------------------- choices


DatasetName = choices("DatasetName", "mnist cifar10 synthetic image_folder shards")
ModelName = choices("ModelName", "convnet lenet cifar_convnet cifar_resnet torchvision")
OptimizerName = choices("OptimizerName", "sgd adamw")
Decay = choices("Decay", "cosine step none")
DType = choices("DType", "float32 float64")

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
class ShardsDatasetConfig(DatasetConfig):
    """WebDataset tar shards in a store, streamed (spotring.Shards, docs/streaming.md):
    images (.png, .jpg) and labels (.cls); the shape and the number of classes come from
    the shards' index."""

    uri: str | None = None  # required: s3://bucket/prefix, gs://, az://, or a directory
    test_uri: str | None = None  # the evaluation shards; default: the training shards
    cache_dir: str | None = None  # default $SPOTRING_CACHE_DIR, else ~/.cache/spotring/shards
    cache_limit_gb: float = 16  # GiB of shard blocks kept on each node's disk
    # Per channel, of images scaled to [0, 1]; default 0.5 and 0.25 for every channel.
    mean: list[float] | None = None
    std: list[float] | None = None


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
class CheckpointConfig(CheckpointOptions):
    """spotring's checkpoint options (dir: default the run directory's checkpoints/; uri:
    default $SPOTRING_CHECKPOINT_URI; keep), and when the trainer writes one."""

    every_steps: int = 0  # 0: only at each epoch end and at the end of the run


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
    engine: EngineOptions = MISSING  # the chosen engine's options class
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    preemption: PreemptionOptions = field(default_factory=PreemptionOptions)
    elastic: ElasticOptions = field(default_factory=ElasticOptions)
    telemetry: TelemetryConfig = field(default_factory=TelemetryConfig)
    resume: str = "auto"  # auto | never | PATH of a checkpoint file


def register() -> None:
    """Put the schemas where conf/*.yaml extend them (``defaults: [/schema/x/y@_here_]``);
    under their own group, so that they are not offered as options of dataset=, model=...
    Every registered engine's options class is schema/engine/NAME (importing the
    registry imports torch). And make conf/config.yaml's run directory resolvable."""
    from spotring.engines import registry

    if not OmegaConf.has_resolver(RUN_DIR_RESOLVER):
        OmegaConf.register_new_resolver(RUN_DIR_RESOLVER,
                                        lambda default: contract.run_dir() or default)
    cs = ConfigStore.instance()
    cs.store(name="schema", node=Config)
    for group, name, node in [
        ("dataset", "dataset", DatasetConfig),
        ("dataset", "synthetic", SyntheticDatasetConfig),
        ("dataset", "image_folder", ImageFolderDatasetConfig),
        ("dataset", "shards", ShardsDatasetConfig),
        ("model", "model", ModelConfig),
        ("model", "convnet", ConvNetConfig),
        ("model", "cifar_convnet", CifarConvNetConfig),
        ("model", "resnet", ResNetConfig),
        ("model", "torchvision", TorchvisionModelConfig),
        ("optim", "sgd", SGDConfig),
        ("optim", "adamw", AdamWConfig),
        ("schedule", "schedule", ScheduleConfig),
        *(("engine", name, engine.options) for name, engine in registry().items()),
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


def global_batch(cfg: DictConfig, world_size: int) -> int:
    """The samples of one optimizer step on ``world_size`` workers: train.global_batch,
    else train.batch_size x workers x train.accumulation."""
    if cfg.train.global_batch is not None:
        return cfg.train.global_batch
    return cfg.train.batch_size * world_size * cfg.train.accumulation
