"""`make report`: results.json -> report.md and its PNGs, in the same folder.

    python -m benchmarks.report                 # the newest benchmarks/results/*/
    python -m benchmarks.report reference       # benchmarks/results/reference/
    python -m benchmarks.report PATH/TO/FOLDER

Every number in report.md is read from results.json, formatted and nothing else (the
benchmark modules compute; tests/test_bench_report.py parses both and compares), and
every section is there only when results.json has it, so the report of a single
benchmark (python -m benchmarks.allreduce, ...) works too.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from benchmarks import plots, record
from benchmarks.allreduce import ENGINE_TRANSPORT, TRAINER_PATHS, wakeup
from benchmarks.allreduce_ranks import COLD_BURST_SECONDS, COLD_BURSTS
from benchmarks.this_machine import SPINS
from trainer.stores import write_atomic

DASH = "-"


# ----------------------------------------------------------------------------- format


def rate(x: float) -> str:
    return f"{x:.0f}"


def spread(stats: dict) -> str:
    return f"{stats['mean']:.0f} ± {stats['ci95']:.0f}"


def percent(x: float | None, digits: int = 1) -> str:
    return DASH if x is None else f"{100 * x:.{digits}f}%"


def millis(x: float | None, digits: int = 1) -> str:
    return DASH if x is None else f"{x:.{digits}f}"


def signed_range(r: dict) -> str:
    """A median_range of relative errors: median (lowest to highest)."""
    low, high = (round(100 * r[k]) for k in ("low", "high"))  # ints: no "-0"
    return f"{100 * r['median']:+.1f}% ({low:+d} to {high:+d}%)"


def gbps(x: float | None) -> str:
    return DASH if x is None else f"{x:.3g}"


def size(nbytes: int) -> str:
    for unit, scale in (("MiB", 2**20), ("KiB", 2**10)):
        if nbytes >= scale and nbytes % scale == 0:
            return f"{nbytes // scale} {unit}"
    return f"{nbytes:,} B"


def table(headers: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + " --- |" * len(headers)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def commands(title: str, lines: list[str]) -> str:
    body = "\n".join(dict.fromkeys(lines))
    return f"<details><summary>{title}</summary>\n\n```sh\n{body}\n```\n</details>"


# ---------------------------------------------------------------------------- sections


def header(folder: Path, r: dict) -> str:
    m = r["machine"]
    packages = ", ".join(f"{k} {v}" for k, v in m["packages"].items() if v)
    load = f"{m['load_average']} at the start, {m.get('load_average_end', '?')} at the end"
    return "\n\n".join([
        f"# Benchmarks: {folder.name}",
        f"`{r['command']}`, started {r['started']}, {r['wall_seconds']:.0f} s"
        f"{', quick' if r.get('quick') else ''}. Load average (1, 5, 15 min) {load}: "
        f"above {m['cores']} means other work shared the machine."
        + (f" Predictions and targets recomputed from these measurements by "
           f"`{d['command']}` at commit {d['commit']}, {d['at']}."
           if (d := r.get("derived")) else ""),
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


def targets(r: dict) -> str:
    t = r["targets"]
    rows = []
    if "efficiency" in t:
        e = t["efficiency"]
        rows.append(["2-worker efficiency of the trainer >= the plain DDP loop's (median "
                     "of every run against its own repeat's 1-worker run, batch "
                     + "/".join(map(str, e["batches"])) + ")",
                     " / ".join(f"{k} {percent(v)}" for k, v in e["by_engine"].items()),
                     f"met ({e['engine']})" if e["met"] else "**missed**"])
    a = t["allreduce_path"]
    rows.append([f"gradient allreduce path >= {a['threshold']} x the best transport "
                 f"({a['best']}, {gbps(a['best_busbw_gbps'])} GB/s) at the gradient size "
                 f"({size(a['bytes'])})",
                 " / ".join(f"{k} ({v['transport']}) {v['of_best']:.2f}x"
                            for k, v in a["by_engine"].items()),
                 f"met ({a['engine']})" if a["met"] else "**missed**"])
    return "## Targets\n\n" + table(["target", "figures", "verdict"], rows)


def throughput(r: dict) -> str:
    t = r["throughput"]
    timing = t["timing"]
    rows = [[row["label"], str(row["workers"]), str(row["batch"]), spread(row["per_worker"]),
             spread(row["total"]), rate(row["total_median"]),
             DASH if "speedup" not in row else f"{row['speedup']:.2f}",
             percent(row.get("efficiency")),
             DASH if "efficiency_per_repeat" not in row else
             f"{percent(row['efficiency_per_repeat']['low'])} .. "
             f"{percent(row['efficiency_per_repeat']['high'])}",
             millis(row["step_ms"]), millis(row.get("compute_ms")),
             millis(row.get("communication_ms"))]
            for row in sorted(t["rows"], key=lambda x: (x["batch"], x["workers"],
                                                        x["independent"]))]
    return "\n\n".join([
        "## Throughput",
        f"{t['workload']}; {timing['warmup_steps']} warm-up steps, then {timing['intervals']} "
        f"intervals of {timing['log_every']} steps per run; {t['repeats']} interleaved "
        f"repeat(s); 1 thread (core) per worker. img/s as mean ± 1.96 sigma over all measured "
        "intervals, and the median over repeats; speedup and efficiency against one worker "
        "of the same program; compute = step time of single workers run side by side (no "
        "communication), communication = the rest of the step." + measured_apart(t),
        table(["configuration", "workers", "batch / worker", "img/s per worker",
               "img/s total", "img/s total (median)", "speedup", "efficiency",
               "efficiency range", "step ms", "compute ms", "communication ms"], rows),
        "![img/s against workers](throughput.png)\n![efficiency](efficiency.png)",
        commands("exact commands", [c for run in t["runs"] for c in run["commands"]]),
    ])


def mnist_engines(r: dict) -> str:
    e = r["mnist_engines"]
    rows = [[row["engine"], row["transport"], rate(row["total_median"]), spread(row["total"]),
             percent(row["efficiency"]), millis(row["step_ms"]), millis(row["compute_ms"]),
             millis(row["exposed_ms"]), millis(row["allreduce_ms"], 2),
             gbps(row["busbw_gbps"]), DASH if row["of_best"] is None else f"{row['of_best']:.2f}"]
            for row in e["rows"]]
    return "\n\n".join([
        f"## Engines, {e['workers']} ranks, {e['workload']} (issue 3)",
        f"{e['workload']}, batch {e['batch']} per worker; the model's gradient is "
        f"{size(e['gradient_bytes'])}. exposed = step - compute (what averaging adds to a "
        "step); allreduce = one allreduce of the whole gradient over the engine's transport, "
        "timed alone.",
        table(["engine", "transport", "img/s (median)", "img/s (mean ± 1.96 sigma)",
               "efficiency", "step ms", "compute ms", "exposed ms", "allreduce ms",
               "busbw GB/s", "x best"], rows),
        commands("exact commands", [row["command"] for row in e["rows"]]),
    ])


def allreduce(r: dict) -> str:
    a = r["allreduce"]
    names = list(a["transports"])
    sizes = sorted({row["bytes"] for rows in a["transports"].values() for row in rows})
    gradient = r.get("throughput", {}).get("gradient_bytes")

    def cells(key: str) -> list[list[str]]:
        out = []
        for n in sizes:
            label = size(n) + (" (gradient)" if n == gradient else "")
            by = {t: next((x for x in a["transports"][t] if x["bytes"] == n), None) for t in names}
            out.append([label] + [gbps(by[t][key]) if by[t] else DASH for t in names])
        return out

    return "\n\n".join([
        "## Allreduce",
        f"{a['ranks']} ranks, float32 sum in place; median of {a['repeats']} repeat(s), each "
        f"the median of {a['loops']} timed loops sharing about {a['budget_seconds']} s of calls "
        "per size. algbw = size / time, busbw = algbw x 2(n-1)/n (nccl-tests), in GB/s "
        "(10^9 bytes)." + measured_apart(a),
        "Bus bandwidth, GB/s:\n\n" + table(["size", *names], cells("busbw_gbps")),
        "Algorithm bandwidth, GB/s:\n\n" + table(["size", *names], cells("algbw_gbps")),
        "![busbw against size](allreduce.png)",
        paths(a, gradient),
        "CPU the transport's own threads take from a program that computes on every core "
        "(median, cores; the predictor takes it from the workers' compute): "
        + ", ".join(f"{t} {a['background_cpu_cores'][t]:.2f}" for t in names) + "."
        + lent_cpu(a),
        cold(a),
        commands("exact commands", list(a["commands"].values())),
    ])


def lent_cpu(a: dict) -> str:
    """t_r per transport, where measured (results from before it was: nothing)."""
    lent = a.get("response_cpu_seconds", {})
    if not lent:
        return ""
    spun = sorted(ENGINE_TRANSPORT[e] for e in SPINS if ENGINE_TRANSPORT[e] in lent)
    return (" One more allreduce sent while it computes, without waiting, takes from it "
            "(median, ms of CPU; the predictor's t_r): "
            + ", ".join(f"{t} {1e3 * v:.2f}" for t, v in lent.items()) + "."
            + (f" Not charged over {', '.join(spun)}: its thread spins in every cycle "
               "anyway, and h, from its training runs, counts the sends." if spun else ""))


def paths(a: dict, gradient: int | None) -> str:
    """The trainer's paths against the transport each goes over, timed in the same
    process (allreduce_ranks.py): the overhead of the path, whatever the host's speed."""
    rows = [(path, over, r) for path, over in TRAINER_PATHS.items()
            for r in a["transports"].get(path, [])
            if r["bytes"] == gradient and "of_transport" in r]
    if not rows:
        return ""
    return (f"The trainer's path against the transport it goes over, timed in turn in the "
            f"same process at the gradient size ({size(gradient)}), transport's time / "
            "path's, median (lowest to highest) over repeats: "
            + ", ".join(f"{path} {r['of_transport']:.2f}x of {over} "
                        f"({min(r['of_transport_per_repeat']):.2f} to "
                        f"{max(r['of_transport_per_repeat']):.2f})"
                        for path, over, r in rows)
            + "; its busbw above is its own launches', its of_best this ratio times its "
              "transport's.")


