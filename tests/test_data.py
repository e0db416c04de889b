"""The world-size-invariant sample order, augmentation, and the dataset readers."""

from __future__ import annotations

import hashlib
import pickle
import shutil
import socket
import subprocess
import sys

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf

from spotring.sampler import epoch_order, shard, steps_in_epoch
from spotring.trainer.data import Batches
from spotring.trainer.datasets import DataError, Dataset, Split, load
from tests.conftest import REPO

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


def read(name: str, root, download: bool = False) -> Dataset:
    return load(OmegaConf.create({"name": name}),
                OmegaConf.create({"root": str(root), "download": download}), 0)


def test_real_mnist_shipped_with_the_repository_reads_with_the_published_counts():
    mnist = read("mnist", REPO / "data")
    assert mnist.train.images.shape == (60000, 1, 28, 28)
    assert mnist.test.images.shape == (10000, 1, 28, 28)
    assert mnist.train.images.dtype == torch.uint8 and mnist.train.labels.dtype == torch.int64
    assert mnist.train.labels.bincount().tolist() == [
        5923, 6742, 5958, 6131, 5842, 5421, 5918, 6265, 5851, 5949]


def mnist_gz_only(root):
    """A data root holding only the repository's four .gz files, as a fresh clone does."""
    raw = root / "MNIST" / "raw"
    raw.mkdir(parents=True)
    for gz in (REPO / "data" / "MNIST" / "raw").glob("*.gz"):
        shutil.copy(gz, raw)
    return raw


READ_MNIST = """
import sys
from omegaconf import OmegaConf
from spotring.trainer.datasets import load
mnist = load(OmegaConf.create({"name": "mnist"}),
             OmegaConf.create({"root": sys.argv[1], "download": False}), 0)
print(int(mnist.train.images.sum()), int(mnist.test.labels.sum()))
"""


@pytest.mark.slow
def test_ranks_starting_together_on_gz_files_all_read_the_whole_of_mnist(tmp_path):
    # Every rank of a host reads the same root at once; one decompresses, none reads a
    # half-written file. Real processes, started together as a launcher starts them.
    raw = mnist_gz_only(tmp_path)
    procs = [subprocess.Popen([sys.executable, "-c", READ_MNIST, str(tmp_path)], cwd=REPO,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for _ in range(3)]
    outputs = [p.communicate(timeout=300) for p in procs]
    assert [p.returncode for p in procs] == [0, 0, 0], [err[-2000:] for _, err in outputs]
    mnist = read("mnist", REPO / "data")
    expected = f"{int(mnist.train.images.sum())} {int(mnist.test.labels.sum())}"
    assert [out.strip() for out, _ in outputs] == [expected] * 3
    assert sorted(p.name for p in raw.iterdir() if not p.name.endswith(".gz")) == [
        "t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte", "train-images-idx3-ubyte",
        "train-labels-idx1-ubyte"]  # decompressed beside them, no temporary left


def test_a_damaged_mnist_file_is_reported_not_read(tmp_path):
    raw = mnist_gz_only(tmp_path)
    read("mnist", tmp_path)
    images = raw / "train-images-idx3-ubyte"
    images.write_bytes(images.read_bytes()[:100_000])  # cut short
    with pytest.raises(DataError, match="is not readable as MNIST") as e:
        read("mnist", tmp_path)
    assert str(raw) in str(e.value) and "data.root=PATH" in str(e.value)


def write_cifar(root, n_per_batch=20):
    """Small files in the format of cifar-10-batches-py: pickled dicts of N x 3072 uint8
    rows (the 1024 red, then green, then blue values of each image) and their labels."""
    folder = root / "cifar-10-batches-py"
    folder.mkdir(parents=True)
    rng = np.random.default_rng(0)
    for name in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]:
        batch = {"data": rng.integers(0, 256, (n_per_batch, 3072), dtype=np.uint8),
                 "labels": rng.integers(0, 10, n_per_batch).tolist(),
                 "batch_label": name}
        with (folder / name).open("wb") as f:
            pickle.dump(batch, f)
    with (folder / "batches.meta").open("wb") as f:
        pickle.dump({"label_names": ["airplane", "automobile"]}, f)
    return folder


