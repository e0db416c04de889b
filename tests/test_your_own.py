"""Your own network and data in the built-in trainer: model._target_, dataset._target_
and dataset=image_folder, read through a spotring.DataLoader in the same order as the
in-memory batches."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from harness.commands import call
from spotring import runtime
from spotring.exits import ConfigError
from spotring.trainer.__main__ import main as train
from spotring.trainer.data import Batches, LoaderBatches
from spotring.trainer.datasets import Dataset, MapDataset, Split
from spotring.trainer.models import build_model
from spotring.trainer.validation import validate
from tests.conftest import QUICK, assert_close, compose_config, run_trainer

# Written into tmp_path and put on PYTHONPATH: what a user's package would hold.
BUILDERS = '''
import json
from pathlib import Path

import torch
from torch import nn


def net(input_shape, num_classes, width):
    assert isinstance(input_shape, tuple) and isinstance(num_classes, int)  # the contract
    c, h, w = input_shape
    return nn.Sequential(nn.Flatten(), nn.Linear(c * h * w, width), nn.ReLU(),
                         nn.Linear(width, num_classes))


class Noise(torch.utils.data.Dataset):
    classes = ["a", "b", "c"]

    def __init__(self, n, seed):
        g = torch.Generator().manual_seed(seed)
        self.x = torch.randn(n, 2, 5, 5, generator=g)
        self.y = torch.randint(0, 3, (n,), generator=g).tolist()

    def __len__(self):
        return len(self.y)

    def __getitem__(self, i):
        return self.x[i], self.y[i]


def data(root, seed, train_size):
    Path(root).mkdir(parents=True, exist_ok=True)
    (Path(root) / "called.json").write_text(json.dumps(
        {"root": root, "seed": seed, "train_size": train_size}))
    return Noise(train_size, seed), Noise(40, seed + 1)


def text(**kwargs):
    return "a model, honestly"


class Bytes(Noise):
    def __getitem__(self, i):
        return (self.x[i] * 100).to(torch.uint8), "cat"


def bytes_data(root, seed):
    return Bytes(64, seed), Bytes(8, seed)
'''
MODEL, DATA = "model._target_=own.net", "dataset._target_=own.data"
SMALL = ["train.batch_size=16", "train.max_steps=3"]


@pytest.fixture
def builders(tmp_path, monkeypatch) -> Path:
    """tmp_path, holding own.py (BUILDERS): the module ``own`` for the trainer's processes
    and for this one."""
    (tmp_path / "own.py").write_text(BUILDERS)
    monkeypatch.syspath_prepend(tmp_path)
    monkeypatch.delitem(sys.modules, "own", raising=False)  # another test's tmp_path's
    return tmp_path


@pytest.fixture
def own(builders):
    """Runs of the trainer that can import the module ``own``."""
    def _run(name: str, *overrides: str, **kwargs):
        return run_trainer(builders / name, *SMALL, f"data.root={builders / 'data'}",
                           *overrides, env={"PYTHONPATH": str(builders)}, **kwargs)
    return _run


@pytest.mark.slow(cores=1)
def test_your_own_model_and_data_train_and_the_summary_names_them(own, tmp_path):
    run = own("run", MODEL, "+model.width=7", DATA, "+dataset.train_size=96", "train.seed=5")
    summary = run.summary
    assert (summary["model"], summary["model_builder"], summary["dataset"]) == \
        ("own.net", "own.net", "own.data")
    assert summary["steps"] == 3 and summary["epochs"] == 0.5  # 96 samples / 16 per step
    # Linear(2*5*5 -> width 7) and Linear(7 -> 3 classes, from train.classes).
    assert summary["parameters"] == 50 * 7 + 7 + 7 * 3 + 3
    assert json.loads((tmp_path / "data" / "called.json").read_text()) == {
        "root": str(tmp_path / "data"), "seed": 5, "train_size": 96}
    assert "spotring: own.net on own.data: test accuracy" in run.output
    assert len(run.checkpoints()) == 1


@pytest.mark.parametrize("overrides, says", [
    (["model._target_=nowhere.net", DATA, "+dataset.train_size=64"],
     "model._target_=nowhere.net: import failed: Error loading"),
    (["model._target_=own.nothing", DATA, "+dataset.train_size=64"],
     "model._target_=own.nothing: import failed: Error loading"),
    (["model._target_=own.text", DATA, "+dataset.train_size=64"],
     "model._target_=own.text returned a str ('a model, honestly'), not a torch.nn.Module"),
    (["dataset._target_=own.bytes_data"],
     "dataset._target_=own.bytes_data: train[0] is a tuple of 2 (a Tensor of torch.uint8 "
     "[2, 5, 5], a str ('cat')); expected (image, label): a float tensor C x H x W and an int"),
])
def test_a_bad_target_exits_2_naming_it_before_anything_starts(builders, overrides, says):
    run_dir = builders / "run"  # the trainer in this process (harness/commands.py)
    done = call(train, f"hydra.run.dir={run_dir}", *QUICK, *SMALL,
                f"data.root={builders / 'data'}", *overrides)
    assert done.code == 2 and says in done.err, done.err
    assert not (run_dir / "checkpoints").exists()


def test_validate_takes_the_new_options_and_refuses_nonsense():
    validate(compose_config("dataset=image_folder", "dataset.root=/data/imagenet"))
    validate(compose_config(MODEL, "+model.width=7"))
    # Four stages fit 32 x 32 images, not MNIST's; a _target_'s images are not known yet.
    validate(compose_config("model=cifar_convnet", "model.depth=4", DATA,
                            "+dataset.num_classes=3"))
    for overrides, problem in [
        (["dataset=image_folder"], "dataset.root: required with dataset=image_folder"),
        (["dataset=image_folder", "dataset.root=x", "dataset.mean=[0.5]"],
         "dataset.mean=[0.5]: must be three values, one per RGB channel"),
        (["dataset.name=imagenet"], "valid: mnist, cifar10, synthetic, image_folder"),
        (["data.workers=-1"], "data.workers=-1: must be zero or positive"),
        ([DATA, "+dataset.num_classes=0"], "dataset.num_classes=0: must be positive"),
    ]:
        with pytest.raises(ConfigError) as e:
            validate(compose_config(*overrides))
        assert problem in str(e.value)


# ------------------------------------------------- the loader path, at the Batch level

N, G = 100, 12


class Items(torch.utils.data.Dataset):
    """Image i is filled with (i % 256) / 255 and labelled i, as the in-memory ``TINY``
    gives it after normalisation (mean 0, std 1); with ``noise``, plus a random draw
    from torch's RNG, as a random transform makes."""

    def __init__(self, n: int, noise: bool = False) -> None:
        self.n, self.noise = n, noise

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        image = torch.full((1, 3, 3), (i % 256) / 255)
        return (image + torch.rand(1, 3, 3) if self.noise else image), i


