"""A fixed reference MNIST recipe, the yardstick of the time-to-accuracy benchmark: written
once and never tuned, so that the trainer's time over this loop's, measured side by side,
means the same whatever the trainer's default becomes (docs/benchmarks.md gives the
recipe; the constants below are it).

    python -m spotring.benchmarks.reference_loop [--seed 3] [--eval-every 32] [--max-steps 5]

One process, plain_loop's network and MNIST in memory, one epoch of one permutation
seeded by --seed (the last 60000 mod 128 samples dropped). The clock stops while it
evaluates on the whole test set, as the trainer's does. It prints one JSON line:
train_seconds, test_accuracy, curve ([step, train_seconds, accuracy] of every
evaluation), evaluation_seconds, seed, steps, eval_every, threads, batch.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch
import torch.nn.functional as F
from torch import nn

from spotring.benchmarks.plain_loop import mnist, network

BATCH = 128
PEAK_LR = 0.1
WARMUP_FRACTION = 0.25
MOMENTUM = 0.9
WEIGHT_DECAY = 5e-4
LABEL_SMOOTHING = 0.1
EVAL_BATCH = 1000

Split = tuple[torch.Tensor, torch.Tensor]


def steps_per_epoch(train_size: int) -> int:
    """Full batches in one epoch: the steps of a whole run."""
    return train_size // BATCH


@torch.no_grad()
def evaluate(model: nn.Module, test: Split) -> float:
    """Accuracy on the whole test set."""
    model.eval()
    images, labels = test
    correct = sum(int((model(x).argmax(1) == y).sum())
                  for x, y in zip(images.split(EVAL_BATCH), labels.split(EVAL_BATCH),
                                  strict=True))
    model.train()
    return correct / len(labels)


def train(seed: int = 0, eval_every: int = 0, threads: int = 2, max_steps: int | None = None,
          data: dict[str, Split] | None = None) -> dict:
    """One run of the recipe on ``data`` (splits as plain_loop.mnist() gives them; read
    from MNIST when not given, tests pass a small set). ``max_steps`` stops early on the
    same LR schedule (tests)."""
    torch.set_num_threads(threads)
    data = data or mnist()
    (images, labels), test = data["train"], data["test"]
    torch.manual_seed(seed)
    model = network()
    optimizer = torch.optim.SGD(model.parameters(), lr=PEAK_LR, momentum=MOMENTUM,
                                nesterov=True, weight_decay=WEIGHT_DECAY)
    total = steps_per_epoch(len(labels))
    schedule = torch.optim.lr_scheduler.OneCycleLR(
        optimizer, max_lr=PEAK_LR, total_steps=total, pct_start=WARMUP_FRACTION,
        cycle_momentum=False)
    order = torch.randperm(len(labels), generator=torch.Generator().manual_seed(seed))
    steps = total if max_steps is None else min(total, max_steps)
    curve: list[tuple[int, float, float]] = []
    clock = evaluating = 0.0
    for step in range(1, steps + 1):
        start = time.perf_counter()
        index = order[(step - 1) * BATCH: step * BATCH]
        loss = F.cross_entropy(model(images[index]), labels[index],
                               label_smoothing=LABEL_SMOOTHING)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        schedule.step()
        clock += time.perf_counter() - start
        if step == steps or (eval_every > 0 and step % eval_every == 0):
            start = time.perf_counter()
            curve.append((step, clock, evaluate(model, test)))
            evaluating += time.perf_counter() - start
    return {"train_seconds": clock, "test_accuracy": curve[-1][2], "curve": curve,
            "evaluation_seconds": evaluating, "seed": seed, "steps": steps,
            "eval_every": eval_every, "threads": threads, "batch": BATCH}


def _at_least(minimum: int):
    def parse(text: str) -> int:
        value = int(text)
        if value < minimum:
            raise argparse.ArgumentTypeError(f"{text}: must be {minimum} or more")
        return value
    return parse


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m spotring.benchmarks.reference_loop",
                                description=__doc__.splitlines()[0])
    p.add_argument("--seed", type=_at_least(0), default=0,
                   help="of the order and the initial weights")
    p.add_argument("--eval-every", type=_at_least(0), default=0,
                   help="steps between evaluations (default 0: only at the end)")
    p.add_argument("--threads", type=_at_least(1), default=2, help="torch threads (default 2)")
    p.add_argument("--max-steps", type=_at_least(1),
                   help="stop after this many steps, on the 1-epoch schedule (tests)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    print(json.dumps(train(args.seed, args.eval_every, args.threads, args.max_steps)),
          flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
