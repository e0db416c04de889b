"""Sharded checkpoints against rank 0 alone: a spot notice's save on 1, 2 and 4 workers, and
the stall of a periodic background save against a blocking one (docs/benchmarks.md,
"Sharded checkpoints against rank 0 alone").

    python -m spotring.benchmarks.checkpoint_scaling
    python -m spotring.benchmarks.checkpoint_scaling --quick    # 0.01 GB on 2 workers, 3 runs

Every run is benchmarks/checkpoint_ranks.py under torchrun. A notice cell trains, sends
SIGTERM to every rank and reads rank 0's preempted.json (its times), the manifest (the
bytes of each rank) and each rank's memory file, in both modes (``rank0``:
CheckpointOptions(sharded=False); ``sharded``, the default) back to back, the order
alternating from cell to cell; one worker is one writer and runs once. States up to
--s3-max-gb also go to a moto S3 server started on 127.0.0.1. A cell whose estimated
memory exceeds MEMORY_SHARE of the memory available is skipped and recorded so. Then one
periodic run: saves every --save-every steps, background and blocking by turns. Results:
benchmarks/results/checkpoint_scaling/ (--name); the figures and the report:
benchmarks/checkpoint_scaling_report.py. Exits 2 with a message when moto is missing.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import logging
import os
import re
import shutil
import signal
import statistics
import sys
import time
from pathlib import Path

from spotring.benchmarks import record
from spotring.benchmarks.checkpoint_ranks import WIDTH, blocks_for, state_bytes
from spotring.benchmarks.checkpoint_scaling_report import derive, render, stalls
from spotring.benchmarks.predict import positive
from spotring.benchmarks.runs import (
    drop_heavy,
    launch_command,
    shown,
    shown_dir,
    started,
    wait_for,
)
from spotring.benchmarks.suite import counts
from spotring.checkpoint import layout
from spotring.checkpoint.layout import Checkpoints
from spotring.exits import PREEMPTED

NAME = "spotring.benchmarks.checkpoint_scaling"
BUCKET = "spotring-checkpoints"
MODULE = "spotring.benchmarks.checkpoint_ranks"  # what every rank runs
MODES = ("rank0", "sharded")
START_SECONDS = 600  # for a run to reach --steps-before
STOP_SECONDS = 600  # from the signal to every rank's exit
MEMORY_SHARE = 0.6  # of MemAvailable a cell may take
OVERHEAD_BYTES = 512 * 2**20  # a rank's torch and Python, and its save's buffers
_DISTCP = re.compile(r"^__(\d+)_\d+\.distcp$")

FULL = {"sizes": [0.2, 1.0, 2.0], "workers": [1, 2, 4], "s3_max_gb": 0.2,
        "periodic_gb": 1.0, "periodic_steps": 21, "save_every": 5}
QUICK = {"sizes": [0.01], "workers": [2], "s3_max_gb": 0.2,
         "periodic_gb": 0.01, "periodic_steps": 7, "save_every": 3}


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=f"python -m {NAME}",
                                description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true",
                   help=f"a tiny version: {QUICK['sizes']} GB on {QUICK['workers']} workers")
    p.add_argument("--sizes", type=positive, nargs="+", help=f"states in GB ({FULL['sizes']})")
    p.add_argument("--workers", type=counts, nargs="+", help=f"world sizes ({FULL['workers']})")
    p.add_argument("--s3-max-gb", type=positive,
                   help=f"the largest state also saved to moto S3 ({FULL['s3_max_gb']})")
    p.add_argument("--steps-before", type=counts, default=2, help="steps before SIGTERM (2)")
    p.add_argument("--periodic-gb", type=positive, help="(d)'s state (1)")
    p.add_argument("--periodic-steps", type=int,
                   help="(d)'s steps (21; 0: no (d))")
    p.add_argument("--save-every", type=counts, help="(d)'s steps between saves (5)")
    p.add_argument("--name", default="checkpoint_scaling",
                   help="the results folder: a name under benchmarks/results, or a path")
    return p


def moto_missing(prog: str) -> bool:
    """Whether moto's S3 server, which the S3 benchmarks upload to, is missing (and say so)."""
    if importlib.util.find_spec("moto") is None:
        print(f"{prog}: needs moto's S3 server to upload to: pip install 'moto[server]' "
              "(or '.[test]')", file=sys.stderr)
        return True
    return False


