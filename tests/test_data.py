"""The world-size-invariant sample order, augmentation, and the dataset readers."""

from __future__ import annotations

import pickle

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf

from trainer.data import Batches, epoch_order, shard, steps_in_epoch
from trainer.datasets import DataError, Dataset, Split, load

N = 1000


def tiny_dataset(n: int = N, channels: int = 1, size: int = 8) -> Dataset:
    # Image i is filled with the value i % 256 and labelled i: a batch tells its samples.
    images = (torch.arange(n) % 256).to(torch.uint8).view(n, 1, 1, 1).expand(
        n, channels, size, size).contiguous()
    split = Split(images, torch.arange(n))
    return Dataset("tiny", split, Split(images[:103], torch.arange(103)), n,
                   (0.0,) * channels, (1.0,) * channels)


def global_batches(world_size: int, accumulation: int, global_batch: int, epoch: int,
                   dataset: Dataset | None = None, augment: bool = False, offset: int = 0):
    """Each step's samples (labels) and images, gathered over all ranks and micro-steps
    in rank-major order of the global batch."""
    dataset = dataset or tiny_dataset()
    ranks = [
        Batches(dataset, global_batch=global_batch, rank=r, world_size=world_size,
                accumulation=accumulation, seed=7, augment=augment,
                device=torch.device("cpu")).train(epoch, offset)
        for r in range(world_size)
    ]
    steps = []
    for per_rank in zip(*ranks, strict=True):
        # Reassemble slice k*W + r in order.
        parts = [per_rank[r].micro[k] for k in range(accumulation) for r in range(world_size)]
        steps.append((torch.cat([y for _, y in parts]), torch.cat([x for x, _ in parts])))
    return steps


@pytest.mark.parametrize("epoch", [0, 3])
def test_global_batches_are_identical_for_1_2_3_4_workers(epoch):
    reference = global_batches(1, 1, 12, epoch)
    for world_size, accumulation in [(2, 1), (3, 1), (4, 1), (2, 2), (3, 4), (1, 12)]:
        steps = global_batches(world_size, accumulation, 12, epoch)
        assert len(steps) == len(reference) == N // 12
        for (labels, images), (ref_labels, ref_images) in zip(steps, reference, strict=True):
            assert torch.equal(labels, ref_labels), (world_size, accumulation)
            assert torch.equal(images, ref_images)


def test_epoch_is_disjoint_and_covering_except_a_tail_shorter_than_a_global_batch():
    for world_size in (1, 2, 3, 4):
        seen = torch.cat([labels for labels, _ in global_batches(world_size, 1, 12, 0)])
        assert len(seen) == len(set(seen.tolist())) == (N // 12) * 12  # no sample twice
        assert N - len(seen) < 12  # only the tail is left out
        # ranks are disjoint within a step
        parts = shard(epoch_order(N, 7, 0)[:12], 0, world_size, 1)[0]
        assert len(parts) == 12 // world_size


def test_order_is_reshuffled_every_epoch_and_reproducible():
    first, second = epoch_order(N, 7, 0), epoch_order(N, 7, 1)
    assert not torch.equal(first, second)
    assert torch.equal(first, epoch_order(N, 7, 0))
    assert sorted(first.tolist()) == list(range(N))
    # the dropped tail differs between epochs
    assert set(first[-(N % 12):].tolist()) != set(second[-(N % 12):].tolist())


def test_resuming_mid_epoch_continues_the_same_sequence():
    whole = global_batches(2, 1, 12, 1)
    resumed = global_batches(3, 1, 12, 1, offset=5 * 12)
    assert [b.tolist() for b, _ in resumed] == [b.tolist() for b, _ in whole[5:]]
    assert steps_in_epoch(N, 12, 5 * 12) == len(whole) - 5


def test_augmentation_is_world_size_invariant_and_really_augments():
    data = tiny_dataset(channels=3, size=8)
    # distinct pixel values, so crops and flips show
    data.train.images = torch.randint(0, 256, data.train.images.shape, dtype=torch.uint8,
                                      generator=torch.Generator().manual_seed(0))
    one = global_batches(1, 1, 12, 2, data, augment=True)
    four = global_batches(4, 1, 12, 2, data, augment=True)
    for (labels, images), (labels4, images4) in zip(one, four, strict=True):
        assert torch.equal(labels, labels4) and torch.equal(images, images4)
    plain = global_batches(1, 1, 12, 2, data, augment=False)
    assert not torch.equal(one[0][1], plain[0][1])
    # same epoch, another offset: other crops
    assert any(not torch.equal(a[1], b[1]) for a, b in zip(one, plain, strict=True))


@pytest.mark.parametrize("samples, counted", [(None, 103), (40, 40), (500, 103)])
def test_evaluation_counts_every_test_sample_once(samples, counted):
    data = tiny_dataset()
    for world_size in (1, 2, 3, 4):
        labels = []
        for r in range(world_size):
            batches = Batches(data, global_batch=12, rank=r, world_size=world_size,
                              accumulation=1, seed=0, augment=False, device=torch.device("cpu"))
            labels += [y for _, y in batches.test(batch_size=10, samples=samples)]
        assert sorted(torch.cat(labels).tolist()) == list(range(counted))


def test_normalisation_uses_the_dataset_statistics():
    data = tiny_dataset()
    data.mean, data.std = (0.5,), (0.25,)
    batches = Batches(data, global_batch=4, rank=0, world_size=1, accumulation=1, seed=0,
                      augment=False, device=torch.device("cpu"))
    x, y = next(batches.test(batch_size=4))
    assert torch.allclose(x[:, 0, 0, 0], (y.float() / 255 - 0.5) / 0.25)


# ----------------------------------------------------------------------------- readers


def test_real_mnist_shipped_with_the_repository_reads_with_the_published_counts():
    mnist = load(OmegaConf.create({"name": "mnist"}),
                 OmegaConf.create({"root": None, "download": False}), 0)
    assert mnist.train.images.shape == (60000, 1, 28, 28)
    assert mnist.test.images.shape == (10000, 1, 28, 28)
    assert mnist.train.labels.bincount().tolist() == [
        5923, 6742, 5958, 6131, 5842, 5421, 5918, 6265, 5851, 5949]


def write_cifar(root, n_per_batch=20):
    """Small files in the exact format of cifar-10-batches-py."""
    folder = root / "cifar-10-batches-py"
    folder.mkdir(parents=True)
    rng = np.random.default_rng(0)
    for name in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]:
        batch = {b"data": rng.integers(0, 256, (n_per_batch, 3072), dtype=np.uint8),
                 b"labels": rng.integers(0, 10, n_per_batch).tolist(),
                 b"batch_label": name.encode()}
        with (folder / name).open("wb") as f:
            pickle.dump(batch, f)
    with (folder / "batches.meta").open("wb") as f:
        pickle.dump({b"label_names": [b"airplane", b"automobile"]}, f)
    return folder


