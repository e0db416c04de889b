"""The measured loops of benchmarks/api_cost.py, one per run: the same job as a plain
PyTorch DDP script and with spotring's calls, and spotring.DataLoader over image files.
Each prints rank 0's window as one JSON line.

    torchrun --standalone --nproc-per-node 2 -m spotring.benchmarks.api_cost_loops \\
        --variant spotring                      # or plain: the api section's two runs
    python -m spotring.benchmarks.api_cost_loops --variant files --data DIR \\
        --loader-workers 2                      # an ImageFolder: the dataloader section's

The two training loops differ only in spotring's lines (job.loader, job.wrap, job.track,
job.should_stop every step, job.save after the timed window) and in the DDP: DDP's
defaults, and spotring's engine's, which views gradients in its buckets.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset
from torchvision.datasets import ImageFolder
from torchvision.transforms import v2

import spotring
from spotring.benchmarks.plain_loop import mnist, network
from spotring.benchmarks.suite import counts

MODULE = "spotring.benchmarks.api_cost_loops"
THREADS = 1  # torch threads per process
GLOBAL_BATCH = 128
SEED = 0
WINDOWS = {"api": (30, 600), "dataloader": (10, 300)}  # (warm-up steps, timed steps)


class Window:
    """The wall-clock seconds of steps warmup+1 .. warmup+steps of a loop: ``tick()`` after
    every step says when the window is complete."""

    def __init__(self, warmup: int, steps: int, global_batch: int) -> None:
        self.warmup, self.steps, self.global_batch = warmup, steps, global_batch
        self.done, self.started, self.seconds = 0, 0.0, 0.0

    def epochs(self, steps_per_epoch: int) -> int:
        """Epochs that hold the warm-up and the window."""
        return math.ceil((self.warmup + self.steps) / steps_per_epoch)

    @property
    def complete(self) -> bool:
        return self.done >= self.warmup + self.steps

    def tick(self) -> bool:
        self.done += 1
        if self.done == self.warmup:
            self.started = time.perf_counter()
        elif self.complete:
            self.seconds = time.perf_counter() - self.started
        return self.complete

    def result(self, **fields) -> dict:
        return {"images_per_second": self.steps * self.global_batch / self.seconds,
                "seconds": self.seconds, "warmup": self.warmup, "steps": self.steps,
                "global_batch": self.global_batch, **fields}


def mnist_in_memory():
    """MNIST's 60,000 training images, normalized, and labels: a TensorDataset."""
    return TensorDataset(*mnist()["train"])


def network_and_sgd():
    """benchmarks/plain_loop.py's convnet, and SGD with momentum over it."""
    model = network()
    return model, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)


def train_step(model, optimizer, x, y) -> None:
    loss = F.cross_entropy(model(x), y)
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()


def plain(args: argparse.Namespace) -> dict | None:
    """The job as a plain PyTorch DDP script; rank 0's window."""
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(THREADS)
    torch.manual_seed(SEED)
    dataset = mnist_in_memory()
    sampler = DistributedSampler(dataset, world, rank, seed=SEED, drop_last=True)
    loader = DataLoader(dataset, args.global_batch // world, sampler=sampler, drop_last=True)
    model, optimizer = network_and_sgd()
    model = DistributedDataParallel(model)
    window = Window(args.warmup, args.steps, args.global_batch)
    for epoch in range(window.epochs(len(loader))):
        sampler.set_epoch(epoch)
        for x, y in loader:
            train_step(model, optimizer, x, y)
            if window.tick():
                break
        if window.complete:
            break
    dist.barrier()  # leave together: no rank closes while another still reduces
    dist.destroy_process_group()
    return window.result(variant="plain", world_size=world) if rank == 0 else None


def with_spotring(args: argparse.Namespace) -> dict | None:
    """The same job with spotring's calls; rank 0's window."""
    with spotring.init(threads=THREADS, seed=SEED, run_dir=args.run_dir) as job:
        dataset = mnist_in_memory()
        loader = job.loader(dataset, args.global_batch)
        model, optimizer = job.wrap(*network_and_sgd())
        job.track(model=model, optimizer=optimizer, loader=loader)
        window = Window(args.warmup, args.steps, args.global_batch)
        for _ in loader.epochs(window.epochs(loader.steps_per_epoch)):
            for x, y in loader:
                train_step(model, optimizer, x, y)
                if job.should_stop():
                    job.save_and_exit()
                if window.tick():
                    break
            if window.complete:
                break
        result = window.result(variant="spotring", world_size=job.world_size)
        job.save()  # after the window: a checkpoint costs what the disk does
    return result if job.is_main else None


def image_files(args: argparse.Namespace) -> dict:
    """spotring.DataLoader over the PNG files in args.data, one process; the window."""
    torch.set_num_threads(THREADS)
    to_tensor = v2.Compose([v2.Grayscale(), v2.ToImage(),
                            v2.ToDtype(torch.float32, scale=True)])
    workers = args.loader_workers
    loader = spotring.DataLoader(ImageFolder(args.data, transform=to_tensor),
                                 args.global_batch, seed=SEED, rank=0, world_size=1,
                                 num_workers=workers, persistent_workers=workers > 0)
    window = Window(args.warmup, args.steps, args.global_batch)
    for _ in loader.epochs(window.epochs(loader.steps_per_epoch)):
        for _batch in loader:
            if window.tick():
                break
        if window.complete:
            break
    return window.result(variant="files", loader_workers=workers, files=len(loader.dataset))


VARIANTS = {"plain": plain, "spotring": with_spotring, "files": image_files}


def _processes(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"{text}: must be 0 or more")
    return value


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=f"python -m {MODULE}", description=__doc__.splitlines()[0])
    p.add_argument("--variant", choices=tuple(VARIANTS), required=True,
                   help="the loop to run and measure")
    p.add_argument("--global-batch", type=counts, default=GLOBAL_BATCH)
    p.add_argument("--warmup", type=counts, default=WINDOWS["api"][0],
                   help="steps before the timed window")
    p.add_argument("--steps", type=counts, default=WINDOWS["api"][1], help="timed steps")
    p.add_argument("--run-dir", default="runs/api-cost", help="spotring's run_dir")
    p.add_argument("--data", help="--variant files: an ImageFolder of images")
    p.add_argument("--loader-workers", type=_processes, default=0,
                   help="--variant files: DataLoader processes (0: none)")
    return p


def main(argv: list[str] | None = None) -> int:
    p = parser()
    args = p.parse_args(argv)
    if args.variant == "files" and args.data is None:
        p.error("--variant files needs --data DIR (an ImageFolder of images)")
    result = VARIANTS[args.variant](args)
    if result is not None:
        print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    code = main()
    # Free DDP's reducer, which holds the Gloo group, before the interpreter finalizes:
    # Gloo's threads may otherwise abort a run that succeeded (benchmarks/plain_loop.py).
    gc.collect()
    sys.exit(code)
