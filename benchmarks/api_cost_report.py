"""The figures and report.md of benchmarks/api_cost.py, from its results.json alone:
each figure the mean over the repeats with its 95% interval (benchmarks/stats.py); a ratio
the mean of the repeats' own ratios (each of two runs side by side), "unjudgeable" where
its interval spans the goal.
"""

from __future__ import annotations

from pathlib import Path

from spotring.benchmarks import record
from spotring.benchmarks.report import commands, header, spread, table
from spotring.benchmarks.stats import mean_ci


def judge(ratio: dict, goal: float) -> str:
    """Whether a ratio's 95% interval lies at or above ``goal``, below it, or spans it."""
    low, high = ratio["mean"] - ratio["ci95"], ratio["mean"] + ratio["ci95"]
    if low >= goal:
        return "met"
    if high < goal:
        return "missed"
    return "unjudgeable: the 95% interval spans it"


def _paired(runs: list[dict], key: str, field: str, mine, base) -> list[float]:
    """Per repeat: ``field`` of the run whose ``key`` is ``mine`` over that of ``base``;
    repeats where either is None are left out."""
    by = {(r["repeat"], r[key]): r[field] for r in runs}
    return [by[i, mine] / by[i, base] for i in sorted({r["repeat"] for r in runs})
            if by[i, mine] is not None and by[i, base] is not None]


def _figures(runs: list[dict], key: str, value, field: str = "images_per_second") -> dict:
    values = [r[field] for r in runs if r[key] == value]
    reached = [v for v in values if v is not None]
    return {"values": values, **(mean_ci(reached) if reached else {"mean": None})}


def derive(results: dict) -> dict:
    if "api" in results:
        a = results["api"]
        a["plain"], a["spotring"] = (_figures(a["runs"], "variant", v)
                                     for v in ("plain", "spotring"))
        a["ratio"] = mean_ci(_paired(a["runs"], "variant", "images_per_second",
                                     "spotring", "plain"))
        a["ratio_of_means"] = a["spotring"]["mean"] / a["plain"]["mean"]
        a["verdict"] = judge(a["ratio"], a["goal"])
    if "dataloader" in results:
        d = results["dataloader"]
        d["rows"] = [{"loader_workers": n, **_figures(d["runs"], "loader_workers", n),
                      "over_0": mean_ci(_paired(d["runs"], "loader_workers",
                                                "images_per_second", n, 0))}
                     for n in d["loader_workers"]]
    if "trainer_before_after" in results:
        t = results["trainer_before_after"]
        t["figures"] = {}
        for tree in ("before", "after"):
            t["figures"][tree] = {"images_per_second": _figures(t["runs"], "tree", tree),
                       "seconds_to_target": _figures(t["runs"], "tree", tree,
                                                     "seconds_to_target"),
                       "test_accuracy": _figures(t["runs"], "tree", tree, "test_accuracy")}
        for field in ("images_per_second", "seconds_to_target"):
            ratios = _paired(t["runs"], "tree", field, "after", "before")
            t[f"{field}_ratio"] = mean_ci(ratios) if ratios else None
    return results


def _number(value: float | None, digits: int = 0, missing: str = "not reached") -> str:
    return missing if value is None else f"{value:.{digits}f}"


def _ratio(stats: dict | None) -> str:
    return "-" if stats is None else spread(stats, 3)