def start_s3():
    """A moto S3 server on 127.0.0.1 with the bucket, and the environment that points the
    trainer's boto3 at it."""
    import boto3
    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.WARNING)  # a line per request otherwise
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    env = {"AWS_ENDPOINT_URL": f"http://{host}:{port}", "AWS_ACCESS_KEY_ID": "moto",
           "AWS_SECRET_ACCESS_KEY": "moto", "AWS_DEFAULT_REGION": "us-east-1"}
    client = boto3.client("s3", endpoint_url=env["AWS_ENDPOINT_URL"], region_name="us-east-1",
                          aws_access_key_id="moto", aws_secret_access_key="moto")
    client.create_bucket(Bucket=BUCKET)
    return server, client, env


def check_upload(client, prefix: str, note: dict) -> None:
    """The checkpoint of the stop is on S3 under ``prefix`` as preempted.json counts it:
    every part its manifest lists, each as long as the manifest says, upload_bytes in all
    (RuntimeError naming the object otherwise)."""
    step = note["step"]
    key = f"{prefix}/{layout.manifest_name(step)}"
    manifest = json.loads(client.get_object(Bucket=BUCKET, Key=key)["Body"].read())
    total = 0
    for name, part in manifest["parts"].items():
        part_key = f"{prefix}/{layout.folder_name(step)}/{name}"
        on_s3 = client.head_object(Bucket=BUCKET, Key=part_key)["ContentLength"]
        if on_s3 != part["bytes"]:
            raise RuntimeError(f"s3://{BUCKET}/{part_key}: {on_s3} bytes, its manifest "
                               f"says {part['bytes']}")
        total += on_s3
    if total != note["upload_bytes"]:
        raise RuntimeError(f"s3://{BUCKET}/{key}: {total} bytes in {len(manifest['parts'])} "
                           f"parts, preempted.json says {note['upload_bytes']}")


def settings(args: argparse.Namespace) -> dict:
    """The run's settings: --quick's or the full run's, the options given replacing them."""
    chosen = dict(QUICK if args.quick else FULL)
    for key in chosen:
        if getattr(args, key, None) is not None:
            chosen[key] = getattr(args, key)
    chosen["steps_before"] = args.steps_before
    return chosen


def available_bytes() -> int:
    text = Path("/proc/meminfo").read_text()
    return int(re.search(r"^MemAvailable:\s+(\d+) kB", text, re.M).group(1)) * 1024


def estimated_bytes(gigabytes: float, workers: int) -> int:
    """What a cell's ranks hold at most: each its weights, gradients, DDP's buckets (W > 1)
    and AdamW's two moments, its torch and its save's buffers. (On CPUs the state rank 0
    alone writes is its own tensors, not a gathered copy.)"""
    params = state_bytes(blocks_for(gigabytes)) // 3
    return workers * (params * (4 + (workers > 1)) + OVERHEAD_BYTES)


def rank_of(part: str) -> int:
    """The rank that wrote ``part`` of a checkpoint's folder: __RANK_0.distcp's RANK; the
    others (DCP's .metadata, spotring's extras) are rank 0's."""
    found = _DISTCP.match(part)
    return int(found.group(1)) if found else 0


def bytes_per_rank(manifest: dict, workers: int) -> list[int]:
    written = [0] * workers
    for name, part in manifest["parts"].items():
        written[rank_of(name)] += part["bytes"]
    return written


