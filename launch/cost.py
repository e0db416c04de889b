"""`cost`: what N nodes cost per hour now, and what a run cost.

    now     $/hour per node and for N nodes, per instance type and zone, cheapest zone
            first, from the spot price history
    a run   node-hours (each node from its launch to `down`, to now, or to when it was
            lost) x the spot price it was launched at; $/epoch of the training time
            alone (summary.json: train_seconds, epochs) and of the whole run; on-demand
            nodes have no price in the EC2 API
"""

from __future__ import annotations

import json
import time

from launch.provider import Provider
from launch.rundir import RunDir


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
    state, billed = run.state(), run.billed()
    if not billed:
        return [f"cost: run {run.id} has no nodes"]
    end = state.get("destroyed_at", time.time())
    hours = [max(0.0, (left or end) - n.launched_at) / 3600 for n, left in billed]
    priced = [h * n.price for h, (n, _) in zip(hours, billed, strict=True) if n.price is not None]
    unpriced, retired = len(billed) - len(priced), sum(left is not None for _, left in billed)
    total = sum(priced)
    lines = [f"cost: run {run.id}: {len(billed)} nodes"
             + (f" ({retired} of them lost and replaced)" if retired else "")
             + f", {sum(hours):.4f} node-hours"
             + ("" if "destroyed_at" in state else " so far (still up)")
             + f", {usd(total)}"
             + (f" + {unpriced} nodes without a known price" if unpriced else "")]
    summary = run.job / "summary.json"
    if summary.exists():
        s = json.loads(summary.read_text())
        # The last try's training alone (after a restart, summary.json covers only it).
        epochs = s["epochs"] * s["steps_this_run"] / max(s["steps"], 1)
        price = sum(n.price for n, left in billed if left is None and n.price is not None)
        train = s["train_seconds"] / 3600 * price
        lines.append(f"cost: training: {s['train_seconds']:.1f} s for {epochs:.3f} epochs on "
                     f"{s['world_size']} workers: {usd(train)}, {usd(train / max(epochs, 1e-9))}"
                     f"/epoch; the whole run (start-up, restarts, idle): "
                     f"{usd(total / max(s['epochs'], 1e-9))}/epoch over {s['epochs']:.3f} epochs")
    return lines