def test_cifar10_python_format_is_read_channel_planes_first(tmp_path):
    folder = write_cifar(tmp_path)
    cifar = load(OmegaConf.create({"name": "cifar10"}),
                 OmegaConf.create({"root": str(tmp_path), "download": False}), 0)
    assert cifar.train.images.shape == (100, 3, 32, 32)
    assert cifar.test.images.shape == (20, 3, 32, 32)
    with (folder / "data_batch_1").open("rb") as f:
        first = pickle.load(f, encoding="bytes")
    row = torch.as_tensor(first[b"data"][0])
    assert torch.equal(cifar.train.images[0, 1].flatten(), row[1024:2048])  # green plane
    assert cifar.train.labels[:20].tolist() == first[b"labels"]


def test_missing_dataset_offline_says_where_it_looked_and_how_to_fix_it(tmp_path):
    with pytest.raises(DataError) as e:
        load(OmegaConf.create({"name": "cifar10"}),
             OmegaConf.create({"root": str(tmp_path), "download": False}), 0)
    message = str(e.value)
    assert str(tmp_path) in message and "cifar-10-batches-py/data_batch_1" in message
    assert "data.root=" in message


def test_failed_download_is_reported_with_the_reason(tmp_path, monkeypatch):
    import trainer.datasets as datasets

    def offline(root):
        raise OSError("[Errno -3] Temporary failure in name resolution")

    # The machine may be online; this stands in for the network being away.
    mnist = datasets._READERS["mnist"]
    monkeypatch.setitem(datasets._READERS, "mnist", (mnist[0], mnist[1], offline))
    with pytest.raises(DataError, match="name resolution") as e:
        load(OmegaConf.create({"name": "mnist"}),
             OmegaConf.create({"root": str(tmp_path), "download": True}), 0)
    assert "MNIST/raw/train-images-idx3-ubyte" in str(e.value)


def test_synthetic_data_has_the_requested_shape_and_is_reproducible():
    cfg = OmegaConf.create({"name": "synthetic", "shape": [3, 64, 48], "num_classes": 100,
                            "train_size": 5000, "test_size": 70})
    a = load(cfg, OmegaConf.create({"root": None, "download": False}), 3)
    b = load(cfg, OmegaConf.create({"root": None, "download": False}), 3)
    assert a.shape == (3, 64, 48) and len(a.train) == 5000 and len(a.test) == 70
    x, y = a.train.take(torch.tensor([0, 4999]))
    assert x.shape == (2, 3, 64, 48) and int(y.max()) < 100
    assert torch.equal(a.train.labels, b.train.labels)
