"""The notice budget: from a spot notice to a checkpoint verified on S3, against EC2's 120 s.

    python -m spotring.benchmarks.notice_budget        # ResNet-50, 3 repeats, a few minutes
    python -m spotring.benchmarks.notice_budget --arch resnet18 --repeats 1 --name try

Each repeat trains `model=torchvision model.arch=ARCH` (1000 classes: ResNet-50's
weights are 102 MB in float32, and SGD's momentum doubles the checkpoint) as one worker
on synthetic 3x32x32 images, whose size changes the steps but not the checkpoint, with
checkpoint.uri on a moto S3 server that this benchmark starts on 127.0.0.1 (moto is in
the test extra: pip install '.[test]'). After a few steps it sends the trainer SIGTERM,
the signal EC2 ends a spot instance with and the trainer's notice of last resort, and
reads rank 0's preempted.json (spotring/preemption.py, notice_budget), checking that S3
holds every part of the checkpoint as its manifest lists it:

    signal to notice     SIGTERM sent -> the trainer's handler ran (noticed_at)
    notice to local      noticed_at -> the checkpoint complete in checkpoint.dir: the step
                         in progress and the next (the ranks' vote), writing its parts
                         and reading them back
    notice to S3         noticed_at -> every part on S3, its size checked, and the
                         manifest written and read back (saved_at)
    upload               the checkpoint's bytes (all parts) / the S3 store's seconds, in MB/s
    margin               EC2's 120 s - notice to S3

Every figure is the mean over the repeats with its 95% interval (benchmarks/stats.py).
moto keeps S3 in this machine's memory, so the MB/s is the trainer's own upload path
(each part's multipart upload in 16 MB chunks, its size check, the manifest) without a
network; on EC2 the instance's bandwidth to S3 takes its place. Results:
benchmarks/results/notice_budget/ (--name): results.json, report.md, and runs/ (each
run's log, metrics and preempted.json). Exits 2 with a message when moto is missing.
"""

from __future__ import annotations

import argparse
import json
import logging
import signal
import sys
import time
from pathlib import Path

from spotring import checkpoint
from spotring.benchmarks import record
from spotring.benchmarks.report import header, spread, table
from spotring.benchmarks.runs import REPO, shown, started, trainer_records, until_step
from spotring.benchmarks.stats import mean_ci
from spotring.benchmarks.suite import counts
from spotring.exits import EXIT_PREEMPTED, PREEMPTED
from spotring.launch.commands import local_command
from spotring.preemption import NOTICE_SECONDS
from spotring.stores import write_atomic

BUCKET = "spotring-notice-budget"
# Long enough for every run to be stopped by the signal, never by its end or an epoch's
# end (an evaluation and a checkpoint of their own).
STEPS = 10_000
START_SECONDS = 600  # for a run to reach the steps before the signal
STOP_SECONDS = 300  # from the signal to the trainer's exit
FIGURES = ("signal_to_notice", "notice_to_local", "notice_to_s3", "upload_mb_s", "margin")


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m spotring.benchmarks.notice_budget",
                                description=__doc__.splitlines()[0])
    p.add_argument("--arch", default="resnet50", help="a torchvision classifier (resnet50)")
    p.add_argument("--repeats", type=counts, default=3, help="runs, each stopped once (3)")
    p.add_argument("--steps", type=counts, default=3,
                   help="training steps before the signal: past the first, slower ones (3)")
    p.add_argument("--batch", type=counts, default=8, help="images per step (8)")
    p.add_argument("--name", default="notice_budget",
                   help="the results folder: a name under benchmarks/results, or a path")
    return p


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


def stop_once(args: argparse.Namespace, run_dir: Path, env: dict[str, str],
              client) -> dict:
    """One run: train, SIGTERM after args.steps steps, and what its preempted.json says."""
    uri = f"s3://{BUCKET}/{run_dir.name}"
    command = local_command("single", 1, [
        f"hydra.run.dir={run_dir}", "telemetry.progress=false", "telemetry.log_every=1",
        "model=torchvision", f"model.arch={args.arch}", "dataset=synthetic",
        "dataset.shape=[3,32,32]", "dataset.num_classes=1000",
        f"dataset.train_size={args.batch * STEPS}", "dataset.test_size=64",
        f"train.batch_size={args.batch}", f"checkpoint.uri={uri}", "preemption.notices=none"])
    with started(command, run_dir / "output.log", **env) as proc:
        until_step(proc, run_dir, args.steps, START_SECONDS)
        signalled = time.time()
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(STOP_SECONDS)
    if code != EXIT_PREEMPTED:
        raise RuntimeError(f"{shown(command)} exited {code} after SIGTERM, not "
                           f"{EXIT_PREEMPTED}; see {run_dir}/output.log")
    note = json.loads((run_dir / PREEMPTED).read_text())
    check_upload(client, run_dir.name, note)
    last = trainer_records(run_dir, "train")[-1]  # and the checkpoints deleted: 200 MB each
    to_s3 = note["saved_at"] - note["noticed_at"]
    return {
        "command": shown(command, env={"AWS_ENDPOINT_URL": "http://127.0.0.1:PORT"}),
        "dir": str(run_dir.relative_to(REPO) if run_dir.is_relative_to(REPO) else run_dir),
        "step": note["step"],
        "checkpoint_bytes": note["upload_bytes"],
        "step_seconds": args.batch / last["images_per_second"],  # the last before the stop
        "signal_to_notice": note["noticed_at"] - signalled,
        "notice_to_local": note["local_saved_at"] - note["noticed_at"],
        "notice_to_s3": to_s3,
        "upload_seconds": note["upload_seconds"],
        "upload_mb_s": note["upload_bytes"] / 1e6 / note["upload_seconds"],
        "margin": NOTICE_SECONDS - to_s3,
    }