def _steps(ranks: Path) -> int:
    try:
        return int((ranks / "steps").read_text())
    except (OSError, ValueError):
        return 0


def notice_once(gigabytes: float, workers: int, mode: str, run_dir: Path, s3: dict | None,
                steps_before: int) -> dict:
    """One run: train, SIGTERM every rank after ``steps_before`` steps, and what it left
    (in ``run_dir``, emptied first: a pid or step file of an earlier run would be read)."""
    shutil.rmtree(run_dir, ignore_errors=True)
    uri = f"s3://{BUCKET}/{run_dir.name}" if s3 else None
    command = launch_command("torchrun", workers, [
        "--gb", str(gigabytes), "--run-dir", str(run_dir),
        *(["--uri", uri] if uri else []), *(["--rank0"] if mode == "rank0" else [])],
        module=MODULE)
    ranks = run_dir / "ranks"
    with started(command, run_dir / "output.log", **(s3["env"] if s3 else {})) as proc:
        wait_for(lambda: _steps(ranks) >= steps_before and all(
            (ranks / f"pid-{r}").exists() for r in range(workers)), proc,
            f"{run_dir.name} to step {steps_before}", START_SECONDS)
        pids = [int((ranks / f"pid-{r}").read_text()) for r in range(workers)]
        signalled = time.time()
        for pid in pids:
            os.kill(pid, signal.SIGTERM)
        proc.wait(STOP_SECONDS)
    memories = []
    for r in range(workers):
        path = ranks / f"memory-{r}.json"
        if not path.exists():
            raise RuntimeError(f"{run_dir.name}: rank {r} left no {path.name} (exit "
                               f"{proc.returncode}); see {run_dir / 'output.log'}")
        memories.append(json.loads(path.read_text()))
    note = json.loads((run_dir / PREEMPTED).read_text())
    (saved,) = Checkpoints(layout.directory_of(run_dir), keep=1).found()
    if s3:
        check_upload(s3["client"], run_dir.name, note)
        _delete_prefix(s3["client"], run_dir.name)
    drop_heavy(run_dir)
    decided = memories[0]["decided_at"]
    written = bytes_per_rank(saved.manifest, workers)
    run = {
        "gb": gigabytes, "workers": workers, "mode": mode, "s3": bool(s3),
        "command": shown(command, env={"AWS_ENDPOINT_URL": "http://127.0.0.1:PORT"} if s3
                         else None),
        "dir": shown_dir(run_dir),
        "step": note["step"], "checkpoint_bytes": saved.manifest["bytes"],
        "state_bytes": state_bytes(blocks_for(gigabytes)),
        "rank_bytes": written,
        "step_seconds": statistics.median(memories[0]["step_seconds"][1:] or
                                          memories[0]["step_seconds"]),
        "signal_to_notice": note["noticed_at"] - signalled,
        "notice_to_decided": decided - note["noticed_at"],
        "notice_to_local": note["local_saved_at"] - note["noticed_at"],
        "save_to_local": note["local_saved_at"] - decided,
        "extra_memory": [m["hwm_during"] - m["rss_before"] for m in memories],
        "rss_before": [m["rss_before"] for m in memories],
        "peak_reset": all(m["peak_reset"] for m in memories),
    }
    if s3:
        run |= {"notice_to_s3": note["saved_at"] - note["noticed_at"],
                "save_to_s3": note["saved_at"] - decided,
                "upload_seconds": note["upload_seconds"],
                "s3_phase_seconds": note["saved_at"] - note["local_saved_at"]}
    return run


def _delete_prefix(client, prefix: str) -> None:
    """Every object under ``prefix``: moto keeps them in this process's memory."""
    pages = client.get_paginator("list_objects_v2").paginate(Bucket=BUCKET, Prefix=prefix)
    for page in pages:
        for obj in page.get("Contents", []):
            client.delete_object(Bucket=BUCKET, Key=obj["Key"])


