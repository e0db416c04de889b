"""A user's training script as a function, for ranks spawned by harness/ranks.py: the
library API around a float64 residual network of several blocks (each its own FSDP shard
under engine=fsdp) with AdamW, on a regression set whose global batch of 12 splits over
1, 2, 3 and 4 workers, so that any run of it, stopped and resumed anywhere, ends with
one uninterrupted run's weights to 1e-10 (float64: see tests/test_equivalence.py).

It restores the newest checkpoint, prints ``step N loss L`` (the loss averaged over the
ranks, rank 0) every step, stops on a notice with exit 75, saves every ``save_every``
steps (in the background unless ``blocking``) and at the end, and rank 0 leaves the whole
model in weights.pt of the run directory.
"""

from __future__ import annotations

import time

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

import spotring

GLOBAL_BATCH, SAMPLES = 12, 96
STEPS_PER_EPOCH = SAMPLES // GLOBAL_BATCH
_GO = "go"  # the file that lets a held run go on
_HELD = "held"  # the file a run held at its hold_at step makes


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.fc = nn.Linear(width, width, dtype=torch.float64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.fc(x))


class Net(nn.Module):
    def __init__(self, width: int, blocks: int = 3) -> None:
        super().__init__()
        self.inp = nn.Linear(8, width, dtype=torch.float64)
        self.blocks = nn.ModuleList(Block(width) for _ in range(blocks))
        self.out = nn.Linear(width, 1, dtype=torch.float64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for block in self.blocks:
            x = block(x)
        return self.out(x).squeeze(1)


def data() -> torch.utils.data.TensorDataset:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(SAMPLES, 8, generator=g, dtype=torch.float64)
    y = torch.sin(x.sum(1)) + 0.1 * torch.randn(SAMPLES, generator=g, dtype=torch.float64)
    return torch.utils.data.TensorDataset(x, y)


def residual(engine: str = "ddp", steps: int = 16, save_every: int = 4, width: int = 128,
             sleep: float = 0.0, blocking: bool = False, vote_every: int | None = None,
             notices: str | None = None, poll_seconds: float | None = None,
             timeout_s: float | None = None, hold_at: int | None = None) -> None:
    """Train ``steps`` steps under ``engine`` (see the module docstring); ``sleep``
    seconds after each step, the ranks voting on a stop every ``vote_every`` steps
    (None: spotring's own interval), spot notices from ``notices`` polled every
    ``poll_seconds`` (None: spotring's default), collectives timing out after
    ``timeout_s``. ``hold_at``: rank 0
    waits after printing that step until the test lets it go on (``release``), and the
    other ranks with it, in their next collective."""
    preemption = spotring.PreemptionOptions(**(
        {} if poll_seconds is None else {"poll_seconds": poll_seconds}))
    with spotring.init(engine=engine, seed=0, check_every_steps=vote_every, notices=notices,
                       preemption=preemption, timeout_s=timeout_s) as job:
        model, optimizer, loader = _started(job, width)
        for _ in loader.epochs(-(-steps // STEPS_PER_EPOCH)):
            # None left where the run resumed from a stop at its last step.
            for xb, yb in loader if job.step_count < steps else ():
                mean = _trained(job, model, optimizer, xb, yb)
                if job.is_main:
                    print(f"step {job.step_count} loss {mean!r}", flush=True)
                    if job.step_count == hold_at:
                        _held(job.run_dir)
                time.sleep(sleep)
                if job.should_stop():
                    job.save_and_exit()
                if job.step_count % save_every == 0 and job.step_count < steps:
                    job.save(background=not blocking)
                if job.step_count >= steps:
                    break
            if job.step_count >= steps:
                break
        _ended(job, model)


def in_place(steps: int = 16, min_workers: int = 1, sleep: float = 0.05,
             timeout_s: float = 30, hold_at: int | None = None, shard_size: int = 0) -> None:
    """``residual``'s training in a job in place (spotring/elastic/, the rendezvous from
    $SPOTRING_RENDEZVOUS): the ranks vote at every step, a SIGTERM makes its rank leave
    and the others go on, a lost rank's step is taken again; a checkpoint every other
    step, after should_stop (a collective a process joining there does not make). Rank 0
    (whichever process it is at the time) leaves the whole model in weights.pt at the
    end, and every rank prints ``step N loss L`` for each step that stood: not one taken
    again (its collectives failed: its loss is this rank's own, and the step counts once
    more). Every rank: a rank 0 that is lost takes its last line with it. ``hold_at``:
    rank 0 waits after that step's update, before the loss is averaged (the others wait
    in that collective), until the test releases it. ``shard_size``: HSDP, FSDP within
    groups of that many ranks (0: DDP)."""
    engine = spotring.FSDPOptions(shard_size=shard_size) if shard_size else "ddp"
    with spotring.init(engine=engine, seed=0, in_place="auto", min_workers=min_workers,
                       check_every_steps=1, notices="none", timeout_s=timeout_s) as job:
        model, optimizer, loader = _started(job, 128)
        for _ in loader.epochs(-(-steps // loader.steps_per_epoch)):
            for xb, yb in loader if job.step_count < steps else ():
                mean = _trained(job, model, optimizer, xb, yb,
                                held=job.is_main and job.step_count == hold_at)
                step, stood = job.step_count, job.engine.failure is None
                time.sleep(sleep)
                if job.should_stop():
                    job.save_and_exit()
                if job.step_count % 2 == 0:
                    job.save()
                if stood:
                    print(f"step {step} loss {mean!r}", flush=True)
                if job.step_count >= steps:
                    break
            if job.step_count >= steps:
                break
        _ended(job, model)


def _started(job: spotring.Job, width: int) -> tuple[nn.Module, torch.optim.Optimizer,
                                                       spotring.DataLoader]:
    """The model, its optimizer and the loader, wrapped, tracked and restored."""
    model = Net(width)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    loader = job.loader(data(), GLOBAL_BATCH)
    model, optimizer = job.wrap(model, optimizer)
    job.track(model=model, optimizer=optimizer, loader=loader)
    job.restore()
    return model, optimizer, loader


def _trained(job: spotring.Job, model: nn.Module, optimizer: torch.optim.Optimizer,
             xb: torch.Tensor, yb: torch.Tensor, held: bool = False) -> float:
    """One step on this rank's batch; the loss averaged over the ranks. ``held``: this
    rank waits after the update, before the loss's collective, until ``release``."""
    loss = ((model(xb) - yb) ** 2).mean()
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    if held:
        _held(job.run_dir)
    return job.all_reduce(loss.detach()).item()


def _ended(job: spotring.Job, model: nn.Module) -> None:
    """The last checkpoint, rank 0's weights.pt of the whole model, the summary."""
    job.save(background=False)
    whole = get_model_state_dict(job.unwrap(model), options=StateDictOptions(
        full_state_dict=True, cpu_offload=True))
    if job.is_main:
        torch.save(whole, job.run_dir / "weights.pt")
    job.finish()


def _held(run_dir) -> None:
    (run_dir / _HELD).touch()
    while not (run_dir / _GO).exists():
        time.sleep(0.01)


def held(run_dir) -> bool:
    """Whether a run waits at its ``hold_at`` step (until ``release``)."""
    return (run_dir / _HELD).exists()


def release(run_dir) -> None:
    """Let a run held at its ``hold_at`` step go on."""
    (run_dir / _GO).touch()


def weights(run_dir) -> dict[str, torch.Tensor]:
    """The whole model a run of ``residual`` ended with."""
    return torch.load(run_dir / "weights.pt", weights_only=True)