TINY = Dataset("tiny", Split((torch.arange(N) % 256).to(torch.uint8).view(N, 1, 1, 1)
                             .expand(N, 1, 3, 3).contiguous(), torch.arange(N)),
               Split(torch.zeros(10, 1, 3, 3, dtype=torch.uint8), torch.arange(10)),
               N, (0.0,), (1.0,))


def as_map(noise: bool = False) -> MapDataset:
    return MapDataset("tiny", Items(N, noise), Items(10), N, (1, 3, 3))


def steps(kind, dataset, world_size: int, accumulation: int, epoch: int = 0, offset: int = 0,
          **kwargs):
    """Every step of every rank: [(offset after it, [micro-batch (x, y) of rank r, ...
    micro-step k-major])]."""
    ranks = [kind(dataset, global_batch=G, rank=r, world_size=world_size,
                  accumulation=accumulation, seed=3, device=torch.device("cpu"), **kwargs)
             .train(epoch, offset) for r in range(world_size)]
    return [(per_rank[0].offset, [b.micro[k] for k in range(accumulation) for b in per_rank])
            for per_rank in zip(*ranks, strict=True)]


@pytest.mark.parametrize("world_size, accumulation, workers", [(1, 1, 0), (2, 2, 0),
                                                                (3, 1, 2)])