def check_upload(client, prefix: str, note: dict) -> None:
    """The checkpoint of the stop is on S3 under ``prefix`` as preempted.json counts it:
    every part its manifest lists, each as long as the manifest says, upload_bytes in all
    (RuntimeError naming the object otherwise)."""
    step = note["step"]
    key = f"{prefix}/{checkpoint.manifest_name(step)}"
    manifest = json.loads(client.get_object(Bucket=BUCKET, Key=key)["Body"].read())
    total = 0
    for name, part in manifest["parts"].items():
        part_key = f"{prefix}/{checkpoint.folder_name(step)}/{name}"
        on_s3 = client.head_object(Bucket=BUCKET, Key=part_key)["ContentLength"]
        if on_s3 != part["bytes"]:
            raise RuntimeError(f"s3://{BUCKET}/{part_key}: {on_s3} bytes, its manifest "
                               f"says {part['bytes']}")
        total += on_s3
    if total != note["upload_bytes"]:
        raise RuntimeError(f"s3://{BUCKET}/{key}: {total} bytes in {len(manifest['parts'])} "
                           f"parts, preempted.json says {note['upload_bytes']}")


def measure(args: argparse.Namespace, folder: Path) -> dict:
    server, client, env = start_s3()
    try:
        runs = []
        for i in range(args.repeats):
            runs.append(stop_once(args, folder / "runs" / f"run{i}", env, client))
            r = runs[-1]
            print(f"run {i}: {r['checkpoint_bytes'] / 1e6:.1f} MB checkpoint; notice to "
                  f"local {r['notice_to_local']:.2f} s, to S3 verified {r['notice_to_s3']:.2f} s "
                  f"({r['upload_mb_s']:.1f} MB/s): {r['margin']:.2f} s left of "
                  f"{NOTICE_SECONDS} s", flush=True)
    finally:
        server.stop()
    return {"notice_budget": {"arch": args.arch, "notice_seconds": NOTICE_SECONDS,
                              "runs": runs}}


def derive(results: dict) -> dict:
    section = results["notice_budget"]
    section["summary"] = {f: mean_ci([r[f] for r in section["runs"]]) for f in FIGURES}
    return results


def render(folder: Path, results: dict) -> Path:
    """report.md: the machine, then each figure's mean ± 95% interval and every run's."""
    section = results["notice_budget"]
    runs, summary = section["runs"], section["summary"]
    labels = {"signal_to_notice": "SIGTERM sent to noticed (s)",
              "notice_to_local": "notice to local checkpoint (s)",
              "notice_to_s3": "notice to verified on S3 (s)",
              "upload_mb_s": "S3 upload (MB/s)",
              "margin": f"margin of EC2's {section['notice_seconds']} s (s)"}
    rows = [[labels[f], spread(summary[f], 2), *(f"{r[f]:.2f}" for r in runs)]
            for f in FIGURES]
    rows.append(["checkpoint (MB)", f"{runs[0]['checkpoint_bytes'] / 1e6:.1f}",
                 *(f"{r['checkpoint_bytes'] / 1e6:.1f}" for r in runs)])
    rows.append(["a training step (s)", "-", *(f"{r['step_seconds']:.2f}" for r in runs)])
    body = "\n\n".join([
        header(folder, results),
        f"## Notice budget: {section['arch']}, one CPU worker, moto S3 on 127.0.0.1",
        table(["", "mean ± 95%", *(f"run {i}" for i in range(len(runs)))], rows),
        "Notice to local includes the step in progress and the next one (the ranks' vote "
        "is read a step late), then writing the parts and reading them back. moto holds S3 "
        "in memory: the MB/s is the trainer's upload path without a network. The method: "
        "`benchmarks/notice_budget.py`; every run's command, log and preempted.json are in "
        "`results.json` and `runs/`.",
        "```sh\n" + "\n".join(dict.fromkeys(r["command"] for r in runs)) + "\n```",
    ])
    path = folder / "report.md"
    write_atomic(path, (body + "\n").encode())
    return path


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parser().parse_args(argv)
    try:
        import moto.server  # noqa: F401
    except ImportError:
        print("python -m spotring.benchmarks.notice_budget: needs moto's S3 server to upload to: "
              "pip install 'moto[server]' (or '.[test]')", file=sys.stderr)
        return 2
    command = record.command_line("spotring.benchmarks.notice_budget",
                                  "python -m spotring.benchmarks.notice_budget", argv)
    folder = record.write(args.name, "notice-budget", command,
                          lambda folder: measure(args, folder), derive)
    print(f"written: {render(folder, record.load(folder))}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