def cold(a: dict) -> str:
    """The gradient's allreduce after bursts of computing against back to back: what
    waking a transport's threads costs a step (the predictor's t_w)."""
    woken = {t: wakeup(a, t) for t in a.get("cold", {})}
    if not woken:
        return ""
    rows = [[t, *(millis(1e3 * w[k], 3) for k in ("cold", "hot", "wakeup"))]
            for t, w in woken.items()]
    return (f"The gradient's allreduce ({size(next(iter(woken.values()))['bytes'])}) after "
            f"each of {COLD_BURSTS} bursts of {1e3 * COLD_BURST_SECONDS:.0f} ms of computing "
            "(cold: the transport's threads slept), against back to back; medians:\n\n"
            + table(["transport", "cold ms", "back to back ms", "t_w ms"], rows))


def batch_sizes(r: dict) -> str:
    b = r["batch_sizes"]
    batches = sorted({row["batch"] for row in b["rows"]})
    models = list(dict.fromkeys((row["model"], row["shape"]) for row in b["rows"]))
    rows = []
    for model, shape in models:
        by = {row["batch"]: row for row in b["rows"] if row["model"] == model}
        rows.append([model, shape] + [spread(by[n]["images_per_second"]) if n in by else DASH
                                      for n in batches])
    return "\n\n".join([
        "## Batch sizes",
        f"img/s (mean ± 1.96 sigma) of one worker with {b['threads']} threads, synthetic data, "
        "per model and batch size, as in the Chameleon Cloud talk's table.",
        table(["model", "input", *map(str, batches)], rows),
        "![img/s against batch size](batch_sizes.png)",
        commands("exact commands", b["commands"]),
    ])


