"""The networks build for their datasets, learn, and have their published sizes."""

from __future__ import annotations

import itertools

import pytest
import torch

from spotring.exits import ConfigError
from spotring.trainer.models import build_model, l1_penalty
from spotring.trainer.validation import validate
from tests.conftest import compose_config, run_trainer


def parameters(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("model, shape, expected", [
    ("convnet", (1, 28, 28), None),
    ("mnist_convnet", (1, 28, 28), None),
    ("lenet", (1, 28, 28), 61706),  # LeNet-5's 61.7 k parameters
    ("lenet", (3, 32, 32), None),
    ("cifar_convnet", (3, 32, 32), 116906),  # MathWorks' network, as built before model.depth
    ("resnet20", (3, 32, 32), 269722),  # He et al.: 0.27 M (option A shortcuts)
    ("torchvision", (1, 28, 28), None),  # resnet18 on grey images
])
def test_each_model_takes_a_training_step(model, shape, expected):
    cfg = compose_config(f"model={model}")
    net = build_model(cfg.model, shape, 10)
    if expected is not None:
        assert parameters(net) == expected
    x, y = torch.randn(4, *shape), torch.tensor([0, 1, 2, 3])
    before = [p.detach().clone() for p in net.parameters()]
    loss = torch.nn.functional.cross_entropy(net(x), y)
    loss.backward()
    torch.optim.SGD(net.parameters(), lr=0.1).step()
    assert net(x).shape == (4, 10)
    assert any(not torch.equal(a, b) for a, b in zip(before, net.parameters(), strict=True))


def test_bras_valadao_network_has_100_values_and_fc_25():
    net = build_model(compose_config("model=mnist_convnet").model, (1, 28, 28), 10)
    features, fc, _, out = net
    assert features(torch.zeros(1, 1, 28, 28)).shape == (1, 100)
    assert (fc.in_features, fc.out_features, out.out_features) == (100, 25, 10)


def cifar_convnet(*overrides: str) -> torch.nn.Module:
    return build_model(compose_config("model=cifar_convnet", *overrides).model, (3, 32, 32), 10)


def test_cifar_convnet_defaults_are_mathworks_network():
    features, fc, _, out = cifar_convnet()
    kinds = [type(m).__name__ for m in features]
    assert kinds == ["Conv2d", "ReLU", "MaxPool2d", "LocalResponseNorm"] * 2 + [
        "Conv2d", "ReLU", "MaxPool2d", "Flatten"]
    convs = [(m.in_channels, m.out_channels, m.kernel_size, m.padding)
             for m in features if isinstance(m, torch.nn.Conv2d)]
    assert convs == [(3, 32, (5, 5), (2, 2)), (32, 32, (5, 5), (2, 2)), (32, 64, (5, 5), (2, 2))]
    assert (fc.in_features, fc.out_features, out.out_features) == (64 * 3 * 3, 64, 10)


@pytest.mark.parametrize("depth, width, kernel",
                         list(itertools.product((1, 2, 3, 4), (16, 32), (3, 5))))
def test_each_cifar_convnet_of_the_sweep_gives_logits(depth, width, kernel):
    net = cifar_convnet(f"model.depth={depth}", f"model.width={width}", f"model.kernel={kernel}")
    channels = [m.out_channels for m in net.modules() if isinstance(m, torch.nn.Conv2d)]
    assert channels == [width, width, 2 * width, 2 * width][:depth]
    assert net(torch.randn(2, 3, 32, 32)).shape == (2, 10)


def test_cifar_convnet_parameters_by_hand():
    # depth 2, width 16, 3x3: two convs of 16 channels, pools 32 -> 15 -> 7, FC 64, 10.
    convs = (3 * 9 * 16 + 16) + (16 * 9 * 16 + 16)
    fcs = (16 * 7 * 7 * 64 + 64) + (64 * 10 + 10)
    assert parameters(cifar_convnet("model.depth=2", "model.width=16",
                                    "model.kernel=3")) == convs + fcs == 53658
    # depth 4, width 32, 5x5: 32, 32, 64, 64 channels, 1x1 at the end.
    convs = sum(k * 25 * c + c for k, c in [(3, 32), (32, 32), (32, 64), (64, 64)])
    fcs = (64 * 64 + 64) + (64 * 10 + 10)
    assert parameters(cifar_convnet("model.depth=4")) == convs + fcs


@pytest.mark.parametrize("overrides, message", [
    (["model.depth=5"], "model.depth=5: valid with dataset=cifar10: 1 to 4"),
    (["model.depth=0"], "model.depth=0: valid with dataset=cifar10: 1 to 4"),
    (["model.kernel=4"], "model.kernel=4: must be odd and positive"),
    (["model.width=0"], "model.width=0: must be positive"),
    (["dataset=mnist", "model.depth=4"], "model.depth=4: valid with dataset=mnist: 1 to 3"),
])
def test_validate_refuses_a_cifar_convnet_that_cannot_be_built(overrides, message):
    with pytest.raises(ConfigError) as e:
        validate(compose_config("dataset=cifar10", "model=cifar_convnet", *overrides))
    assert message in str(e.value)


def test_l1_penalty_sums_weights_not_biases():
    net = torch.nn.Linear(3, 2)
    with torch.no_grad():
        net.weight.fill_(-0.5)
        net.bias.fill_(7.0)
    assert l1_penalty(net).item() == pytest.approx(3.0)


@pytest.mark.slow(cores=1)
def test_resnet20_with_augmentation_trains_on_cifar_sized_images(tmp_path):
    # CIFAR-10's files themselves are read in test_data.py: the published ones are 170 MB
    # from the internet, and torchvision refuses any other copy.
    run = run_trainer(tmp_path / "run", "dataset=synthetic", "dataset.shape=[3,32,32]",
                      "dataset.augment=true", "model=resnet20", "train.batch_size=16",
                      "train.max_steps=3", "model.l1=1e-5", launcher="spawned")
    assert run.summary["model"] == "resnet20" and run.summary["model_builder"] == "cifar_resnet"
    assert run.summary["steps"] == 3
    assert run.summary["global_batch"] == 16
