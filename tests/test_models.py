"""The networks build for their datasets, learn, and have their published sizes."""

from __future__ import annotations

import pytest
import torch

from tests.conftest import compose_config, run_trainer
from trainer.models import build_model, l1_penalty


def parameters(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("model, shape, expected", [
    ("convnet", (1, 28, 28), None),
    ("mnist_convnet", (1, 28, 28), None),
    ("lenet", (1, 28, 28), 61706),  # LeNet-5's 61.7 k parameters
    ("lenet", (3, 32, 32), None),
    ("cifar_convnet", (3, 32, 32), None),
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


def test_l1_penalty_sums_weights_not_biases():
    net = torch.nn.Linear(3, 2)
    with torch.no_grad():
        net.weight.fill_(-0.5)
        net.bias.fill_(7.0)
    assert l1_penalty(net).item() == pytest.approx(3.0)


@pytest.mark.slow
def test_resnet20_with_augmentation_trains_on_cifar_sized_images(tmp_path):
    # CIFAR-10's files themselves are read in test_data.py: the published ones are 170 MB
    # from the internet, and torchvision refuses any other copy.
    run = run_trainer(tmp_path / "run", "dataset=synthetic", "dataset.shape=[3,32,32]",
                      "dataset.augment=true", "model=resnet20", "train.batch_size=16",
                      "train.max_steps=3", "model.l1=1e-5")
    assert run.summary["model"] == "cifar_resnet" and run.summary["steps"] == 3
    assert run.summary["global_batch"] == 16
