"""Render a bench run's results.json as report.md and its PNG plots, in the same folder.

    spotring report                 # the newest run under the results folder
    spotring report reference       # benchmarks/results/reference/
    spotring report PATH/TO/RUN

(`make report [RUN=...]` and `python -m spotring.benchmarks.report` run the same.) Every number in
report.md is read from results.json and only formatted (the benchmark modules compute;
tests/test_bench_report.py parses both and compares); a section is there only where
results.json has it, so a run of some sections (`spotring bench --only ...`) renders too.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from spotring.benchmarks import plots, record
from spotring.benchmarks.allreduce import size_label
from spotring.stores import write_atomic

DASH = "-"


def spread(stats: dict | None, digits: int = 0, scale: float = 1, unit: str = "") -> str:
    """mean ± 95% half-width."""
    if stats is None:
        return DASH
    mean, half = scale * stats["mean"], scale * stats["ci95"]
    return f"{mean:.{digits}f}{unit} ± {half:.{digits}f}{unit}"


def signed(x: float) -> str:
    return f"{100 * x:+.1f}%"


def table(headers: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + " --- |" * len(headers)]
    return "\n".join(lines + ["| " + " | ".join(row) + " |" for row in rows])


def commands(lines: list[str]) -> str:
    body = "\n".join(dict.fromkeys(lines))
    return f"<details><summary>exact commands</summary>\n\n```sh\n{body}\n```\n</details>"


def header(folder: Path, r: dict) -> str:
    m = r["machine"]
    packages = ", ".join(f"{k} {v}" for k, v in m["packages"].items() if v)
    return "\n\n".join([
        f"# Benchmarks: {folder.name}",
        f"`{r['command']}`, started {r['started']}, {r['wall_seconds']:.0f} s"
        f"{', quick' if r.get('quick') else ''}. Load average (1, 5, 15 min) "
        f"{m['load_average']} at the start, {m['load_average_end']} at the end (above "
        f"{m['cores']}, the number of cores, other work shared the machine).",
        "## Machine",
        table(["", ""], [
            ["CPU", f"{m['cpu']}, {m['cores']} cores, {m['memory_gib']} GiB"],
            ["GPUs", ", ".join(m["gpus"]) or "none"],
            ["OS", m["os"]],
            ["Python", f"{m['python']}; {packages}"],
            ["MPI", m["mpi"] or "none"],
            ["NCCL", m["nccl"] or "none"],
            ["commit", m["commit"]],
        ]),
    ])


def throughput(r: dict) -> str:
    t = r["throughput"]
    timing = t["timing"]
    rows = [[row["engine"], str(row["workers"]), str(row["batch"]), spread(row["per_worker"]),
             spread(row["total"]), spread(row.get("speedup"), 2),
             spread(row.get("efficiency"), 1, 100, "%"), f"{row['step_ms']:.1f}"]
            for row in sorted(t["rows"], key=lambda x: (x["batch"], x["workers"]))]
    return "\n\n".join([
        "## Throughput",
        f"{t['workload']}; {timing['warmup_steps']} warm-up steps, then {timing['intervals']} "
        f"intervals of {timing['log_every']} steps per run; {t['repeats']} interleaved "
        f"repeat(s); {t['rows'][0]['threads']} thread(s) per worker. img/s: mean ± the half-"
        "width of its 95% confidence interval over all measured intervals; speedup and "
        "efficiency against one worker of the same program (the trainer, or the plain loop) "
        "at the same batch per worker.",
        table(["engine", "workers", "batch / worker", "img/s per worker", "img/s total",
               "speedup", "efficiency", "step ms"], rows),
        "![img/s against workers](throughput.png)"
        + ("\n![efficiency](efficiency.png)" if any("efficiency" in x for x in t["rows"])
           else ""),
        commands([run["command"] for run in t["runs"]]),
    ])


def allreduce(r: dict) -> str:
    a = r["allreduce"]
    names = list(a["transports"])
    sizes = sorted({row["bytes"] for rows in a["transports"].values() for row in rows})
    gradient = r.get("throughput", {}).get("gradient_bytes")

    def cells(key: str) -> list[list[str]]:
        out = []
        for n in sizes:
            by = {t: next((x for x in a["transports"][t] if x["bytes"] == n), None) for t in names}
            out.append([size_label(n) + (" (gradient)" if n == gradient else "")]
                       + [f"{by[t][key]:.3g}" if by[t] else DASH for t in names])
        return out

    return "\n\n".join([
        "## Allreduce",
        f"{a['ranks']} ranks, float32 sum in place; median of {a['repeats']} repeat(s), each "
        f"the median of {a['loops']} timed loops sharing about {a['budget_seconds']} s of calls "
        "per size. algbw = size / time, busbw = algbw x 2(n-1)/n (nccl-tests), in GB/s "
        "(10^9 bytes).",
        "Bus bandwidth, GB/s:\n\n" + table(["size", *names], cells("busbw_gbps")),
        "Algorithm bandwidth, GB/s:\n\n" + table(["size", *names], cells("algbw_gbps")),
        "![busbw against size](allreduce.png)",
        commands(list(a["commands"].values())),
    ])


def batch_sizes(r: dict) -> str:
    b = r["batch_sizes"]
    batches = sorted({row["batch"] for row in b["rows"]})
    rows = []
    for model, shape in dict.fromkeys((row["model"], row["shape"]) for row in b["rows"]):
        by = {row["batch"]: row for row in b["rows"] if row["model"] == model}
        rows.append([model, shape] + [spread(by[n]["images_per_second"]) if n in by else DASH
                                      for n in batches])
    return "\n\n".join([
        "## Batch sizes",
        f"img/s (mean ± 95% confidence half-width) of one worker with {b['threads']} threads, "
        "synthetic data, per model and batch size, as in the Chameleon Cloud talk's table.",
        table(["model", "input", *map(str, batches)], rows),
        "![img/s against batch size](batch_sizes.png)",
        commands(b["commands"]),
    ])


def prediction(r: dict) -> str:
    p = r["prediction"]
    published = [[row["case"], str(row["nodes"]), row["what"], f"{row['published']:g}",
                  f"{row['predicted']:.5g}", signed(row["error"]), row["source"]]
                 for row in p["published"]]
    parts = [
        "## Predictor",
        "`spotring predict` (docs/benchmarks.md has the model). Against the published "
        "figures:",
        table(["case", "nodes", "quantity", "published", "predicted", "error", "source"],
              published),
        "![predicted against published](prediction.png)",
    ]
    if p.get("machine"):
        parts += [
            "Against this run's multi-worker img/s (total, the throughput table's mean), "
            "predicted from its 1-worker img/s (r1) and the alpha and beta fitted to the "
            "engine's allreduce above, one worker per node:",
            table(["engine", "workers", "batch", "measured img/s", "predicted img/s", "error",
                   "r1 img/s", "predicted comm ms", "alpha us", "beta GB/s"],
                  [[row["engine"], str(row["workers"]), str(row["batch"]),
                    f"{row['measured']:.0f}", f"{row['predicted']:.0f}", signed(row["error"]),
                    f"{row['img_s_1']:.0f}", f"{row['communication_ms']:.2f}",
                    f"{row['latency_us']:.1f}", f"{row['bandwidth_gbps']:.3g}"]
                   for row in p["machine"]])]
    return "\n\n".join(parts)


def seconds(value: float | None) -> str:
    return "not reached" if value is None else f"{value:.1f}"


def time_to_accuracy(r: dict) -> str:
    t = r["time_to_accuracy"]
    seeds = t["seeds"]
    rows = []
    for row in t["rows"]:
        mean = seconds(row["mean"])
        if 0 < row["reached"] < len(row["seconds"]):
            mean += f" ({row['reached']} of {len(row['seconds'])} seeds)"
        rows.append([row["label"], str(row["global_batch"]), f"{row['peak_lr']:.4g}",
                     str(row["steps"]), str(row["eval_every"]),
                     ", ".join(map(seconds, row["seconds"])), mean, seconds(row["worst"]),
                     f"{100 * row['final_accuracy']['mean']:.2f}%",
                     f"{100 * row['final_accuracy']['worst']:.2f}%",
                     DASH if row["ratio"] is None else f"{row['ratio']:.2f}",
                     f"{row['train_seconds']['mean']:.1f}", f"{row['train_seconds']['worst']:.1f}",
                     f"{row['run_ratio']:.2f}"])
    target = f"{100 * t['target']:.2f}%"
    capped = (f" Every run stopped after at most {t['max_steps']} steps (--max-steps)."
              if t.get("max_steps") else "")
    return "\n\n".join([
        "## Time to accuracy",
        f"Training seconds until the first evaluation on the full test set at or above "
        f"{target} (nothing interpolated), evaluation and checkpoints excluded; about "
        f"{t['evaluations']} evaluations per run, every `eval every` steps and at each epoch "
        f"end; seeds {', '.join(map(str, seeds))}, the configurations interleaved per seed. "
        "The trainer rows run its default config at each worker count (the global batch is "
        "the per-worker batch x workers, the LR follows by the linear scaling rule); the "
        "reference loop is benchmarks/reference_loop.py, fixed. mean: over the seeds that "
        "reached the target; worst: `not reached` if any did not; `mean / reference`: over "
        "the reference loop's mean. The last three columns: the whole run's training "
        "seconds, evaluation excluded, and their mean over the reference loop's." + capped,
        table(["configuration", "global batch", "peak LR", "steps", "eval every",
               f"seconds to {target}, by seed", "mean", "worst",
               "final accuracy (mean)", "final accuracy (worst)", "mean / reference",
               "run s (mean)", "run s (worst)", "run / reference"], rows),
        "![test accuracy against training seconds](time_to_accuracy.png)",
        commands([run["command"] for run in t["runs"]]),
    ])


SECTIONS = {"throughput": throughput, "allreduce": allreduce, "batch_sizes": batch_sizes,
            "time_to_accuracy": time_to_accuracy, "prediction": prediction}


def render(folder: Path) -> Path:
    """report.md and the plots of ``folder``'s results.json; the path of report.md."""
    r = record.load(folder)
    plots.draw(r, folder)
    parts = [header(folder, r)] + [render_section(r) for key, render_section in SECTIONS.items()
                                   if key in r]
    parts.append("## Raw data\n\n`results.json`: every figure above, and every interval of "
                 "every run; `runs/`: each run's own folder (metrics.jsonl, summary.json, log).")
    path = folder / "report.md"
    write_atomic(path, ("\n\n".join(parts) + "\n").encode())
    return path


def main(argv: list[str] | None = None) -> int:
    """spotring report: render a run (exit 2 where there is no such run)."""
    p = argparse.ArgumentParser(prog="spotring report", description=__doc__.splitlines()[0],
                                epilog="The method: docs/benchmarks.md.")
    p.add_argument("run", nargs="?", help="a folder under the results folder, a path to one, "
                   "or latest (the default)")
    args = p.parse_args(argv)
    try:
        folder = record.find(args.run)
    except FileNotFoundError as e:
        p.error(str(e))
    print(f"written: {render(folder)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
