"""One rank of tests/test_fsdp.py's runs, written as a user's script: a float64 network of
two blocks trained with AdamW and an LR schedule built before wrap, on a tracked
spotring.DataLoader, with spotring's micro-steps (accumulation where --batch-size caps the
share); rank 0 saves the whole final weights and what the run was to OUT.

    python -m harness.fsdp_train OUT [--engine ddp|fsdp] [--shard-size N] [--batch-size B]

Every rank starts from weights and buffers of its own (seeded by its rank): wrap must give
them rank 0's.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from torch import nn
from torch.distributed.tensor import DTensor

import spotring

# Five steps within one epoch of six.
STEPS, GLOBAL_BATCH, WIDTH, SAMPLES = 5, 16, 8, 96


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(WIDTH)
        self.linear = nn.Linear(WIDTH, WIDTH)
        self.register_buffer("gain", torch.ones(WIDTH))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.gain * torch.tanh(self.linear(self.norm(x)))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(4, WIDTH)
        self.blocks = nn.ModuleList([Block(), Block()])
        self.head = nn.Linear(WIDTH, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def dataset() -> torch.utils.data.TensorDataset:
    g = torch.Generator().manual_seed(3)
    x = torch.randn(SAMPLES, 4, generator=g, dtype=torch.float64)
    return torch.utils.data.TensorDataset(x, torch.sin(x.sum(1)))


def whole(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter whole (a collective under fsdp: every rank calls it)."""
    return {name: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
            for name, p in model.named_parameters()}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("out", type=Path)
    p.add_argument("--engine", default="ddp", choices=("ddp", "fsdp"))
    p.add_argument("--shard-size", type=int, default=0)
    p.add_argument("--batch-size", type=int, default=None)
    args = p.parse_args()
    engine = (spotring.FSDPOptions(shard_size=args.shard_size) if args.engine == "fsdp"
              else "ddp")
    with spotring.init(engine=engine, run_dir=args.out.parent / "run", notices="none") as job:
        torch.manual_seed(job.rank)
        model = Net().double()
        model.blocks[1].gain.fill_(1.0 + job.rank)
        optimizer = torch.optim.AdamW(model.parameters(), lr=0.05, weight_decay=0.1)
        schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: (step + 1) / STEPS)
        loader = job.loader(dataset(), GLOBAL_BATCH, batch_size=args.batch_size)
        model, optimizer = job.wrap(model, optimizer)
        job.track(model=model, optimizer=optimizer, schedule=schedule, loader=loader)
        steps = 0
        for _ in loader.epochs(-(-STEPS // loader.steps_per_epoch)):
            for x, y in loader:
                with job.micro_step():
                    job.backward(((model(x).squeeze(1) - y) ** 2).mean())
                if job.step(optimizer):
                    schedule.step()
                    steps += 1
                if steps == STEPS:
                    break
        plain = job.unwrap(model)
        weights = whole(plain)
        local = sum((p.to_local() if isinstance(p, DTensor) else p).numel()
                    for p in plain.parameters())
        locals_ = job.engine.all_gather_object(local)
        stepped = ({id(p) for group in optimizer.param_groups for p in group["params"]}
                   == {id(p) for p in plain.parameters()})
        if job.is_main:
            torch.save({"weights": weights, "steps": steps, "world_size": job.world_size,
                        "engine": job.engine.name, "accumulation": loader.accumulation,
                        "local_numel": locals_, "numel": sum(w.numel() for w in weights.values()),
                        "optimizer_steps_the_model": stepped, "unwrap_is_itself": plain is model,
                        "lr": optimizer.param_groups[0]["lr"]}, args.out)


if __name__ == "__main__":
    main()
