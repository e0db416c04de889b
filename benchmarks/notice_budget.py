"""The notice budget: from a spot notice to a checkpoint verified on S3, against EC2's 120 s
(docs/benchmarks.md, "The notice budget").

    python -m spotring.benchmarks.notice_budget        # 0.2 GB, 3 repeats, a few minutes
    python -m spotring.benchmarks.notice_budget --gb 1 --repeats 1 --name try

Each repeat is one worker of benchmarks/checkpoint_ranks.py (a user's script; its state
--gb GB, by default about ResNet-50's weights with SGD's momentum) checkpointing to a moto
S3 server started on 127.0.0.1, stopped by SIGTERM after a few steps, the upload checked
part by part against the manifest (checkpoint_scaling.notice_once): FIGURES, each the mean
over the repeats with its 95% interval. Results: benchmarks/results/notice_budget/
(--name). Exits 2 with a message when moto is missing.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from spotring.benchmarks import record
from spotring.benchmarks.checkpoint_scaling import moto_missing, notice_once, start_s3
from spotring.benchmarks.predict import positive
from spotring.benchmarks.report import header, spread, table
from spotring.benchmarks.stats import mean_ci
from spotring.benchmarks.suite import counts
from spotring.preemption import NOTICE_SECONDS

MODULE = "spotring.benchmarks.notice_budget"
FIGURES = ("signal_to_notice", "notice_to_local", "notice_to_s3", "upload_mb_s", "margin")


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=f"python -m {MODULE}",
                                description=__doc__.splitlines()[0])
    p.add_argument("--gb", type=positive, default=0.2, help="the state's size, 10^9 bytes (0.2)")
    p.add_argument("--repeats", type=counts, default=3, help="runs, each stopped once (3)")
    p.add_argument("--steps", type=counts, default=3,
                   help="training steps before the signal: past the first, slower ones (3)")
    p.add_argument("--name", default="notice_budget",
                   help="the results folder: a name under benchmarks/results, or a path")
    return p


def measure(args: argparse.Namespace, folder: Path) -> dict:
    server, client, env = start_s3()
    try:
        runs = []
        for i in range(args.repeats):
            r = notice_once(args.gb, 1, "sharded", folder / "runs" / f"run{i}",
                            {"env": env, "client": client}, args.steps)
            r |= {"upload_mb_s": r["checkpoint_bytes"] / 1e6 / r["upload_seconds"],
                  "margin": NOTICE_SECONDS - r["notice_to_s3"]}
            runs.append(r)
            print(f"run {i}: {r['checkpoint_bytes'] / 1e6:.1f} MB checkpoint; notice to "
                  f"local {r['notice_to_local']:.2f} s, to S3 verified {r['notice_to_s3']:.2f} s "
                  f"({r['upload_mb_s']:.1f} MB/s): {r['margin']:.2f} s left of "
                  f"{NOTICE_SECONDS} s", flush=True)
    finally:
        server.stop()
    return {"notice_budget": {"gb": args.gb, "notice_seconds": NOTICE_SECONDS, "runs": runs}}


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
        f"## Notice budget: a {section['gb']:g} GB state, one worker, moto S3 on 127.0.0.1",
        table(["", "mean ± 95%", *(f"run {i}" for i in range(len(runs)))], rows),
        "Notice to local includes the step in progress and the next one (the ranks' vote "
        "is read a step late), then writing the parts and reading them back. moto holds S3 "
        "in memory: the MB/s is spotring's upload path without a network. The method: "
        "`benchmarks/notice_budget.py`; every run's command, log and preempted.json are in "
        "`results.json` and `runs/`.",
        "```sh\n" + "\n".join(dict.fromkeys(r["command"] for r in runs)) + "\n```",
    ])
    return record.write_report(folder, body)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parser().parse_args(argv)
    if moto_missing(MODULE):
        return 2
    return record.run_alone(MODULE, argv, args.name, "notice-budget",
                            lambda folder: measure(args, folder), derive, render)


if __name__ == "__main__":
    sys.exit(main())