def periodic_once(gigabytes: float, run_dir: Path, steps: int, save_every: int,
                  workers: int = 2, device: str = "auto") -> dict:
    """One run of ``workers`` ranks on ``device`` saving every ``save_every`` steps to local
    disk, its saves taking turns: background, blocking, background... (``run_dir``
    emptied first). checkpoint_ranks' steps.json, and the command."""
    shutil.rmtree(run_dir, ignore_errors=True)
    command = launch_command("torchrun", workers, [
        "--gb", str(gigabytes), "--run-dir", str(run_dir), "--steps", str(steps),
        "--save-every", str(save_every), "--device", device], module=MODULE)
    with started(command, run_dir / "output.log") as proc:
        code = proc.wait(START_SECONDS + STOP_SECONDS)
    if code != 0:
        raise RuntimeError(f"exit {code}: {shown(command)}; see {run_dir / 'output.log'}")
    drop_heavy(run_dir)
    found = json.loads((run_dir / "ranks" / "steps.json").read_text())
    return {"command": shown(command),
            "dir": shown_dir(run_dir),
            **found}


def measure(args: argparse.Namespace, folder: Path) -> dict:
    chosen = settings(args)
    server, client, env = start_s3()
    cells, skipped = [], []
    try:
        order = 0
        for gigabytes in chosen["sizes"]:
            for workers in chosen["workers"]:
                # One process is one writer either way (state.py: comm ALONE): once.
                modes = MODES[:1] if workers == 1 else MODES if order % 2 == 0 \
                    else MODES[::-1]
                order += workers > 1
                for mode in modes:
                    need, have = estimated_bytes(gigabytes, workers), available_bytes()
                    name = f"{gigabytes:g}gb-w{workers}-{mode}"
                    if need > MEMORY_SHARE * have:
                        skipped.append({"gb": gigabytes, "workers": workers, "mode": mode,
                                        "estimated_bytes": need, "available_bytes": have,
                                        "why": f"needs about {need / 2**30:.1f} GiB, more "
                                               f"than {MEMORY_SHARE:.0%} of the "
                                               f"{have / 2**30:.1f} GiB available"})
                        print(f"{name}: skipped, {skipped[-1]['why']}", flush=True)
                        continue
                    s3 = ({"env": env, "client": client}
                          if gigabytes <= chosen["s3_max_gb"] else None)
                    run = notice_once(gigabytes, workers, mode, folder / "runs" / name, s3,
                                      chosen["steps_before"])
                    cells.append(run)
                    print(f"{name}: notice to local {run['notice_to_local']:.2f} s "
                          f"(save {run['save_to_local']:.2f} s)"
                          + (f", to S3 verified {run['notice_to_s3']:.2f} s" if s3 else "")
                          + f"; most bytes from one rank {max(run['rank_bytes']) / 1e6:.1f} "
                          f"MB; most extra memory {max(run['extra_memory']) / 2**20:.0f} MiB",
                          flush=True)
    finally:
        server.stop()
    periodic = None
    if chosen["periodic_steps"]:
        name = f"periodic-{chosen['periodic_gb']:g}gb-w2"
        periodic = periodic_once(chosen["periodic_gb"], folder / "runs" / name,
                                 chosen["periodic_steps"], chosen["save_every"])
        print(f"{name}: " + "; ".join(f"{kind}: stall {f['stall']:.2f} s"
                                      for kind, f in stalls(periodic).items()), flush=True)
    return {"checkpoint_scaling": {"settings": chosen, "quick": args.quick, "width": WIDTH,
                                   "cells": cells, "skipped": skipped, "periodic": periodic}}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parser().parse_args(argv)
    if moto_missing(NAME):
        return 2
    return record.run_alone(NAME, argv, args.name, "checkpoint-scaling",
                            lambda folder: measure(args, folder), derive, render)


if __name__ == "__main__":
    sys.exit(main())
