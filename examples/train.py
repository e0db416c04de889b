"""A small CNN on a folder of images, in two versions that differ only in the lines marked
`# spotring:` (see them with `diff -u examples/plain_train.py examples/train.py`):

    plain_train.py  plain single-process PyTorch
    train.py        data-parallel with spotring: alone or under torchrun, horovodrun, mpirun
                    or srun, on CPUs or one GPU per worker; a checkpoint every epoch; SIGTERM
                    or an EC2 spot notice on any worker stops them all at the same step with
                    a checkpoint and exit code 75, and the same command continues from it on
                    any number of workers, with the same samples in the same steps

    python examples/plain_train.py --data DIR --out OUT    (the others: examples/README.md)

DIR holds train/ and test/ in torchvision's ImageFolder layout, <split>/<class>/<file>.png
(any format Pillow reads, read in grey). --batch-size is the global batch, the samples of
one optimizer step whatever the number of workers. OUT/weights.pt holds the model's
state_dict at the end; train.py's rank 0 also writes OUT/checkpoints/, metrics.jsonl and
summary.json there.
"""

import argparse
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from torchvision.datasets import ImageFolder
from torchvision.transforms import v2

import spotring  # spotring


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", required=True, help="a folder with train/ and test/")
    p.add_argument("--out", default="out", help="where weights.pt goes")
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--batch-size", type=int, default=16, help="samples per optimizer step")
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--dtype", choices=("float32", "float64"), default="float32")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--workers", type=int, default=0, help="data loader processes")
    return p


def image_folders(root: str, dtype: str) -> tuple[ImageFolder, ImageFolder]:
    """The train and test splits under ``root``: (1, H, W) tensors of ``dtype`` in [0, 1]."""
    to_tensor = v2.Compose([v2.Grayscale(), v2.ToImage(),
                            v2.ToDtype(getattr(torch, dtype), scale=True)])
    return tuple(ImageFolder(Path(root) / split, transform=to_tensor)
                 for split in ("train", "test"))


def small_cnn(classes: int) -> nn.Module:
    """Two 3x3 convolutions and a linear classifier: any image size, one channel."""
    return nn.Sequential(
        nn.Conv2d(1, 8, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(8, 16, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
        nn.Linear(16, classes))


@torch.no_grad()
def evaluate(model: nn.Module, dataset, device: torch.device, batch_size: int = 256) -> float:
    """The fraction of ``dataset`` the model classifies correctly."""
    model.eval()
    correct = 0
    for x, y in torch.utils.data.DataLoader(dataset, batch_size):
        correct += (model(x.to(device)).argmax(1) == y.to(device)).sum().item()
    return correct / len(dataset)


def save_weights(model: nn.Module, out: str) -> None:
    Path(out).mkdir(parents=True, exist_ok=True)
    torch.save(model.state_dict(), Path(out) / "weights.pt")


def train(args: argparse.Namespace, job: spotring.Job) -> None:  # spotring: the job
    device = job.device  # spotring: this worker's GPU, or the CPU
    torch.manual_seed(args.seed)
    train_set, test_set = image_folders(args.data, args.dtype)
    model = small_cnn(len(train_set.classes)).to(device, getattr(torch, args.dtype))
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    loader = job.loader(train_set, args.batch_size, num_workers=args.workers)  # spotring: a shard
    model, optimizer = job.wrap(model, optimizer)  # spotring: rank 0's weights, averaged gradients
    job.track(model=model, optimizer=optimizer, loader=loader)  # spotring: what checkpoints hold
    job.restore()  # spotring: the newest checkpoint, if any, on any number of workers
    for epoch in loader.epochs(args.epochs):  # spotring: from where a restore left off
        for x, y in loader:
            loss = F.cross_entropy(model(x.to(device)), y.to(device))
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            if job.should_stop():  # spotring: SIGTERM or a spot notice on any worker
                job.save_and_exit()  # spotring: a checkpoint, then exit 75 on every worker
        job.save()  # spotring: a checkpoint every epoch
        print(f"epoch {epoch + 1}: loss {loss.item():.4f}")
    accuracy = evaluate(model, test_set, device)
    print(f"test accuracy {accuracy:.2%}")
    job.log("test", accuracy=accuracy)  # spotring: metrics.jsonl, what spotring sweep reads
    if job.is_main:  # spotring: one worker writes
        save_weights(job.unwrap(model), args.out)  # spotring: the model inside DDP's wrapper
    job.finish(test_accuracy=accuracy)  # spotring: summary.json


def main() -> None:
    args = parser().parse_args()
    with spotring.init(seed=args.seed, run_dir=args.out) as job:  # spotring
        train(args, job)  # spotring: exit 69 for a lost worker, 2 for bad input (docs/api.md)


if __name__ == "__main__":
    main()
