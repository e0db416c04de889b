"""A run's bill, node by node and restart by restart: runs/launch/<run id>/ledger.json,
written at the end of `launch`, by `down` (which sets the termination times) and by
`cost`, which shows it. Built from the run dir alone: state.json (the nodes, those lost,
the tries of launch/tries.py), launch.yaml (the prices below) and job/summary.json.

    nodes      each node the run had: type, zone, lifecycle, launched_at and
               terminated_at (`down`, or when the launcher found it lost; null: still
               up, billed until now), its $/hour and where that came from, the seconds
               billed and their dollars, its volume's dollars
    restarts   each restart, with its cause (preemption or failure), the trainer's
               notice and checkpoint times, the step reached and the step the next try
               resumed at (the difference: steps redone), the wait for a replacement
               (from the try's end to the next try's start), and the time and dollars
               lost: from the try's last train record until a later try got back to
               its step, at the $/hour of the try's nodes
    totals     dollars for the run (instances and volumes), per epoch and per 1,000
               steps, lost to preemptions and to failures, and what the same node-seconds
               would have cost on demand
    in_place   a job in place (job.launcher=in_place): each node it lost or restarted a
               process on (state.json's: when, which, why, its replacement), and each
               change of workers the job made without stopping (job/summary.json's: the
               step, why, the workers before and after, the seconds it cost the job),
               with their sum; null for other launchers
    data_reads the GET requests and bytes each rank read from a store's shards
               (spotring.Shards, dataset=shards), per epoch: job/summary.json's, so the
               last try's; null where the job read none or has no summary

Prices: a spot node's is the spot price in its zone when it launched (EC2's spot price
history; the price can move while it runs, the ledger keeps the launch price); an
on-demand node's is cluster.on_demand_prices of its type (list prices in
conf/cluster/aws_spot.yaml; the EC2 API has none); a local node's is cluster.price
(default 0: this machine bills nothing). Billing is EC2's for Linux: per whole second
(a second begun is billed) with a 60-second minimum per instance, and likewise for each
node's gp3 volume (cluster.volume_gb at cluster.volume_usd_per_gb_month, a month being
730 hours).
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import asdict

from omegaconf import OmegaConf

from spotring.launch.provider import Node
from spotring.launch.rundir import RunDir, write_json

MINIMUM_S = 60  # EC2's minimum charge per instance (and per volume), per-second after
HOURS_PER_MONTH = 730.0  # AWS's month for prorating GB-month prices


def build(run: RunDir, now: float | None = None) -> dict:
    """The run's ledger as of ``now`` (default: this moment)."""
    now = time.time() if now is None else now
    state = run.state()
    cluster = OmegaConf.load(run.config).cluster
    on_demand = dict(OmegaConf.select(cluster, "on_demand_prices", default={}) or {})
    volume_gb = OmegaConf.select(cluster, "volume_gb", default=0)
    volume_rate = OmegaConf.select(cluster, "volume_usd_per_gb_month", default=0.0)
    down_at = state.get("destroyed_at")
    nodes = [_node(node, left or down_at, now, on_demand, volume_gb, volume_rate)
             for node, left in run.billed()]
    prices = {n["id"]: n["usd_per_hour"] for n in nodes}
    restarts = _restarts(run.tries(), prices)
    return {"run_id": run.id, "cluster": cluster.name, "complete": down_at is not None,
            "as_of": now, "nodes": nodes, "restarts": restarts,
            "totals": _totals(nodes, restarts, _progress(run)),
            "in_place": _in_place(state, _summary(run)),
            "data_reads": _summary(run).get("data_reads")}


def write(run: RunDir) -> dict:
    """Build the ledger and write it to the run dir, atomically."""
    ledger = build(run)
    write_json(run.ledger, ledger)
    return ledger