def api_section(a: dict) -> str:
    pairs = sorted({r["repeat"] for r in a["runs"]})
    by = {(r["repeat"], r["variant"]): r for r in a["runs"]}
    rows = [[str(i), f"{by[i, 'plain']['images_per_second']:.0f}",
             f"{by[i, 'spotring']['images_per_second']:.0f}",
             f"{by[i, 'spotring']['images_per_second'] / by[i, 'plain']['images_per_second']:.3f}",
             f"{by[i, 'plain']['load']:.2f}", f"{by[i, 'spotring']['load']:.2f}"]
            for i in pairs]
    first = a["runs"][0]
    return "\n\n".join([
        "## The API's cost: the same job as a plain DDP script and with spotring",
        f"{a['workers']} workers under torchrun, {a['threads']} thread each, global batch "
        f"{first['global_batch']}, MNIST in memory, benchmarks/plain_loop.py's convnet, SGD; "
        f"img/s over {first['steps']} steps after {first['warmup']} warm-up steps, loading "
        "and every call included (spotring: job.loader, job.wrap, job.track, job.should_stop "
        "every step; job.save after the window).",
        table(["", "img/s (mean ± 95%)", "spotring / plain"], [
            ["plain", spread(a["plain"]), "-"],
            ["spotring", spread(a["spotring"]),
             f"{_ratio(a['ratio'])} (of the means: {a['ratio_of_means']:.3f})"]]),
        f"Goal: spotring / plain at least {a['goal']:.2f}, judged on the 95% interval of the "
        f"repeats' own ratios: **{a['verdict']}**.",
        table(["repeat", "plain img/s", "spotring img/s", "spotring / plain",
               "load (1 min) before plain", "before spotring"], rows),
        commands([r["command"] for r in a["runs"]]),
    ])


def dataloader_section(d: dict) -> str:
    first = d["runs"][0]
    rows = [[str(row["loader_workers"]), spread(row), _ratio(row["over_0"]),
             ", ".join(f"{v:.0f}" for v in row["values"])] for row in d["rows"]]
    return "\n\n".join([
        "## spotring.DataLoader over image files",
        f"{first['files']} PNG files (MNIST digits, 28x28 grey) in torchvision's ImageFolder "
        "layout, decoded with Pillow to float32 as examples/train.py reads them; one process, "
        f"global batch {first['global_batch']}, img/s over {first['steps']} batches after "
        f"{first['warmup']} warm-up batches (persistent workers), nothing trained.",
        table(["num_workers", "img/s (mean ± 95%)", "over num_workers 0", "by repeat"], rows),
        commands([r["command"] for r in d["runs"]]),
    ])


def trainer_section(t: dict) -> str:
    target = f"{100 * t['target']:.0f}%"
    rows = []
    for tree in ("before", "after"):
        f = t["figures"][tree]
        mine = sorted((r for r in t["runs"] if r["tree"] == tree), key=lambda r: r["seed"])
        rows.append([tree, spread(f["images_per_second"]),
                     ", ".join(f"{r['images_per_second']:.0f}" for r in mine),
                     "-" if f["seconds_to_target"]["mean"] is None
                     else spread(f["seconds_to_target"], 1),
                     ", ".join(_number(r["seconds_to_target"], 1) for r in mine),
                     ", ".join(f"{100 * r['test_accuracy']:.2f}%" for r in mine)])
    rows.append(["after / before", _ratio(t["images_per_second_ratio"]), "",
                 _ratio(t["seconds_to_target_ratio"]), "", ""])
    return "\n\n".join([
        "## The built-in trainer before and after its rebuild on the API",
        f"The default run (`torchrun --nproc-per-node {t['workers']}`, one epoch, "
        f"{t['steps']} steps) with an evaluation on the whole test set every "
        f"{t['eval_every']} steps: before = `{t['before_commit']}` (a worktree at "
        f"{t['before_dir']}, `-m trainer` run there with PYTHONPATH on it), after = the "
        "working tree (`-m spotring.trainer`). img/s "
        f"from summary.json; seconds to {target}: the training seconds (evaluation excluded) "
        "of the first evaluation at or above it. Seed = the repeat's number, the same for "
        "both trees; a ratio is the mean of the seeds' own ratios.",
        table(["tree", "img/s (mean ± 95%)", "img/s by seed",
               f"s to {target} (mean ± 95%)", f"s to {target} by seed",
               "final accuracy by seed"], rows),
        commands([r["command"] for r in t["runs"]]),
    ])


def render(folder: Path, results: dict) -> Path:
    parts = [header(folder, results)]
    if "api" in results:
        parts.append(api_section(results["api"]))
    if "dataloader" in results:
        parts.append(dataloader_section(results["dataloader"]))
    if "trainer_before_after" in results:
        parts.append(trainer_section(results["trainer_before_after"]))
    parts.append("The method: `benchmarks/api_cost.py`. `results.json` holds every run's "
                 "figures, command and the load it started under.")
    return record.write_report(folder, "\n\n".join(parts))