@pytest.fixture
def published_as(monkeypatch):
    """published_as(folder): torchvision takes the files in ``folder`` for the published
    CIFAR-10. The real files are 170 MB from the internet; torchvision checks a copy
    against its table of their md5 sums, which this points at the small files instead."""
    from torchvision.datasets import CIFAR10

    def publish(folder):
        def md5(name):
            return hashlib.md5((folder / name).read_bytes()).hexdigest()
        monkeypatch.setattr(CIFAR10, "train_list", [[n, md5(n)] for n, _ in CIFAR10.train_list])
        monkeypatch.setattr(CIFAR10, "test_list", [[n, md5(n)] for n, _ in CIFAR10.test_list])
        monkeypatch.setattr(CIFAR10, "meta", {**CIFAR10.meta,
                                              "md5": md5(CIFAR10.meta["filename"])})
    return publish


def test_cifar10_python_format_is_read_channel_planes_first(tmp_path, published_as):
    folder = write_cifar(tmp_path)
    published_as(folder)
    cifar = read("cifar10", tmp_path)
    assert cifar.train.images.shape == (100, 3, 32, 32)
    assert cifar.test.images.shape == (20, 3, 32, 32)
    assert cifar.train.images.dtype == torch.uint8 and cifar.train.images.is_contiguous()
    with (folder / "data_batch_1").open("rb") as f:
        first = pickle.load(f)
    row = torch.as_tensor(first["data"][0])
    assert torch.equal(cifar.train.images[0, 1].flatten(), row[1024:2048])  # green plane
    assert cifar.train.labels[:20].tolist() == first["labels"]


def test_a_cifar10_copy_that_differs_from_the_published_files_is_refused(tmp_path,
                                                                        published_as):
    folder = write_cifar(tmp_path)
    published_as(folder)
    with (folder / "test_batch").open("r+b") as f:  # one byte changed
        f.seek(200)
        byte = f.read(1)
        f.seek(200)
        f.write(bytes([byte[0] ^ 1]))
    with pytest.raises(DataError) as e:
        read("cifar10", tmp_path, download=True)
    message = str(e.value)
    assert "cifar-10-batches-py/test_batch differ from the published CIFAR-10" in message
    assert "data_batch_1" not in message and "data.root=PATH" in message


def test_missing_dataset_offline_says_where_it_looked_and_how_to_fix_it(tmp_path):
    with pytest.raises(DataError) as e:
        read("cifar10", tmp_path / "nothing")
    message = str(e.value)
    assert str(tmp_path / "nothing") in message
    assert "cifar-10-batches-py/data_batch_1" in message and "data.root=" in message
    assert not (tmp_path / "nothing").exists()  # nothing created offline


def test_failed_download_is_reported_with_the_reason(tmp_path, monkeypatch):
    from torchvision.datasets import MNIST

    # Whether or not this machine is online: a mirror on a local port nobody listens on.
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setattr(MNIST, "mirrors", [f"http://127.0.0.1:{port}/"])
    with pytest.raises(DataError, match="download failed: .*Connection refused") as e:
        read("mnist", tmp_path, download=True)
    assert "MNIST/raw/train-images-idx3-ubyte" in str(e.value)
    assert "\n" not in str(e.value)  # one paragraph


def test_synthetic_data_has_the_requested_shape_and_is_reproducible():
    cfg = OmegaConf.create({"name": "synthetic", "shape": [3, 64, 48], "num_classes": 100,
                            "train_size": 5000, "test_size": 70})
    a = load(cfg, OmegaConf.create({"root": "data", "download": False}), 3)
    b = load(cfg, OmegaConf.create({"root": "data", "download": False}), 3)
    assert a.shape == (3, 64, 48) and len(a.train) == 5000 and len(a.test) == 70
    x, y = a.train.take(torch.tensor([0, 4999]))
    assert x.shape == (2, 3, 64, 48) and int(y.max()) < 100
    assert torch.equal(a.train.labels, b.train.labels)
