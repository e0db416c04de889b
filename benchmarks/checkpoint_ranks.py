"""What every rank of benchmarks/checkpoint_scaling.py runs: a user's script (spotring.init,
job.wrap, job.track, job.restore, should_stop / save_and_exit) training a stack of
nn.Linear blocks with AdamW whose state (weights and AdamW's two moments, float32) is
about --gb gigabytes, on --device (auto: the local rank's GPU where there is one).

    torchrun --standalone --nproc-per-node 2 -m spotring.benchmarks.checkpoint_ranks \
        --gb 1 --run-dir DIR [--rank0] [--uri s3://bucket/prefix]         # notice mode
    torchrun ... -m spotring.benchmarks.checkpoint_ranks --gb 1 --run-dir DIR \
        --steps 17 --save-every 5                                         # periodic mode

Notice mode trains until the benchmark sends every rank SIGTERM. Each rank writes its pid
to DIR/ranks/pid-RANK, and rank 0 the steps done to DIR/ranks/steps after every step.
When should_stop() is true, each rank reads VmRSS, resets the peak (VmHWM), calls
job.save_and_exit(), and on its SystemExit writes DIR/ranks/memory-RANK.json (VmRSS before,
VmHWM during the save, the time the ranks agreed to stop), then exits 75 as
save_and_exit does. --rank0: CheckpointOptions(sharded=False).

Periodic mode trains --steps steps and saves every --save-every steps, in the background
and blocking by turns, so that both kinds meet the same machine; rank 0 writes
DIR/ranks/steps.json: each step's seconds (the save's too), its save's kind, and whether a
background save was still writing at its end.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import threading
import time
from pathlib import Path

import torch
from torch import nn

import spotring
from spotring.stores import write_atomic

WIDTH = 1024  # of every block: a 4 MiB weight, the largest tensor of the state
BATCH = 2  # rows per rank and step: the step's time is AdamW's and the allreduce's
SAFETY_STEPS = 100_000  # notice mode: a run the notice never reached ends here, failed
# The thread a background save writes in (spotring/checkpoint/manager.py names it so).
_SAVING_THREAD = "spotring-checkpoint-"


def blocks_for(gigabytes: float, width: int = WIDTH) -> int:
    """How many width x width Linear blocks make a state of about ``gigabytes`` (10^9
    bytes): each block's weight and bias, and AdamW's two moments of each, in float32."""
    per_block = 3 * 4 * (width * width + width)
    return max(1, round(gigabytes * 1e9 / per_block))


def state_bytes(blocks: int, width: int = WIDTH) -> int:
    """The bytes of the weights and AdamW's two moments of ``blocks`` blocks."""
    return blocks * 3 * 4 * (width * width + width)


def memory(field: str) -> int:
    """/proc/self/status's ``field`` (VmRSS, VmHWM) in bytes."""
    status = Path("/proc/self/status").read_text()
    return int(re.search(rf"^{field}:\s+(\d+) kB", status, re.M).group(1)) * 1024


def reset_peak() -> bool:
    """VmHWM back to VmRSS (Linux 4.0+); False where the kernel refuses."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def saving() -> bool:
    """A background save is writing (its thread is alive)."""
    return any(t.name.startswith(_SAVING_THREAD) for t in threading.enumerate())


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m spotring.benchmarks.checkpoint_ranks",
                                description=__doc__.splitlines()[0])
    p.add_argument("--gb", type=float, required=True, help="the state's size, 10^9 bytes")
    p.add_argument("--width", type=int, default=WIDTH, help=f"of every block ({WIDTH})")
    p.add_argument("--run-dir", type=Path, required=True, help="spotring.init's run_dir")
    p.add_argument("--uri", help="checkpoint.uri: s3://bucket/prefix (none: local disk only)")
    p.add_argument("--rank0", action="store_true",
                   help="CheckpointOptions(sharded=False): rank 0 alone writes")
    p.add_argument("--steps", type=int, default=0, help="periodic mode: steps to train")
    p.add_argument("--save-every", type=int, default=0, help="periodic mode: steps per save")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                   help="spotring.init's device (auto)")
    return p


def main(argv: list[str] | None = None) -> None:
    args = parser().parse_args(argv)
    ranks = args.run_dir / "ranks"
    blocks = blocks_for(args.gb, args.width)
    options = spotring.CheckpointOptions(uri=args.uri, keep=1,
                                         sharded=False if args.rank0 else None)
    with spotring.init(run_dir=args.run_dir, checkpoint=options, notices="none",
                       check_every_steps=1, device=args.device) as job:
        ranks.mkdir(parents=True, exist_ok=True)
        (ranks / f"pid-{job.rank}").write_text(str(os.getpid()))
        model = nn.Sequential(*(nn.Linear(args.width, args.width) for _ in range(blocks)))
        # fused: AdamW in one pass per tensor (the same state), so that the steps around
        # a notice are short beside the save.
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=True)
        model, optimizer = job.wrap(model, optimizer)
        job.track(model=model, optimizer=optimizer)
        job.restore()
        x = torch.randn(BATCH, args.width,
                        generator=torch.Generator().manual_seed(job.rank)).to(job.device)
        synchronize = torch.cuda.synchronize if job.device.type == "cuda" else lambda: None
        records = []
        for step in range(1, (args.steps or SAFETY_STEPS) + 1):
            started = time.perf_counter()
            loss = model(x).square().mean()
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            if job.should_stop():
                _save_and_exit(job, ranks, [r["seconds"] for r in records])
            kind = None
            if args.save_every and step % args.save_every == 0:
                kind = ("background", "blocking")[(step // args.save_every - 1) % 2]
                job.save(background=kind == "background")
            synchronize()  # the step's seconds are the device's too
            records.append({"step": step, "seconds": time.perf_counter() - started,
                            "save": kind, "in_flight": saving()})
            if job.is_main:
                write_atomic(ranks / "steps", str(step).encode())
        if not args.steps:
            raise RuntimeError(f"no notice in {SAFETY_STEPS} steps")
        job.finish()
        if job.is_main:
            write_atomic(ranks / "steps.json", json.dumps({
                "blocks": blocks, "state_bytes": state_bytes(blocks, args.width),
                "world_size": job.world_size, "save_every": args.save_every,
                "steps": records}).encode())


def _save_and_exit(job, ranks: Path, step_seconds: list[float]) -> None:
    """job.save_and_exit(), with this rank's memory around it in memory-RANK.json (and
    the seconds of the steps before)."""
    decided_at, before = time.time(), memory("VmRSS")
    reset = reset_peak()
    try:
        job.save_and_exit()
    except SystemExit as e:
        write_atomic(ranks / f"memory-{job.rank}.json", json.dumps({
            "rank": job.rank, "decided_at": decided_at, "exit": e.code,
            "rss_before": before, "hwm_during": memory("VmHWM"),
            "rss_after": memory("VmRSS"), "peak_reset": reset,
            "step_seconds": step_seconds}).encode())
        raise


if __name__ == "__main__":
    main()
