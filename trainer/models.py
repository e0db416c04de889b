"""The networks: the seed papers' models, CIFAR ResNets, any torchvision model by name,
and your own.

Every builder takes the model config, the input shape (C, H, W) and the number of
classes, and returns logits; the softmax lives in the loss. None of them uses dropout,
so N workers with batch b take exactly the steps one worker takes with N*b. Models
with BatchNorm (the ResNets) normalise over each worker's batch unless
``engine.sync_bn=true``.

Your own network: ``model._target_=mypkg.nets.build`` (mypkg importable: installed, or
on PYTHONPATH on every host). hydra.utils.instantiate calls

    build(**added, input_shape=(C, H, W), num_classes=N)

where ``added`` are the keys you add to the model config (``+model.width=64``; plain
Python values; a nested one with a ``_target_`` of its own is instantiated first), and
input_shape and num_classes are the dataset's (a tuple of three ints, an int). The keys
of the model option's schema (name, l1, and model=fast_convnet's channels...) are the
trainer's and are not passed; ``model.l1`` still adds its penalty. It returns a
torch.nn.Module whose forward takes a float batch N x C x H x W (in train.dtype; NHWC
with train.channels_last) and returns logits N x num_classes. It is called on every rank
before any process group exists, after torch and random are seeded with train.seed, so
every rank builds the same weights; an import that fails, a call that raises, or
anything but a module with parameters ends the run with exit code 2, naming the target.
summary.json's "model" and "model_builder" then name the target.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from omegaconf import DictConfig
from torch import nn

from spotring.exits import ConfigError
from spotring.trainer.config import ModelName
from spotring.trainer.targets import describe, instantiate


def _flat_size(features: nn.Module, shape: tuple[int, int, int]) -> int:
    with torch.no_grad():
        return features(torch.zeros(1, *shape)).numel()


def convnet(cfg: DictConfig, shape: tuple[int, int, int], num_classes: int) -> nn.Module:
    """Two conv + ReLU + 2x2 max-pool stages, a fully connected ReLU layer, the classes.

    model=fast_convnet (the default): 24 5x5 and 32 3x3 kernels, FC 256; 99% on MNIST
    in one epoch. model=convnet: 32 and 64 5x5 kernels, FC 128; three times the
    multiply-adds.
    model=mnist_convnet, Bras & Valadao's network: 5x5 then 3x3 kernels, 28 -> 24 -> 12
    -> 10 -> 5, so channels[1]=4 leaves 4 x 5 x 5 = 100 values; FC 25 + ReLU; softmax 10.
    """
    (c1, c2), (k1, k2) = cfg.channels, cfg.kernels
    features = nn.Sequential(
        nn.Conv2d(shape[0], c1, k1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(c1, c2, k2), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(),
    )
    return nn.Sequential(
        features,
        nn.Linear(_flat_size(features, shape), cfg.hidden), nn.ReLU(),
        nn.Linear(cfg.hidden, num_classes),
    )


def lenet(cfg: DictConfig, shape: tuple[int, int, int], num_classes: int) -> nn.Module:
    """LeNet-5 (LeCun et al. 1998) with ReLU and max pooling; 28x28 input is padded to 32."""
    pad = 2 if shape[1] == 28 else 0
    features = nn.Sequential(
        nn.Conv2d(shape[0], 6, 5, padding=pad), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(6, 16, 5), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(),
    )
    return nn.Sequential(
        features,
        nn.Linear(_flat_size(features, shape), 120), nn.ReLU(),
        nn.Linear(120, 84), nn.ReLU(),
        nn.Linear(84, num_classes),
    )


def cifar_convnet(cfg: DictConfig, shape: tuple[int, int, int], num_classes: int) -> nn.Module:
    """The CIFAR-10 network of MathWorks' parallel-training white paper, and its family:
    ``model.depth`` conv / ReLU / 3x3 stride-2 max-pool stages (the pools take 32 -> 15
    -> 7 -> 3 -> 1), stage i with ``model.width * 2**(i//2)`` channels of square
    ``model.kernel`` kernels (padded by kernel//2, so the convolutions keep the size),
    cross-channel (local response) normalisation after every stage but the last, then
    FC 64, ReLU, the classes. The defaults (depth 3, width 32, kernel 5) are the paper's
    network: conv5x5 32, 32, 64."""
    layers: list[nn.Module] = []
    c_in = shape[0]
    for i in range(cfg.depth):
        if i:
            layers.append(nn.LocalResponseNorm(5))
        c_out = cfg.width * 2 ** (i // 2)
        layers += [nn.Conv2d(c_in, c_out, cfg.kernel, padding=cfg.kernel // 2), nn.ReLU(),
                   nn.MaxPool2d(3, 2)]
        c_in = c_out
    features = nn.Sequential(*layers, nn.Flatten())
    return nn.Sequential(
        features,
        nn.Linear(_flat_size(features, shape), 64), nn.ReLU(),
        nn.Linear(64, num_classes),
    )


class _BasicBlock(nn.Module):
    def __init__(self, c_in: int, c_out: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(c_in, c_out, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(c_out)
        self.conv2 = nn.Conv2d(c_out, c_out, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(c_out)
        self.extra_channels = c_out - c_in
        self.stride = stride

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        # He et al.'s option A shortcut: subsample and zero-pad the new channels,
        # which keeps the CIFAR ResNets at their published parameter counts.
        shortcut = x[:, :, :: self.stride, :: self.stride]
        if self.extra_channels:
            shortcut = F.pad(shortcut, (0, 0, 0, 0, 0, self.extra_channels))
        return F.relu(out + shortcut)


def cifar_resnet(cfg: DictConfig, shape: tuple[int, int, int], num_classes: int) -> nn.Module:
    """He et al. 2016's CIFAR ResNet of depth 6n+2 (resnet20: 0.27 M parameters)."""
    n = (cfg.depth - 2) // 6
    layers: list[nn.Module] = [
        nn.Conv2d(shape[0], 16, 3, 1, 1, bias=False), nn.BatchNorm2d(16), nn.ReLU(),
    ]
    c_in = 16
    for c_out, stride in [(16, 1), (32, 2), (64, 2)]:
        for i in range(n):
            layers.append(_BasicBlock(c_in, c_out, stride if i == 0 else 1))
            c_in = c_out
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(64, num_classes)]
    model = nn.Sequential(*layers)
    for m in model.modules():
        if isinstance(m, nn.Conv2d | nn.Linear):
            nn.init.kaiming_normal_(m.weight)
    return model


def torchvision_model(cfg: DictConfig, shape: tuple[int, int, int], num_classes: int) -> nn.Module:
    """Any torchvision classification model by name, randomly initialised (no download).
    Grey images are repeated to three channels, which these models expect."""
    import torchvision

    model = torchvision.models.get_model(cfg.arch, weights=None, num_classes=num_classes)
    if shape[0] == 1:
        return nn.Sequential(_GreyToRGB(), model)
    return model


class _GreyToRGB(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.expand(-1, 3, -1, -1)


MODELS: dict[ModelName, Callable[[DictConfig, tuple[int, int, int], int], nn.Module]] = {
    ModelName.convnet: convnet,
    ModelName.lenet: lenet,
    ModelName.cifar_convnet: cifar_convnet,
    ModelName.cifar_resnet: cifar_resnet,
    ModelName.torchvision: torchvision_model,
}


def build_model(cfg: DictConfig, shape: tuple[int, int, int], num_classes: int) -> nn.Module:
    """The zoo's network ``cfg.name``, or what ``cfg._target_`` builds (see above); the
    caller seeds first. Raises ConfigError for a target that fails or returns anything
    but a module with parameters."""
    if cfg._target_ is None:
        return MODELS[cfg.name](cfg, shape, num_classes)
    model = instantiate("model", cfg, input_shape=tuple(shape), num_classes=num_classes)
    if not isinstance(model, nn.Module):
        raise ConfigError(f"model._target_={cfg._target_} returned {describe(model)}, not a "
                          "torch.nn.Module")
    if not any(p.requires_grad for p in model.parameters()):
        raise ConfigError(f"model._target_={cfg._target_} returned a {type(model).__name__} "
                          "with no parameters to train")
    return model


def l1_penalty(model: nn.Module) -> torch.Tensor:
    """Sum of |w| over weight matrices and kernels (biases and norms excluded)."""
    return sum(p.abs().sum() for p in model.parameters() if p.dim() > 1)
