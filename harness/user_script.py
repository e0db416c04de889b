"""A user's own training script, as the launcher, SLURM and sweep tests write it into an
otherwise empty project directory: the library API (`import spotring`) around a float64
least-squares model, so that N workers end with one worker's parameters to 1e-10.

    python train.py --steps 40 --lr 0.1 --batch 8 --sleep 0 --save-every 10 [--poll-seconds S]
                    [--pause-file PATH]

It checkpoints every --save-every steps, stops on a spot notice (its cloud's metadata
service watched, asked every --poll-seconds where it answers at once) or SIGTERM with
exit 75, resumes from its newest checkpoint (one of its last step: it trains no more),
logs a train record every step and a test record at every epoch end (what `spotring
sweep` prunes on), and ends with summary.json holding ``test_loss`` and ``weights``.
Each step ends waiting while --pause-file exists: a test holds the job between two
steps with it until an event of its own (a replacement's start) has come.
``PLAIN`` is a script that does not use the library.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from harness.cores import cores

TRAIN_PY = '''\
import argparse
import time
from pathlib import Path

import torch

import spotring

p = argparse.ArgumentParser()
p.add_argument("--steps", type=int, default=40)
p.add_argument("--lr", type=float, default=0.1)
p.add_argument("--batch", type=int, default=8)
p.add_argument("--sleep", type=float, default=0.0)
p.add_argument("--save-every", type=int, default=10)
p.add_argument("--poll-seconds", type=float, default=0.5)  # spotring's default
p.add_argument("--pause-file", type=Path)
args = p.parse_args()

g = torch.Generator().manual_seed(0)
x = torch.randn(64, 4, generator=g, dtype=torch.float64)
w = torch.tensor([1.0, -2.0, 3.0, 0.5], dtype=torch.float64)
y = x @ w + 0.1 * torch.randn(64, generator=g, dtype=torch.float64)
data = torch.utils.data.TensorDataset(x, y)


@torch.no_grad()
def test_loss(model):
    return ((model(x).squeeze(1) - y) ** 2).mean().item()


notices = spotring.PreemptionOptions(poll_seconds=args.poll_seconds)
with spotring.init(seed=0, preemption=notices) as job:
    model = torch.nn.Linear(4, 1, dtype=torch.float64)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    loader = job.loader(data, args.batch)
    model, optimizer = job.wrap(model, optimizer)
    job.track(model=model, optimizer=optimizer, loader=loader)
    job.restore()
    epochs = -(-args.steps // loader.steps_per_epoch)
    for epoch in loader.epochs(epochs):
        # None left where a stop came at the last step, and saved it: the checkpoint this
        # run resumed from. (A batch taken from the loader would count as a step.)
        for xb, yb in loader if job.step_count < args.steps else ():
            loss = ((model(xb).squeeze(1) - yb) ** 2).mean()
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            job.log("train", loss=loss.item())
            if job.should_stop():
                job.save_and_exit()
            if job.step_count % args.save_every == 0:
                job.save()
            time.sleep(args.sleep)
            while args.pause_file and args.pause_file.exists():
                time.sleep(0.05)
            if job.step_count >= args.steps:
                break
        job.log("test", loss=test_loss(model))
        if job.step_count >= args.steps:
            break
    plain = job.unwrap(model)
    weights = [*plain.weight.detach().flatten().tolist(), *plain.bias.detach().tolist()]
    loss = test_loss(model)  # a run resumed at its last step trains no epoch
    print(f"trained {job.step_count} steps on {job.world_size} workers: test loss {loss}")
    job.finish(test_loss=loss, weights=weights)
'''

PLAIN = '''\
import socket
import sys
from pathlib import Path

print(f"hello from {socket.gethostname()}: {' '.join(sys.argv[1:])}")
Path("out").mkdir(exist_ok=True)
Path("out/result.txt").write_text("made on the node\\n")
'''


def write_project(root: Path, **files: str) -> Path:
    """``root`` holding train.py and any other ``files`` (name -> text)."""
    root.mkdir(parents=True, exist_ok=True)
    (root / "train.py").write_text(TRAIN_PY)
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    return root


def reference(tmp: Path, *args: str) -> dict:
    """summary.json of the script run alone, uninterrupted, with ``args``."""
    project = write_project(tmp)
    out = tmp / "reference"
    with cores(1):
        proc = subprocess.run([sys.executable, "train.py", *args], cwd=project, text=True,
                              capture_output=True, env={"SPOTRING_RUN_DIR": str(out),
                                                        "PATH": "/usr/bin:/bin"}, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads((out / "summary.json").read_text())
