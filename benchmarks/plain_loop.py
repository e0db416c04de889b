"""A plain PyTorch MNIST loop: the baseline the trainer is measured against.

The trainer's default job with nothing around it: the same network, per-worker batch,
in-memory data, SGD with Nesterov momentum, label smoothing and LR curve (linear
scaling, warmup, cosine), but no config system, checkpoints, telemetry or
world-size-invariant order. Under torchrun it is DDP on Gloo with the usual sharding
(rank r takes every W-th sample of one shared permutation).

    python -m benchmarks.plain_loop --threads 2 --batch-size 128
    torchrun --standalone --nproc-per-node 2 -m benchmarks.plain_loop --batch-size 64
    torchrun ... -m benchmarks.plain_loop --max-steps 40 --log-every 5   # throughput only

Prints one JSON object: img/s over the training steps only, img/s of every
--log-every steps (the intervals the throughput benchmark reads, timed like the
trainer's), and the test accuracy at every evaluation with the training seconds before
it. A run cut short by --max-steps is not evaluated (throughput runs need no accuracy).
"""

from __future__ import annotations

import argparse
import gzip
import json
import math
import os
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

DATA = Path(__file__).resolve().parents[1] / "data" / "MNIST" / "raw"


def read_idx(name: str) -> torch.Tensor:
    raw = gzip.decompress((DATA / f"{name}.gz").read_bytes())
    ndim = raw[3]
    dims = np.frombuffer(raw, ">u4", ndim, 4)
    return torch.from_numpy(np.frombuffer(raw, np.uint8, offset=4 + 4 * ndim).reshape(dims))


def network() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(1, 32, 5), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(32, 64, 5), nn.ReLU(), nn.MaxPool2d(2), nn.Flatten(),
        nn.Linear(64 * 4 * 4, 128), nn.ReLU(), nn.Linear(128, 10),
    )


def sgd(model: nn.Module, lr: float) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9, nesterov=True,
                           weight_decay=5e-4)


def loss_of(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits, y, label_smoothing=0.1)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--batch-size", type=int, default=64, help="per worker")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--lr", type=float, default=0.05, help="at --reference-batch")
    p.add_argument("--reference-batch", type=int, default=128)
    p.add_argument("--warmup-epochs", type=float, default=0.5)
    p.add_argument("--eval-every", type=int, default=0, help="steps; 0: each epoch end")
    p.add_argument("--max-steps", type=int, default=None, help="stop after this many steps")
    p.add_argument("--log-every", type=int, default=10, help="steps per img/s interval")
    args = p.parse_args()

    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    if world > 1:
        dist.init_process_group("gloo")
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)

    mean, std = 0.1307, 0.3081
    x_train = ((read_idx("train-images-idx3-ubyte").float() / 255 - mean) / std).unsqueeze(1)
    y_train = read_idx("train-labels-idx1-ubyte").long()
    x_test = ((read_idx("t10k-images-idx3-ubyte").float() / 255 - mean) / std).unsqueeze(1)
    y_test = read_idx("t10k-labels-idx1-ubyte").long()

    model = network()
    if world > 1:
        model = nn.parallel.DistributedDataParallel(model)
    optimizer = sgd(model, args.lr)
    global_batch = args.batch_size * world
    steps_per_epoch = len(x_train) // global_batch
    total, warmup = args.epochs * steps_per_epoch, args.warmup_epochs * steps_per_epoch
    stop = total if args.max_steps is None else min(total, args.max_steps)
    peak = args.lr * global_batch / args.reference_batch
    start_lr = min(args.lr, peak)

    def lr_at(t: int) -> float:
        if t < warmup:
            return start_lr + (peak - start_lr) * t / warmup
        return peak * (1 + math.cos(math.pi * (t - warmup) / (total - warmup))) / 2

    def evaluate() -> float:
        model.eval()
        with torch.no_grad():
            mine = torch.arange(len(x_test)).tensor_split(world)[rank]
            correct = torch.tensor([0.0])
            for index in mine.split(1000):
                correct += (model(x_test[index]).argmax(1) == y_test[index]).sum()
        model.train()
        if world > 1:
            dist.all_reduce(correct)
        return correct.item() / len(x_test)

    train_seconds, step, evals, intervals, logged = 0.0, 0, [], [], 0.0
    for epoch in range(args.epochs):
        if step >= stop:
            break
        order = torch.randperm(len(x_train), generator=torch.Generator().manual_seed(epoch))
        start = time.perf_counter()
        for i in range(steps_per_epoch):
            index = order[i * global_batch: (i + 1) * global_batch][rank::world]
            for group in optimizer.param_groups:
                group["lr"] = lr_at(step)
            loss = loss_of(model(x_train[index]), y_train[index])
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            step += 1
            if step % args.log_every == 0:
                now = train_seconds + time.perf_counter() - start
                intervals.append({"step": step, "images_per_second":
                                  args.log_every * global_batch / (now - logged)})
                logged = now
            if step == stop != total:  # cut short by --max-steps: not evaluated
                break
            if (args.eval_every and step % args.eval_every == 0) or i == steps_per_epoch - 1:
                train_seconds += time.perf_counter() - start
                evals.append({"step": step, "train_seconds": train_seconds,
                              "accuracy": evaluate()})
                start = time.perf_counter()
        train_seconds += time.perf_counter() - start
    if rank == 0:
        print(json.dumps({
            "images_per_second": step * global_batch / train_seconds,
            "train_seconds": train_seconds, "steps": step, "world_size": world,
            "global_batch": global_batch,
            "test_accuracy": evals[-1]["accuracy"] if evals else None,
            "evals": evals, "intervals": intervals,
        }))
    if world > 1:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