def _node(node: Node, end: float | None, now: float, on_demand: dict[str, float],
          volume_gb: int, volume_rate: float) -> dict:
    billed = max(MINIMUM_S, math.ceil((end or now) - node.launched_at))
    price, source = node.price, "the spot price at launch"
    if node.lifecycle == "local":
        source = "cluster.price"
    elif node.lifecycle == "on-demand":  # the provider has no on-demand price
        price, source = on_demand.get(node.type), "cluster.on_demand_prices"
    volume_usd = volume_gb * volume_rate / HOURS_PER_MONTH * billed / 3600
    return {**{k: v for k, v in asdict(node).items() if k in ("id", "type", "zone", "lifecycle",
                                                              "launched_at")},
            "terminated_at": end, "billed_s": billed, "usd_per_hour": price,
            "price_from": source if price is not None else None,
            "usd": None if price is None else price * billed / 3600,
            "volume_gb": volume_gb, "volume_usd": volume_usd,
            "on_demand_usd_per_hour": on_demand.get(node.type)}


def _restarts(tries: list[dict], prices: dict[str, float | None]) -> list[dict]:
    restarts = []
    for i, t in enumerate(tries):
        if not t["restart"]:
            continue
        after = tries[i + 1] if i + 1 < len(tries) else None
        since, step = (t["last_record"][1], t["last_record"][0]) if t["last_record"] else (
            t["ended_at"], t["step"])
        # Until a later try reached the step again; else all of the next try caught up.
        back = t.get("back_at") or (after["ended_at"] if after else None)
        lost_s = None if back is None else max(0.0, back - since)
        hourly = sum(prices.get(n) or 0.0 for n in t["nodes"])
        restarts.append({
            "try": i + 1, "cause": t["restart"], "exit": t["exit"], "reason": t["reason"],
            "lost_nodes": t["lost"], "step": t["step"], "noticed_at": t["noticed_at"],
            "saved_at": t["saved_at"], "checkpoint": t["checkpoint"], "ended_at": t["ended_at"],
            "resumed_from": after["resumed_from"] if after else None,
            "steps_redone": max(0, t["step"] - after["resumed_from"]) if after else None,
            "waited_s": after["started_at"] - t["ended_at"] if after else None,
            "lost_s": lost_s, "back_at_step": step if back is not None else None,
            "usd_lost": None if lost_s is None else hourly * lost_s / 3600})
    return restarts


def _in_place(state: dict, summary: dict) -> dict | None:
    """What the job in place lost and how it went on (None: not a job in place)."""
    if "in_place" not in state and not summary.get("in_place"):
        return None
    changes = summary.get("in_place") or []
    return {"nodes": state.get("in_place", []), "changes": changes,
            "seconds_lost": sum(c["seconds"] for c in changes)}


def _summary(run: RunDir) -> dict:
    """The job's summary.json ({} before a try finished)."""
    summary = run.job / "summary.json"
    return json.loads(summary.read_text()) if summary.exists() else {}


def _progress(run: RunDir) -> tuple[int | None, float | None]:
    """(steps, epochs) the run reached: summary.json of a finished run, else the last
    try's step (epochs unknown)."""
    if s := _summary(run):
        return s["steps"], s["epochs"]
    tries = run.tries()
    return (tries[-1]["step"] if tries else None), None


def _totals(nodes: list[dict], restarts: list[dict],
            progress: tuple[int | None, float | None]) -> dict:
    instances = sum(n["usd"] for n in nodes if n["usd"] is not None)
    volumes = sum(n["volume_usd"] for n in nodes)
    usd = instances + volumes
    steps, epochs = progress
    on_demand = [n["on_demand_usd_per_hour"] * n["billed_s"] / 3600 for n in nodes
                 if n["on_demand_usd_per_hour"] is not None]

    def lost(cause: str) -> float:
        return sum(r["usd_lost"] or 0.0 for r in restarts if r["cause"] == cause)

    return {
        "usd": usd, "instances_usd": instances, "volumes_usd": volumes,
        "unpriced_nodes": sum(n["usd"] is None for n in nodes),
        "steps": steps, "epochs": epochs,
        "usd_per_epoch": usd / epochs if epochs else None,
        "usd_per_1000_steps": usd / steps * 1000 if steps else None,
        "preemptions": sum(r["cause"] == "preemption" for r in restarts),
        "failures": sum(r["cause"] == "failure" for r in restarts),
        "usd_lost_to_preemptions": lost("preemption"),
        "usd_lost_to_failures": lost("failure"),
        # Every node on demand for the same seconds, where each type has a known price.
        "on_demand_usd": sum(on_demand) + volumes if len(on_demand) == len(nodes) else None,
    }
