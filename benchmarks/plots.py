"""The report's figures, one function per PNG (throughput, efficiency, allreduce,
batch_sizes, prediction, time_to_accuracy), each drawn from a results.json section with
the tables' 95% intervals as error bars, through spotring.support.plotting (headless, each PNG
written whole).
"""

from __future__ import annotations

from pathlib import Path

from spotring.benchmarks import predict
from spotring.benchmarks.throughput import reference
from spotring.support.plotting import plt, save


def throughput(section: dict, path: Path) -> None:
    rows = section["rows"]
    batches = sorted({r["batch"] for r in rows})
    fig, axes = plt.subplots(1, len(batches), figsize=(5.5 * len(batches), 4), squeeze=False)
    for ax, batch in zip(axes[0], batches, strict=True):
        at = [r for r in rows if r["batch"] == batch]
        top = max(r["workers"] for r in at)
        ones = {r["engine"]: r for r in at if r["workers"] == 1}
        for ref, one in ones.items():
            ax.plot([1, top], [one["total"]["mean"], top * one["total"]["mean"]], ":",
                    color="grey", label=f"ideal ({'plain' if ref == 'plain' else 'trainer'})")
        for engine in dict.fromkeys(r["engine"] for r in at if r["workers"] > 1):
            line = [ones[reference(engine)]] if reference(engine) in ones else []
            line += sorted((r for r in at if r["engine"] == engine and r["workers"] > 1),
                           key=lambda r: r["workers"])
            ax.errorbar([r["workers"] for r in line], [r["total"]["mean"] for r in line],
                        yerr=[r["total"]["ci95"] for r in line], marker="o", capsize=3,
                        label=engine)
        ax.set(title=f"{section['workload']}, batch {batch} per worker", xlabel="workers",
               ylabel="img/s (total)")
        ax.set_xticks(sorted({r["workers"] for r in at}))
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    save(fig, path)


def efficiency(section: dict, path: Path) -> None:
    rows = [r for r in section["rows"] if "efficiency" in r][::-1]
    fig, ax = plt.subplots(figsize=(7.5, 0.45 * len(rows) + 1.4))
    ax.barh(range(len(rows)), [r["efficiency"]["mean"] for r in rows],
            xerr=[r["efficiency"]["ci95"] for r in rows], capsize=3, color="tab:blue")
    ax.axvline(1.0, color="grey", linestyle=":")
    ax.set_yticks(range(len(rows)), [f"{r['label']}, batch {r['batch']}" for r in rows],
                  fontsize=8)
    ax.set_xlabel("scaling efficiency against 1 worker")
    save(fig, path)


def allreduce(section: dict, gradient_bytes: int | None, path: Path) -> None:
    fig, ax = plt.subplots(figsize=(6.5, 4))
    for transport, rows in section["transports"].items():
        ax.plot([r["bytes"] for r in rows], [r["busbw_gbps"] for r in rows], marker=".",
                label=transport)
    if gradient_bytes:
        ax.axvline(gradient_bytes, color="grey", linestyle=":", label="the model's gradient")
    ax.set(xscale="log", yscale="log", xlabel="message size (bytes)", ylabel="busbw (GB/s)",
           title=f"Allreduce bus bandwidth, {section['ranks']} ranks")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8)
    save(fig, path)


def batch_sizes(section: dict, path: Path) -> None:
    fig, ax = plt.subplots(figsize=(6.5, 4))
    for model in dict.fromkeys(r["model"] for r in section["rows"]):
        rows = sorted((r for r in section["rows"] if r["model"] == model),
                      key=lambda r: r["batch"])
        ax.errorbar([r["batch"] for r in rows], [r["images_per_second"]["mean"] for r in rows],
                    yerr=[r["images_per_second"]["ci95"] for r in rows], marker="o", capsize=3,
                    label=f"{model} ({rows[0]['shape']})")
    batches = sorted({r["batch"] for r in section["rows"]})
    ax.set(xscale="log", yscale="log", xlabel="batch size", ylabel="img/s",
           title=f"One worker, {section['threads']} threads")
    ax.set_xticks(batches, [str(b) for b in batches])
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8)
    save(fig, path)


def prediction(section: dict, path: Path) -> None:
    cases: dict[str, list[dict]] = {}
    for r in section["published"]:
        cases.setdefault(r["case"], []).append(r)
    fig, axes = plt.subplots(1, len(cases), figsize=(5.5 * len(cases), 4), squeeze=False)
    for ax, (case, rows) in zip(axes[0], cases.items(), strict=True):
        s = predict.PRESETS[case]
        what = rows[0]["what"]
        nodes = list(range(1, max(max(r["nodes"] for r in rows) * 2, 16) + 1))
        gpus = [n * s.gpus_per_node for n in nodes]
        ax.plot(gpus, [predict.predict(s, n)[what] for n in nodes], label="predicted")
        if what == "img_s":
            ax.plot(gpus, [g * s.img_s for g in gpus], ":", color="grey", label="ideal")
        ax.plot([r["nodes"] * s.gpus_per_node for r in rows], [r["published"] for r in rows],
                "o", color="black", label="published")
        ax.set(title=s.name, xlabel="GPUs", ylabel="img/s" if what == "img_s" else "efficiency")
        if what == "efficiency":  # hundreds of GPUs: a log axis, and room below 90%
            ax.set(xscale="log", ylim=(0.5, 1.02))
        ax.title.set_fontsize(8)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    save(fig, path)


def time_to_accuracy(section: dict, path: Path) -> None:
    """One line per run, one colour per configuration; zoomed to the last few percent."""
    target = section["target"]
    fig, ax = plt.subplots(figsize=(7.5, 4.5))
    colours = {row["label"]: f"C{i}" for i, row in enumerate(section["rows"])}
    for run in section["runs"]:
        first = run["seed"] == section["seeds"][0]
        ax.plot([p[1] for p in run["curve"]], [p[2] for p in run["curve"]], marker=".",
                color=colours[run["label"]], alpha=0.8, linewidth=1,
                label=run["label"] if first else None)
    ax.axhline(target, color="grey", linestyle=":", label=f"target {100 * target:.2f}%")
    ax.set_ylim(max(0.0, min(0.97, target - 0.02)), 1.0)
    ax.set(xlabel="training seconds (evaluation excluded)", ylabel="test accuracy",
           title=f"Time to accuracy, seeds {', '.join(map(str, section['seeds']))}")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="lower right")
    save(fig, path)


def draw(r: dict, folder: Path) -> None:
    """Every plot whose section results.json ``r`` has, into ``folder``."""
    if "throughput" in r:
        throughput(r["throughput"], folder / "throughput.png")
        if any("efficiency" in row for row in r["throughput"]["rows"]):
            efficiency(r["throughput"], folder / "efficiency.png")
    if "allreduce" in r:
        allreduce(r["allreduce"], r.get("throughput", {}).get("gradient_bytes"),
                  folder / "allreduce.png")
    if "batch_sizes" in r:
        batch_sizes(r["batch_sizes"], folder / "batch_sizes.png")
    if "prediction" in r:
        prediction(r["prediction"], folder / "prediction.png")
    if "time_to_accuracy" in r:
        time_to_accuracy(r["time_to_accuracy"], folder / "time_to_accuracy.png")
