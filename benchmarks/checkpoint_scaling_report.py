"""The figures and report.md of benchmarks/checkpoint_scaling.py, from its results.json
alone: each cell's ratios to rank 0 alone, the stall of each kind of periodic save (stalls,
which tools/gpu-check's checkpoint figure reads too), and what N nodes would take.
"""

from __future__ import annotations

import statistics
from pathlib import Path

from spotring.benchmarks import record
from spotring.benchmarks.report import header, table

WARMUP_STEPS = 2  # periodic mode: AdamW's first step allocates its moments


def stalls(run: dict) -> dict:
    """(d)'s figures of each kind of save: the median seconds of the quiet steps (no save
    in them, none in flight at their end or the step before), the mean of the steps that
    saved (but those that first waited for a background write still in flight, where
    some did not: their stall is that write's too), the stall (their difference), the
    steps a background write overlapped, and the extra seconds of the steps from the save
    to the next save (or the end) over as many quiet ones: the write slowing the steps it
    overlaps counts there too."""
    steps = [s for s in run["steps"] if s["step"] > WARMUP_STEPS]
    # A background write was in flight at the step's start or end.
    writing = {s["step"] for s in steps if s["in_flight"]}
    busy = writing | {step + 1 for step in writing}
    plain = [s for s in steps if not s["save"]]
    base = statistics.median(s["seconds"] for s in [s for s in plain if s["step"] not in busy]
                             or plain)
    found = {}
    for kind in ("background", "blocking"):
        saves = [s for s in steps if s["save"] == kind]
        if not saves:
            continue
        spans = []
        for save in saves:
            after = [s for s in steps if s["step"] >= save["step"]]
            end = next((s["step"] for s in after[1:] if s["save"]), None)
            spans.append([s["seconds"] for s in after if end is None or s["step"] < end])
        waited = [s for s in saves if s["step"] - 1 in writing]
        mean = statistics.mean(s["seconds"] for s in
                               [s for s in saves if s not in waited] or saves)
        found[kind] = {
            "quiet_step": base, "save_step": mean, "stall": mean - base, "saves": len(saves),
            "waited": len(waited),
            "overlapped_steps": sum(1 for s in steps if not s["save"] and s["step"] in busy
                                    and kind == "background"),
            "extra_total": statistics.mean(sum(span) - len(span) * base for span in spans)}
    return found


def derive(results: dict) -> dict:
    """Per cell: the busiest rank's bytes over its share, moto's rate, and for a sharded
    cell its times over rank 0 alone's and what N nodes would take; the periodic run's
    stalls, and a background save's over a blocking one's."""
    section = results["checkpoint_scaling"]
    runs = {(r["gb"], r["workers"], r["mode"]): r for r in section["cells"]}
    for (gigabytes, workers, mode), run in runs.items():
        run["share_ratio"] = max(run["rank_bytes"]) / (run["checkpoint_bytes"] / workers)
        if run["s3"]:
            run["moto_mb_s"] = run["checkpoint_bytes"] / 1e6 / run["s3_phase_seconds"]
        alone, one = runs.get((gigabytes, workers, "rank0")), runs.get((gigabytes, 1, "rank0"))
        if mode != "sharded":
            continue
        if alone is not None:
            run["of_rank0"] = {f: run[f] / alone[f] for f in
                               ("notice_to_local", "save_to_local", "notice_to_s3", "save_to_s3")
                               if f in run and f in alone}
        for f in ("save_to_local", "save_to_s3") if one is not None else ():
            if f in one:  # N nodes: one rank's share at one node's (one writer's) rate
                run[f"on_nodes_{f}"] = one[f] * max(run["rank_bytes"]) / one["checkpoint_bytes"]
    figures = section["stall"] = stalls(section["periodic"]) if section["periodic"] else {}
    if {"background", "blocking"} <= figures.keys():
        section["stall_ratio"] = {f: figures["background"][f] / figures["blocking"][f]
                                  for f in ("stall", "extra_total")}
    # The noise: rank 0 alone writes the same bytes on any number of workers.
    section["rank0_spread"] = {
        f"{gigabytes:g}": [min(found), max(found)] for gigabytes in {r["gb"] for r in
                                                                  section["cells"]}
        if len(found := [r["save_to_local"] for r in section["cells"]
                         if r["gb"] == gigabytes and r["mode"] == "rank0"]) > 1}
    return results


