"""`cost`: what N nodes cost per hour now, and what a run cost.

    now     $/hour per node and for N nodes, per instance type and zone, cheapest zone
            first, from the spot price history
    a run   node-hours (each node from its launch to `down`, or to now) x the spot price
            it was launched at, and the training time's share per epoch (summary.json:
            train_seconds, epochs); on-demand nodes have no price in the EC2 API
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
    state, nodes = run.state(), run.nodes()
    if not nodes:
        return [f"cost: run {run.id} has no nodes"]
    end = state.get("destroyed_at", time.time())
    hours = [max(0.0, end - n.launched_at) / 3600 for n in nodes]
    priced = [(h, n.price) for h, n in zip(hours, nodes, strict=True) if n.price is not None]
    unpriced = len(nodes) - len(priced)
    lines = [f"cost: run {run.id}: {len(nodes)} nodes, {sum(hours):.4f} node-hours"
             + ("" if "destroyed_at" in state else " so far (still up)")
             + f", {usd(sum(h * p for h, p in priced))}"
             + (f" + {unpriced} nodes without a known price" if unpriced else "")]
    summary = run.job / "summary.json"
    if summary.exists():
        s = json.loads(summary.read_text())
        train = s["train_seconds"] / 3600 * sum(p for _, p in priced)
        lines.append(f"cost: training: {s['train_seconds']:.1f} s, {s['epochs']:.3f} epochs on "
                     f"{s['world_size']} workers: {usd(train)}, {usd(train / s['epochs'])}/epoch")
    return lines
