"""`cost`: what N nodes cost per hour now, and what a run cost.

    now     $/hour per node and for N nodes, per instance type and zone, cheapest zone
            first, from the spot price history
    a run   node-hours (each node from its launch to `down`, to now, or to when it was
            lost, billed per second with a 60 s minimum) x the price it was launched at
            (spot: the spot price then; on demand: cluster.on_demand_prices); $/epoch of
            the training time alone (summary.json: train_seconds, epochs); then the
            run's ledger (launch/ledger.py), which it writes to ledger.json: every node,
            every restart with the work and dollars it lost, the totals
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from spotring.launch import ledger as ledgers
from spotring.launch.provider import Provider
from spotring.launch.rundir import RunDir


def usd(dollars: float) -> str:
    """Cents where they matter; the digits that count below a hundredth of a cent."""
    return f"${dollars:.4f}" if dollars == 0 or dollars >= 1e-4 else f"${dollars:.3g}"


def hourly(provider: Provider, count: int) -> list[str]:
    prices = provider.prices()
    if not prices:
        return [f"cost: no spot prices for {provider.name}"
                + (" (this machine: nothing is billed)" if provider.name == "local" else "")]
    lines = [f"cost: {count} nodes, spot, now (describe_spot_price_history):"]
    for instance_type, zone, price in sorted(prices, key=lambda p: (p[0], p[2], p[1])):
        lines.append(f"  {instance_type:<14} {zone:<12} {usd(price)}/node-hour, "
                     f"{usd(price * count)}/hour for {count}")
    return lines


def after_run(run: RunDir) -> list[str]:
    """The run's bill and its ledger, which this writes to the run dir anew."""
    state, billed = run.state(), run.billed()
    if not billed:
        return [f"cost: run {run.id} has no nodes"]
    ledger = ledgers.write(run)
    nodes, total = ledger["nodes"], ledger["totals"]
    retired = sum(left is not None for _, left in billed)
    lines = [f"cost: run {run.id}: {len(nodes)} nodes"
             + (f" ({retired} of them lost and replaced)" if retired else "")
             + f", {sum(n['billed_s'] for n in nodes) / 3600:.4f} node-hours"
             + ("" if "destroyed_at" in state else " so far (still up)")
             + f", {usd(total['usd'])}"
             + (f" + {total['unpriced_nodes']} nodes without a known price"
                if total["unpriced_nodes"] else "")]
    summary = run.job / "summary.json"
    if summary.exists():
        s = json.loads(summary.read_text())
        # The last try's training alone (after a restart, summary.json covers only it).
        epochs = s["epochs"] * s["steps_this_run"] / max(s["steps"], 1)
        price = sum(n["usd_per_hour"] or 0.0 for n, (_, left) in zip(nodes, billed, strict=True)
                    if left is None)
        train = s["train_seconds"] / 3600 * price
        lines.append(f"cost: training: {s['train_seconds']:.1f} s for {epochs:.3f} epochs on "
                     f"{s['world_size']} workers: {usd(train)}, {usd(train / max(epochs, 1e-9))}"
                     f"/epoch; the whole run (start-up, restarts, idle): "
                     f"{usd(total['usd'] / max(s['epochs'], 1e-9))}/epoch over "
                     f"{s['epochs']:.3f} epochs")
    return lines + ledger_lines(ledger, run.ledger)


def ledger_lines(ledger: dict, path: Path) -> list[str]:
    """The ledger (launch/ledger.py) as `spotring cost` shows it."""
    def clock(t: float | None) -> str:
        return time.strftime("%H:%M:%S", time.gmtime(t)) if t is not None else "-"

    def dollars(d: float | None) -> str:
        return usd(d) if d is not None else "unknown"

    out = [f"cost: ledger ({path}, times UTC){'' if ledger['complete'] else ', so far'}:"]
    for n in ledger["nodes"]:
        rate = (f"{usd(n['usd_per_hour'])}/hour ({n['price_from']})"
                if n["usd_per_hour"] is not None else "no known price")
        out.append(f"  node {n['id']} {n['type']} {n['zone']} {n['lifecycle']}: "
                   f"{clock(n['launched_at'])}-{clock(n['terminated_at'])}, "
                   f"{n['billed_s']:.0f} s at {rate} = {dollars(n['usd'])}"
                   + (f" + volume {usd(n['volume_usd'])}" if n["volume_gb"] else ""))
    for r in ledger["restarts"]:
        why = f" ({r['reason']})" if r["reason"] else ""
        code = f"exit {r['exit']}" if r["exit"] is not None else "ssh failed"
        notice = (f", noticed {clock(r['noticed_at'])}, checkpoint {clock(r['saved_at'])}"
                  if r["noticed_at"] is not None else "")
        redone = (f"; resumed at step {r['resumed_from']} ({r['steps_redone']} steps "
                  f"redone) after {r['waited_s']:.1f} s waiting for nodes"
                  if r["resumed_from"] is not None else "; not resumed")
        lost = (f"; {r['lost_s']:.1f} s lost, {usd(r['usd_lost'])}"
                if r["lost_s"] is not None else "")
        out.append(f"  {r['cause']} after try {r['try']}: {code}{why} at step {r['step']}"
                   f"{notice}{redone}{lost}")
    t = ledger["totals"]
    per = [f"{usd(t['usd_per_epoch'])}/epoch" if t["usd_per_epoch"] is not None else "",
           f"{usd(t['usd_per_1000_steps'])}/1000 steps"
           if t["usd_per_1000_steps"] is not None else ""]
    out.append(f"  total {usd(t['usd'])}" + (f" (volumes {usd(t['volumes_usd'])})"
                                              if t["volumes_usd"] else "")
               + (f" + {t['unpriced_nodes']} nodes without a known price"
                  if t["unpriced_nodes"] else "")
               + (f" for {t['steps']} steps" if t["steps"] is not None else "")
               + (f", {', '.join(p for p in per if p)}" if any(per) else "")
               + f"; lost to {t['preemptions']} preemptions {usd(t['usd_lost_to_preemptions'])},"
               f" to {t['failures']} failures {usd(t['usd_lost_to_failures'])}; on demand "
               + (usd(t["on_demand_usd"]) if t["on_demand_usd"] is not None
                  else "unknown (cluster.on_demand_prices lacks a type)"))
    return out