def _s(x: float | None, digits: int = 2) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def render(folder: Path, results: dict) -> Path:
    """report.md: the machine, the cells, N nodes, the periodic run, the skipped cells."""
    section = results["checkpoint_scaling"]
    runs = section["cells"]
    rows = []
    for r in sorted(runs, key=lambda r: (r["gb"], r["workers"], r["mode"])):
        ratio = r.get("of_rank0", {})
        rows.append([
            f"{r['gb']:g}", str(r["workers"]),
            "one writer" if r["workers"] == 1 else r["mode"], _s(r["notice_to_local"]),
            _s(r["save_to_local"]), _s(r.get("notice_to_s3")), _s(r.get("save_to_s3")),
            _s(ratio.get("notice_to_local")), _s(ratio.get("save_to_local")),
            _s(ratio.get("notice_to_s3")),
            " / ".join(f"{b / 1e6:.0f}" for b in r["rank_bytes"]), _s(r["share_ratio"]),
            " / ".join(f"{e / 2**20:.0f}" for e in r["extra_memory"]),
            _s(r["step_seconds"]), _s(r.get("moto_mb_s"), 0)])
    nodes = [[f"{r['gb']:g}", str(r["workers"]), _s(r["on_nodes_save_to_local"]),
              _s(r.get("on_nodes_save_to_s3"))]
             for r in sorted(runs, key=lambda r: (r["gb"], r["workers"]))
             if "on_nodes_save_to_local" in r]
    figures = section["stall"]
    periodic_rows = [[kind, _s(f["quiet_step"]), _s(f["save_step"]), _s(f["stall"]),
                      str(f["saves"]), str(f["waited"]), str(f["overlapped_steps"]),
                      _s(f["extra_total"])] for kind, f in figures.items()]
    settings_ = section["settings"]
    body = [
        header(folder, results),
        f"## The notice's save: rank 0 alone against sharded (1024-wide Linear blocks, "
        f"AdamW, float32; moto S3 up to {settings_['s3_max_gb']:g} GB)",
        table(["GB", "W", "mode", "notice to local (s)", "save to local (s)",
               "notice to S3 (s)", "save to S3 (s)", "local / rank0", "save / rank0",
               "S3 / rank0", "MB written per rank", "busiest / its share",
               "extra MiB per rank", "step (s)",
               "moto MB/s"], rows),
        "Notice: rank 0's preempted.json, from SIGTERM's handler (noticed_at) to the local "
        "copy complete on every rank (local_saved_at) and to verified on S3 (saved_at). "
        "Save: from the step the ranks agreed to stop at to the same times: the notice's "
        "figure less the step in progress and the next (the vote is read a step late). "
        "Extra memory: VmHWM during the save less VmRSS before it, each rank. moto MB/s: "
        "the checkpoint's bytes over saved_at - local_saved_at (the uploads after the "
        "slowest local copy, and the manifest): one Python process, reported, "
        "not tuned. One worker is one writer whatever the mode (run once).",
        "Noise: rank 0 alone writes the same bytes on 1, 2 and 4 workers; its save to "
        "local took " + "; ".join(f"{low:.2f} to {high:.2f} s at {gb} GB" for gb, (low, high)
                                  in sorted(section["rank0_spread"].items())) + ".",
        "## On N nodes",
        "Each node its own disk and network: a sharded save is one rank's share at one "
        "writer's rate, the 1-worker rank-0 run's (bytes of the busiest rank / that run's "
        "bytes x its seconds; to S3, moto's one-writer rate). Rank 0 alone stays at the "
        "1-worker time (plus the gather over the network, not measured).",
        table(["GB", "N", "save to local (s)", "save to S3 (s)"], nodes),
        f"## (d) Periodic saves: {settings_['periodic_gb']:g} GB, 2 workers, every "
        f"{settings_['save_every']} steps, local disk, one run whose saves take turns",
        table(["kind", "quiet step (s)", "step with a save (s)", "stall (s)", "saves",
               "saves after a write in flight", "steps overlapping a write",
               "extra seconds per save"], periodic_rows),
        "Quiet steps: no save in them and no background write in flight at their end or "
        "the step before (median, both kinds). Stall: the mean of the steps that saved "
        "less a quiet step, leaving out those that first waited for a write in flight "
        "(their stall is that write's too) where others did not. Extra seconds per save: "
        "the steps from a save to the next one (or the end) less as many quiet steps, "
        "which also counts the background write "
        f"slowing the steps it overlaps. The first {WARMUP_STEPS} steps are left out."
        + ("" if "stall_ratio" not in section else
           f" A background save's stall over a blocking one's: "
           f"{section['stall_ratio']['stall']:.3f}x (extra seconds per save: "
           f"{section['stall_ratio']['extra_total']:.3f}x)."),
    ]
    if section["skipped"]:
        body += ["## Not measured", "\n".join(
            f"- {s['gb']:g} GB on {s['workers']} workers, {s['mode']}: {s['why']}"
            for s in section["skipped"])]
    body.append("The method: `benchmarks/checkpoint_scaling.py` and "
                "`benchmarks/checkpoint_ranks.py`; every run's command and figures are in "
                "`results.json`, its log, preempted.json and memory files in `runs/`.")
    return record.write_report(folder, "\n\n".join(body))
