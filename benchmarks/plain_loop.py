"""A plain PyTorch MNIST loop: the baseline the trainer's throughput is measured against.

The trainer's throughput job (model=convnet in float32, benchmarks.runs.MNIST) with
nothing around it: the same network, per-worker batch, data (the trainer's reader, in
memory) and SGD, but no config, LR schedule, checkpoints, telemetry or vote. Under
torchrun it is DDP on Gloo, rank r taking every W-th sample of each global batch.

    torchrun --standalone --nproc-per-node 2 -m spotring.benchmarks.plain_loop --batch-size 64

Rank 0 prints one JSON line: img/s of every --log-every steps, timed as the trainer's
(training steps only), and over all steps.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from spotring.trainer import datasets
from spotring.trainer.config import compose


def network() -> nn.Module:
    """conf/model/convnet.yaml's network: conv5x5-32 + pool, conv5x5-64 + pool, FC 128."""
    return nn.Sequential(
        nn.Conv2d(1, 32, 5), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(32, 64, 5), nn.ReLU(), nn.MaxPool2d(2), nn.Flatten(),
        nn.Linear(64 * 4 * 4, 128), nn.ReLU(), nn.Linear(128, 10),
    )


def mnist() -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """MNIST's "train" and "test" images, normalized as the trainer does, and labels."""
    cfg = compose(["dataset=mnist"])
    data = datasets.load(cfg.dataset, cfg.data, cfg.train.seed)
    mean, std = data.mean[0], data.std[0]
    return {name: ((split.images.float() / 255 - mean) / std, split.labels)
            for name, split in (("train", data.train), ("test", data.test))}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch-size", type=int, default=64, help="per worker")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--log-every", type=int, default=10, help="steps per img/s interval")
    args = p.parse_args()

    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    if world > 1:
        dist.init_process_group("gloo")
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    x_train, y_train = mnist()["train"]
    model = network()
    if world > 1:
        model = nn.parallel.DistributedDataParallel(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9, nesterov=True,
                                weight_decay=5e-4)
    global_batch = args.batch_size * world
    steps_per_epoch = len(x_train) // global_batch
    intervals, elapsed, logged = [], 0.0, 0.0
    for step in range(args.steps):
        if step % steps_per_epoch == 0:
            order = torch.randperm(len(x_train), generator=torch.Generator().manual_seed(step))
        i = step % steps_per_epoch
        index = order[i * global_batch: (i + 1) * global_batch][rank::world]
        start = time.perf_counter()
        loss = F.cross_entropy(model(x_train[index]), y_train[index], label_smoothing=0.1)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        elapsed += time.perf_counter() - start
        if (step + 1) % args.log_every == 0:
            intervals.append({"step": step + 1, "images_per_second":
                              args.log_every * global_batch / (elapsed - logged)})
            logged = elapsed
    if rank == 0:
        print(json.dumps({"images_per_second": args.steps * global_batch / elapsed,
                          "world_size": world, "global_batch": global_batch,
                          "intervals": intervals}), flush=True)
    if world > 1:
        dist.barrier()  # leave together: no rank closes while another still reduces
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
    # Free DDP's reducer, which holds the Gloo group, before the interpreter finalizes:
    # Gloo's threads may otherwise abort a run that succeeded (DDPEngine.shutdown says why).
    gc.collect()
