"""A user's script for sharded checkpoints: a float64 residual network of several blocks
(each its own FSDP shard under engine=fsdp) with AdamW, on a regression set whose global
batch of 12 splits over 1, 2, 3 and 4 workers, so that any run of it ends with one
uninterrupted run's weights to 1e-10 (tests/test_sharded.py).

    python train.py --engine fsdp --steps 16 --save-every 4 [--width 128 --sleep 0]
        [--vote-every N]

It restores the newest checkpoint, prints ``step N loss L`` (the loss averaged over the
ranks, on stderr, rank 0) every step, stops on a notice with exit 75, saves every
--save-every steps (in the background unless --blocking) and at the end, and rank 0 leaves
the whole model in weights.pt of the run directory.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch

from spotring.launch.commands import BIN, local_environment

SCRIPT = '''\
import argparse
import os
import sys
import time

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

import spotring

p = argparse.ArgumentParser()
p.add_argument("--engine", default="ddp")
p.add_argument("--steps", type=int, default=16)
p.add_argument("--save-every", type=int, default=4)
p.add_argument("--width", type=int, default=128)
p.add_argument("--sleep", type=float, default=0.0)
p.add_argument("--blocking", action="store_true")
p.add_argument("--vote-every", type=int)  # default: spotring's own interval
args = p.parse_args()


class Block(nn.Module):
    def __init__(self, width):
        super().__init__()
        self.fc = nn.Linear(width, width, dtype=torch.float64)

    def forward(self, x):
        return x + torch.tanh(self.fc(x))


class Net(nn.Module):
    def __init__(self, width, blocks=3):
        super().__init__()
        self.inp = nn.Linear(8, width, dtype=torch.float64)
        self.blocks = nn.ModuleList(Block(width) for _ in range(blocks))
        self.out = nn.Linear(width, 1, dtype=torch.float64)

    def forward(self, x):
        x = self.inp(x)
        for block in self.blocks:
            x = block(x)
        return self.out(x).squeeze(1)


g = torch.Generator().manual_seed(0)
x = torch.randn(96, 8, generator=g, dtype=torch.float64)
y = torch.sin(x.sum(1)) + 0.1 * torch.randn(96, generator=g, dtype=torch.float64)
data = torch.utils.data.TensorDataset(x, y)

with spotring.init(engine=args.engine, seed=0, check_every_steps=args.vote_every) as job:
    model = Net(args.width)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    loader = job.loader(data, 12)
    model, optimizer = job.wrap(model, optimizer)
    job.track(model=model, optimizer=optimizer, loader=loader)
    print(f"rank {job.rank} pid {os.getpid()}", file=sys.stderr, flush=True)
    job.restore()
    for epoch in loader.epochs(-(-args.steps // 8)):
        for xb, yb in loader:
            loss = ((model(xb) - yb) ** 2).mean()
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            mean = job.all_reduce(loss.detach()).item()
            if job.is_main:
                print(f"step {job.step_count} loss {mean!r}", file=sys.stderr, flush=True)
            time.sleep(args.sleep)
            if job.should_stop():
                job.save_and_exit()
            if job.step_count % args.save_every == 0 and job.step_count < args.steps:
                job.save(background=not args.blocking)
            if job.step_count == args.steps:
                break
        if job.step_count == args.steps:
            break
    job.save(background=False)
    whole = get_model_state_dict(job.unwrap(model), options=StateDictOptions(
        full_state_dict=True, cpu_offload=True))
    if job.is_main:
        torch.save(whole, job.run_dir / "weights.pt")
    job.finish()
'''


def write(project: Path) -> Path:
    project.mkdir(parents=True, exist_ok=True)
    (project / "train.py").write_text(SCRIPT)
    return project


def command(project: Path, workers: int, *args: str) -> list[str]:
    """``workers`` ranks of the script (one process alone for 1), as a user starts it."""
    script = [str(project / "train.py"), *args]
    if workers == 1:
        return [sys.executable, *script]
    return [str(BIN / "torchrun"), "--standalone", "--nproc-per-node", str(workers), *script]


def environment(run_dir: Path, **extra: str) -> dict[str, str]:
    return local_environment(SPOTRING_RUN_DIR=str(run_dir), **extra)


def run(project: Path, run_dir: Path, workers: int, *args: str, expect: int = 0,
        timeout: float = 300, **env: str) -> str:
    """Run the script to its end; its output (stdout and stderr)."""
    proc = subprocess.run(command(project, workers, *args), cwd=project, text=True,
                          capture_output=True, timeout=timeout,
                          env=environment(run_dir, **env))
    output = proc.stdout + proc.stderr
    assert proc.returncode == expect, output[-5000:]
    return output


def losses(output: str) -> dict[int, float]:
    """Each step's loss as the run printed it (the same samples give the same loss)."""
    return {int(line.split()[1]): float(line.split()[3]) for line in output.splitlines()
            if line.startswith("step ")}


def weights(run_dir: Path) -> dict[str, torch.Tensor]:
    return torch.load(run_dir / "weights.pt", weights_only=True)


class Started:
    """The script running in a session of its own, its output in a file; every process
    of it ends with the ``with`` (killed if need be)."""

    def __init__(self, project: Path, run_dir: Path, workers: int, *args: str,
                 **env: str) -> None:
        run_dir.mkdir(parents=True, exist_ok=True)
        self.log = run_dir.parent / f"{run_dir.name}.log"
        with open(self.log, "w") as out:
            self.proc = subprocess.Popen(
                command(project, workers, *args), cwd=project, stdout=out,
                stderr=subprocess.STDOUT, env=environment(run_dir, **env),
                start_new_session=True)

    def __enter__(self) -> Started:
        return self

    def __exit__(self, *exc) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=30)

    def output(self) -> str:
        return self.log.read_text()

    def pids(self) -> list[int]:
        """Each rank's process id, by rank, once every rank printed it."""
        found = dict(re.findall(r"^rank (\d+) pid (\d+)$", self.output(), re.M))
        return [int(found[r]) for r in sorted(found, key=int)]

    def step(self) -> int:
        return max(losses(self.output()), default=0)

    def until(self, done, what: str, timeout: float = 300) -> bool:
        """Poll ``done()`` until true (True), or until the run ended (False); fail naming
        ``what`` after ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        while not done():
            if self.proc.poll() is not None:
                return False
            assert time.monotonic() < deadline, f"no {what} in {timeout} s"
            time.sleep(0.02)
        return True

    def wait(self, timeout: float = 300) -> int:
        return self.proc.wait(timeout=timeout)