def prediction(r: dict) -> str:
    p = r["prediction"]
    published = [[row["case"], str(row["nodes"]), row["what"], f"{row['published']:.4g}",
                  f"{row['predicted']:.4g}", f"{100 * row['error']:+.1f}%", row["source"]]
                 for row in p["published"]]
    machine = [[row["engine"], str(row["batch"]), rate(row["published"]), rate(row["predicted"]),
                f"{100 * row['error']:+.1f}%", signed_range(row["error_per_repeat"]),
                percent(row["jitter"]),
                percent(row["compute_share"]), millis(row["wait_ms"]),
                millis(row["communication_ms"]), millis(row["measured_communication_ms"]),
                rate(row["predicted_compute_alone"]), f"{row['latency_us']:.0f}",
                gbps(row["bandwidth_gbps"])]
               for row in p["machine"]]
    return "\n\n".join([
        "## Predictor",
        "`python -m benchmarks.predict`; its docstring has the model and every parameter. "
        "Against the published figures:",
        table(["case", "nodes", "quantity", "published", "predicted", "error", "source"],
              published),
        "![predicted against published](prediction.png)",
        "Against this machine's 2-worker img/s, predicted from the compute-only runs (mean "
        "step time and its jitter, the host as busy as with 2 workers) and the alpha and beta "
        "fitted to the engine's transport. core kept = the share of its core a worker "
        "keeps from its transport's background threads (the CPU they take from a program "
        "that computes, measured with the allreduce); per repeat = each repeat's run "
        "predicted from the same repeat's compute-only runs: median (lowest to highest), how "
        "far launches of one configuration fall apart; wait = the slowest worker's lateness; "
        "comm = gradients + the trainer's per-step vote where it blocks (over MPI) + waking "
        "the transport's threads (a cold allreduce over a back-to-back one) + the CPU the "
        "allreduces sent while a worker computes take from it (Horovod's gradient tensors "
        "but the last, the vote where it does not block); measured comm = step - compute "
        "above.",
        table(["engine", "batch", "measured img/s", "predicted", "error", "per repeat",
               "jitter", "core kept", "wait ms", "comm ms", "measured comm ms",
               "predicted, compute alone", "alpha us", "beta GB/s"], machine) if machine else "",
        split_prediction(p["split"]) if "split" in p else "",
    ])