def test_the_loader_batches_are_the_in_memory_batches_per_step_rank_and_micro_step(
        world_size, accumulation, workers):
    for epoch, offset in [(0, 0), (2, 3 * G)]:  # and resumed mid-epoch
        memory = steps(Batches, TINY, world_size, accumulation, epoch, offset, augment=False)
        loaded = steps(LoaderBatches, as_map(), world_size, accumulation, epoch, offset,
                       workers=workers)
        assert len(loaded) == len(memory) == N // G - offset // G
        for (end, micro), (memory_end, memory_micro) in zip(loaded, memory, strict=True):
            assert end == memory_end
            for (x, y), (memory_x, memory_y) in zip(micro, memory_micro, strict=True):
                assert torch.equal(y, memory_y)
                torch.testing.assert_close(x, memory_x)


def test_random_transforms_in_loader_processes_are_the_same_on_any_number_of_workers():
    def images(world_size: int, workers: int, epoch: int) -> torch.Tensor:
        return torch.cat([x for _, micro in steps(LoaderBatches, as_map(noise=True), world_size,
                                                   1, epoch, workers=workers)
                          for x, _ in micro])

    one = images(1, 0, epoch=1)
    assert torch.equal(images(2, 2, epoch=1), one)  # 2 ranks, 2 loader processes each
    assert not torch.equal(images(1, 0, epoch=2), one)  # and random: another epoch differs


def test_loader_batches_are_in_the_runs_dtype_memory_format_and_evaluate_every_sample_once():
    batches = [LoaderBatches(as_map(), global_batch=G, rank=r, world_size=3, accumulation=1,
                             seed=3, device=torch.device("cpu"), dtype=torch.float64,
                             memory_format=torch.channels_last, workers=0) for r in range(3)]
    x, y = next(batches[0].train(0)).micro[0]
    assert x.dtype == torch.float64 and x.is_contiguous(memory_format=torch.channels_last)
    assert y.dtype == torch.long and batches[0].steps_per_epoch == N // G
    assert batches[0].steps_left(5 * G) == N // G - 5
    tested = torch.cat([y for b in batches for _, y in b.test(batch_size=3, samples=8)])
    assert tested.tolist() == list(range(8))


# ----------------------------------------------------------------------- image_folder

def image_folder(root, per_class: dict[str, int]) -> None:
    """Small RGB PNGs of two classes, of sizes that need the resize and the crop."""
    from PIL import Image

    rng = np.random.default_rng(0)
    for split, n in per_class.items():
        for label in ("cat", "dog"):
            (root / split / label).mkdir(parents=True)
            for i in range(n):
                pixels = rng.integers(0, 256, (30 + i % 5, 36, 3), dtype=np.uint8)
                Image.fromarray(pixels).save(root / split / label / f"{i}.png")


@pytest.mark.slow
def test_image_folder_on_two_workers_equals_one_worker_with_the_same_global_batch(tmp_path):
    image_folder(tmp_path / "images", {"train": 24, "val": 6})
    common = ["dataset=image_folder", f"dataset.root={tmp_path / 'images'}", "dataset.size=28",
              "dataset.augment=false", "train.dtype=float64", "train.global_batch=16",
              "train.epochs=2", "train.max_steps=5", "train.threads=1", "train.seed=4"]
    one = run_trainer(tmp_path / "one", *common, launcher="spawned")
    two = run_trainer(tmp_path / "two", *common, launcher="spawned", nproc=2)
    assert two.summary["world_size"] == 2 and one.summary["world_size"] == 1
    assert two.summary["steps"] == one.summary["steps"] == 5
    assert one.summary["dataset"] == "image_folder" and one.summary["epochs"] == 5 / 3
    assert_close(two.params(), one.params(), rtol=1e-10)
    # and the weights moved from where they started: not a trivially equal pair
    runtime.seed_all(4)
    start = build_model(compose_config().model, (3, 28, 28), 2).state_dict()
    trained = one.params()
    assert trained.keys() == start.keys()
    assert all(not torch.equal(start[k].double(), v) for k, v in trained.items())