def split_prediction(rows: list[dict]) -> str:
    return "\n\n".join([
        "Against the 2-worker steps measured inside one job (Step split, above): the same "
        "model, from that job's own compute blocks (mean and jitter), so that two launches' "
        "difference is not in the comparison. added = what communication adds to a step: "
        "predicted wait + comm, measured sync - free.",
        table(["engine", "batch", "measured img/s", "predicted", "error", "jitter",
               "added ms", "measured added ms"],
              [[row["engine"], str(row["batch"]), rate(row["published"]),
                rate(row["predicted"]), f"{100 * row['error']:+.1f}%", percent(row["jitter"]),
                millis(row["added_ms"]), millis(row["measured_added_ms"])] for row in rows]),
    ])


def measured_apart(section: dict) -> str:
    """A section measured again after a change of method, in a run of its own (its
    results.json is that run's), says so: its time, load and code are not the header's."""
    apart = section.get("measured_apart")
    if apart is None:
        return ""
    return (f" Measured apart from the rest of this run, {apart['started']} UTC, load average "
            f"{apart['load_average']:.2f}, commit {apart['commit']}: "
            f"`{apart['command']}` ({apart['why']}).")


def step_split(r: dict) -> str:
    s = r["step_split"]
    rows = [[row["engine"], str(row["batch"]), *(millis(row[f"{m}_ms"]) for m in
                                                    ("free", "aligned", "sync")),
             millis(row["wait_and_vote_ms"]), millis(row["gradient_allreduce_ms"]),
             millis(row["communication_ms"]), millis(row["free_sd_ms"])]
            for row in s["rows"]]
    return "\n\n".join([
        f"## Step split, {s['workers']} workers inside one job",
        f"benchmarks/step_split.py: the plain loop's network under the trainer's engines; "
        f"each job alternates blocks of {s['block']} steps of three kinds, {s['cycles']} "
        "cycles: free (an unwrapped copy, no communication), aligned (the copy and the "
        "trainer's per-step vote), sync (the engine's model: gradients too). "
        "ms per step, the slower rank's, medians over cycles; the differences are medians "
        "of differences within a cycle. free sd = the spread of a free step."
        + measured_apart(s),
        table(["engine", "batch", "free ms", "aligned ms", "sync ms", "wait + vote ms",
               "gradient allreduce ms", "sync - free ms", "free sd ms"], rows),
        commands("exact commands", list(s["commands"].values())),
    ])


def mnist_overhead(r: dict) -> str:
    o = r["mnist_overhead"]
    rows = [[row["setup"], rate(row["trainer_images_per_second"]),
             rate(row["plain_images_per_second"]), f"{row['ratio']:.3f}",
             ", ".join(f"{x:.2f}" for x in row["pair_ratios"]),
             *(DASH if row[f"{k}_time_to_99"] is None else f"{row[f'{k}_time_to_99']:.1f}"
               for k in ("trainer", "plain")),
             *(percent(row[f"{k}_test_accuracy"], 2) for k in ("trainer", "plain"))]
            for row in o["rows"]]
    return "\n\n".join([
        f"## Trainer against the plain loop, MNIST, {o['epochs']} epochs, global batch "
        f"{o['global_batch']}",
        f"Medians of {o['repeats']} run(s) each, in back-to-back pairs (which runs first "
        "alternates); the ratio is the median of the pairs' ratios trainer / plain.",
        table(["setup", "trainer img/s", "plain img/s", "ratio", "pair ratios",
               "trainer s to 99%", "plain s to 99%", "trainer final", "plain final"], rows),
        commands("exact commands", o["commands"]),
    ])


SECTIONS = [("targets", targets), ("throughput", throughput), ("mnist_engines", mnist_engines),
            ("allreduce", allreduce), ("step_split", step_split), ("batch_sizes", batch_sizes),
            ("prediction", prediction),
            ("mnist_overhead", mnist_overhead)]


def render(folder: Path) -> Path:
    r = record.load(folder)
    if "throughput" in r:
        plots.throughput(r["throughput"], folder / "throughput.png")
        plots.efficiency(r["throughput"], folder / "efficiency.png")
    if "allreduce" in r:
        plots.allreduce(r["allreduce"], r.get("throughput", {}).get("gradient_bytes"),
                        folder / "allreduce.png")
    if "batch_sizes" in r:
        plots.batch_sizes(r["batch_sizes"], folder / "batch_sizes.png")
    if "prediction" in r:
        plots.prediction(r["prediction"], folder / "prediction.png")
    parts = [header(folder, r)] + [render_section(r) for key, render_section in SECTIONS
                                   if key in r]
    parts.append("## Raw data\n\n`results.json` (every figure above, and every interval of "
                 "every run); `runs/` (each run's metrics.jsonl, summary.json and log).")
    path = folder / "report.md"
    write_atomic(path, ("\n\n".join(p for p in parts if p) + "\n").encode())
    return path


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("run", nargs="?", help="a folder under benchmarks/results, or a path")
    args = p.parse_args()
    print(f"written: {render(record.find(args.run))}")


if __name__ == "__main__":
    main()
