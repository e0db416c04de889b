"""How many nodes? img/s, efficiency, time to train and cost for 1 to 256 nodes.

    spotring predict --preset horovod-resnet101 --deadline-hours 12 --price 3.06
    spotring predict --img-s 194.86 --batch 128 --gradient-mb 102.2 --link-gbit 10
    spotring predict --results reference --link-gbit 25     # r1 measured by `spotring bench`
    spotring predict --validate                              # against the published tables

The model, docs/benchmarks.md "The predictor": N workers of batch b compute in t_c = b / r1
(backward the last 2/3); G gradient bytes in k = ceil(G / bucket) ring allreduces take
T = 2(N-1) k alpha + 2(N-1)/N G / beta; all but the last bucket overlap backward, so a step
exposes t_x = max(T/k, T - t_b (k-1)/k) and takes t_c + t_x. The batch per worker is fixed
(weak scaling); the cost-optimal node count is the cheapest that meets the deadline.
"""

from __future__ import annotations

import argparse
import math
import sys
from dataclasses import dataclass, replace

import numpy as np

from spotring.benchmarks.runs import ENGINES

NODE_COUNTS = [1, 2, 4, 8, 16, 32, 64, 128, 256]
MAX_NODES = NODE_COUNTS[-1]
BACKWARD_FRACTION = 2 / 3  # backward takes about twice the forward pass
MB = 1e6


@dataclass(frozen=True)
class Scenario:
    """Everything the model needs; the defaults are ImageNet's 90-epoch schedule."""

    name: str
    batch: int  # per worker
    img_s: float  # r1: one worker computing alone
    gradient_bytes: float
    bucket_bytes: float
    latency_s: float  # alpha between nodes
    bandwidth: float  # beta between nodes, bytes/s
    gpus_per_node: int = 1
    intra_latency_s: float = 5e-6  # alpha and beta within one node (PCIe)
    intra_bandwidth: float = 10e9
    samples: int = 1_281_167
    epochs: float = 90
    price: float = 1.0  # USD per node-hour; 1.0 makes the cost read as node-hours
    source: str = ""


def ring_allreduce_seconds(nbytes: float, ranks: int, latency_s: float, bandwidth: float,
                           messages: int = 1) -> float:
    """alpha-beta time of ``messages`` ring allreduces that together carry ``nbytes``."""
    if ranks == 1:
        return 0.0
    return messages * 2 * (ranks - 1) * latency_s + 2 * (ranks - 1) / ranks * nbytes / bandwidth


def predict(s: Scenario, nodes: int) -> dict:
    """img/s, efficiency, the step's compute and exposed communication, time and cost of
    training on ``nodes`` nodes."""
    workers = nodes * s.gpus_per_node
    compute = s.batch / s.img_s
    latency, bandwidth = ((s.latency_s, s.bandwidth) if nodes > 1
                          else (s.intra_latency_s, s.intra_bandwidth))
    k = max(1, math.ceil(s.gradient_bytes / s.bucket_bytes))
    total = ring_allreduce_seconds(s.gradient_bytes, workers, latency, bandwidth, k)
    backward = BACKWARD_FRACTION * compute
    exposed = max(total / k, total - backward * (k - 1) / k)
    step = compute + exposed
    img_s = workers * s.batch / step
    hours = s.samples * s.epochs / img_s / 3600
    return {"nodes": nodes, "workers": workers, "img_s": img_s, "efficiency": compute / step,
            "compute_ms": 1e3 * compute, "communication_ms": 1e3 * exposed,
            "hours": hours, "node_hours": nodes * hours, "cost": nodes * hours * s.price}


def cost_optimal(s: Scenario, deadline_hours: float, max_nodes: int = MAX_NODES) -> dict | None:
    """The cheapest node count (1..max_nodes) that trains within the deadline, or None."""
    fits = [p for p in (predict(s, n) for n in range(1, max_nodes + 1))
            if p["hours"] <= deadline_hours]
    return min(fits, key=lambda p: (p["cost"], p["hours"])) if fits else None


def fit_alpha_beta(rows: list[dict], ranks: int) -> tuple[float, float]:
    """alpha and beta of ring_allreduce_seconds fitted to measured (bytes, seconds), by
    least squares on relative error (sizes span five decades; each counts alike)."""
    size = np.array([r["bytes"] for r in rows], dtype=float)
    seconds = np.array([r["seconds"] for r in rows], dtype=float)
    # seconds = a + c x bytes, with a = 2(n-1) alpha and c = 2(n-1)/n / beta.
    design = np.stack([1 / seconds, size / seconds], axis=1)
    (a, c), *_ = np.linalg.lstsq(design, np.ones_like(seconds), rcond=None)
    a, c = max(a, 0.0), max(c, 1e-15)
    return a / (2 * (ranks - 1)), 2 * (ranks - 1) / ranks / c


PRESETS = {
    # 1 P100 per node; the talk gives neither batch nor bucket: MXNet's train_imagenet.py
    # default batch (128) and its kvstore's slicing of large arrays (about 4 MB).
    "chameleon-resnet50": Scenario(
        "Chameleon Cloud talk: MXNet ResNet-50, 1 P100 per node, 10 GbE", batch=128,
        img_s=194.86, gradient_bytes=25_557_032 * 4, bucket_bytes=4 * MB,
        latency_s=50e-6, bandwidth=10e9 / 8,
        source="the talk's 1-GPU img/s; MXNet defaults; Chameleon's 10 Gbit/s Ethernet"),
    # r1 from the same page's tf_cnn_benchmarks example (1656.82 img/s on 16 GPUs); a flat
    # ring crosses each server's NIC once each way, so the 25 Gbit/s NIC is its slowest link.
    "horovod-resnet101": Scenario(
        "Horovod benchmark: TensorFlow ResNet-101, 4 Pascal GPUs per server, 25 GbE RoCE",
        batch=64, img_s=1656.82 / 16, gradient_bytes=44_549_160 * 4, bucket_bytes=64 * 2**20,
        latency_s=10e-6, bandwidth=25e9 / 8, gpus_per_node=4,
        source="horovod docs/benchmarks.rst; fusion threshold 64 MB (Horovod < 0.21)"),
}

PUBLISHED = [  # (preset, nodes, what, published value)
    ("chameleon-resnet50", 1, "img_s", 194.86),
    ("chameleon-resnet50", 2, "img_s", 389.81),
    ("chameleon-resnet50", 8, "img_s", 1466.31),
    ("horovod-resnet101", 128, "efficiency", 0.90),
]


def validate_published() -> list[dict]:
    """Every published figure against the prediction of its preset."""
    rows = []
    for case, nodes, what, value in PUBLISHED:
        predicted = predict(PRESETS[case], nodes)[what]
        rows.append({"case": case, "nodes": nodes, "what": what, "published": value,
                     "predicted": predicted, "error": predicted / value - 1,
                     "source": PRESETS[case].source})
    return rows


# ---------------------------------------------------------------- this machine, measured


def transport_of(results: dict, engine: str) -> str:
    """The allreduce an engine's gradients take in a run: NCCL for engine=ddp on GPUs."""
    if engine == "ddp" and results["machine"]["gpus"]:
        return "nccl"
    return ENGINES[engine].transport


def machine_scenario(results: dict, engine: str, batch: int) -> Scenario:
    """A bench run's machine: r1 of one worker alone (the 1-worker run of the same program
    and batch), alpha and beta fitted to the engine's transport between the run's ranks
    (for one node and between nodes alike: override the latter with --link-gbit), the
    gradient of the run's model and the engine's bucket."""
    throughput, allreduce = results["throughput"], results["allreduce"]
    program = ENGINES[engine].program
    one = next(r for r in throughput["rows"] if r["workers"] == 1 and r["batch"] == batch
               and ENGINES[r["engine"]].program == program)
    latency, bandwidth = fit_alpha_beta(allreduce["transports"][transport_of(results, engine)],
                                        allreduce["ranks"])
    return Scenario(f"{results['machine']['cpu']}: {throughput['workload']}, {engine}", batch,
                    one["per_worker"]["mean"], throughput["gradient_bytes"],
                    ENGINES[engine].bucket_bytes, latency, bandwidth,
                    intra_latency_s=latency, intra_bandwidth=bandwidth,
                    samples=throughput["train_samples"], epochs=1,
                    source=f"{transport_of(results, engine)} allreduce fit, 1-worker img/s")


def validate_machine(results: dict) -> list[dict]:
    """Every measured multi-worker configuration of a bench run against its prediction
    from the run's own 1-worker and allreduce figures (one worker per node)."""
    rows = []
    measured = results["allreduce"]["transports"]
    for row in results["throughput"]["rows"]:
        if row["workers"] == 1 or transport_of(results, row["engine"]) not in measured:
            continue
        s = machine_scenario(results, row["engine"], row["batch"])
        p = predict(s, row["workers"])
        rows.append({"engine": row["engine"], "workers": row["workers"], "batch": row["batch"],
                     "measured": row["total"]["mean"], "predicted": p["img_s"],
                     "error": p["img_s"] / row["total"]["mean"] - 1, "img_s_1": s.img_s,
                     "communication_ms": p["communication_ms"],
                     "latency_us": s.latency_s * 1e6, "bandwidth_gbps": s.bandwidth / 1e9})
    return rows


# ----------------------------------------------------------------------- command line


def _table(s: Scenario, deadline: float | None) -> str:
    lines = [
        s.name,
        f"  batch {s.batch} per worker, {s.img_s:.1f} img/s per worker computing (r1), "
        f"gradient {s.gradient_bytes / MB:.1f} MB in buckets of {s.bucket_bytes / MB:.1f} MB, "
        f"{s.gpus_per_node} worker(s) per node",
        f"  network: alpha {s.latency_s * 1e6:.1f} us, beta {s.bandwidth * 8 / 1e9:.2f} Gbit/s;"
        f" {s.samples} samples x {s.epochs:g} epochs; ${s.price:.2f} per node-hour", "",
        f"{'nodes':>6} {'img/s':>10} {'eff':>6} {'compute ms':>11} {'comm ms':>8} "
        f"{'hours':>9} {'node-hours':>11} {'cost $':>10}"]
    optimum = cost_optimal(s, deadline) if deadline else None
    for n in sorted(set(NODE_COUNTS) | ({optimum["nodes"]} if optimum else set())):
        p = predict(s, n)
        mark = "  <- cost-optimal" if optimum and n == optimum["nodes"] else ""
        lines.append(f"{n:>6} {p['img_s']:>10.1f} {p['efficiency']:>6.1%} "
                     f"{p['compute_ms']:>11.1f} {p['communication_ms']:>8.1f} {p['hours']:>9.2f} "
                     f"{p['node_hours']:>11.1f} {p['cost']:>10.2f}{mark}")
    if optimum:
        lines.append(f"\ncost-optimal for a {deadline:g} h deadline: {optimum['nodes']} nodes, "
                     f"{optimum['hours']:.2f} h, ${optimum['cost']:.2f}")
    elif deadline:
        fastest = max((predict(s, n) for n in range(1, MAX_NODES + 1)), key=lambda p: p["img_s"])
        lines.append(f"\nno node count up to {MAX_NODES} meets {deadline:g} h; the fastest is "
                     f"{fastest['nodes']} nodes at {fastest['hours']:.2f} h")
    return "\n".join(lines)


def _validation(rows: list[dict]) -> str:
    lines = [f"{'case':<20} {'nodes':>5} {'what':>10} {'published':>10} {'predicted':>10} "
             f"{'error':>7}"]
    lines += [f"{r['case']:<20} {r['nodes']:>5} {r['what']:>10} {r['published']:>10.4g} "
              f"{r['predicted']:>10.4g} {r['error']:>+7.1%}" for r in rows]
    return "\n".join(lines)


def positive(text: str) -> float:
    """argparse's type for a number above 0."""
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"{text}: must be a number above 0")
    return value


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="spotring predict", description=__doc__.splitlines()[0],
                                epilog="The model: docs/benchmarks.md.")
    source = p.add_mutually_exclusive_group()
    source.add_argument("--preset", choices=list(PRESETS), help="a published benchmark")
    source.add_argument("--results", metavar="RUN", help="r1, gradient and allreduce from a "
                        "`spotring bench` run (a name under the results folder, a path, latest)")
    source.add_argument("--validate", action="store_true",
                        help="the published figures against their predictions, and exit")
    p.add_argument("--engine", default="ddp", choices=list(ENGINES), help="with --results")
    p.add_argument("--img-s", type=positive, help="img/s of one worker computing alone (r1)")
    p.add_argument("--batch", type=int, help="per worker (default 64; --results: its batch)")
    p.add_argument("--gradient-mb", type=positive, help="MB of gradients per step")
    p.add_argument("--bucket-mb", type=positive, default=25.0,
                   help="gradient bytes per allreduce (DDP's bucket_cap_mb, Horovod's fusion)")
    p.add_argument("--link-gbit", type=positive, help="network bandwidth between nodes")
    p.add_argument("--latency-us", type=positive, help="per message between nodes (default 50)")
    p.add_argument("--gpus-per-node", type=int, help="workers per node (default 1)")
    p.add_argument("--samples", type=int, help="per epoch (default: ImageNet's 1,281,167)")
    p.add_argument("--epochs", type=positive, help="default 90")
    p.add_argument("--price", type=positive, help="USD per node-hour (default 1: node-hours)")
    p.add_argument("--deadline-hours", type=positive, help="name the cheapest node count "
                   "that trains within this many hours")
    return p


def _scenario(p: argparse.ArgumentParser, args: argparse.Namespace) -> Scenario:
    if args.preset:
        return PRESETS[args.preset]
    if args.results:
        from spotring.benchmarks import record

        try:
            results = record.load(record.find(args.results))
        except FileNotFoundError as e:
            p.error(str(e))
        if "throughput" not in results or "allreduce" not in results:
            p.error(f"--results {args.results}: has no throughput and allreduce sections; "
                    "run `spotring bench` with both")
        batches = sorted({r["batch"] for r in results["throughput"]["rows"]})
        batch = args.batch or batches[0]
        engines = sorted({r["engine"] for r in results["throughput"]["rows"]})
        if batch not in batches or args.engine not in engines:
            p.error(f"--results {args.results} measured batch {batches} and engines {engines}; "
                    f"not batch {batch} with --engine {args.engine}")
        s = machine_scenario(results, args.engine, batch)
        network = {"latency_s": (args.latency_us or s.latency_s * 1e6) * 1e-6,
                   "bandwidth": args.link_gbit * 1e9 / 8 if args.link_gbit else s.bandwidth}
        return replace(s, **network)
    missing = [f"--{k.replace('_', '-')}" for k in ("img_s", "gradient_mb", "link_gbit")
               if getattr(args, k) is None]
    if missing:
        p.error(f"missing {', '.join(missing)}: give --preset ({', '.join(PRESETS)}), "
                "--results RUN, or --img-s, --gradient-mb and --link-gbit")
    return Scenario("given", args.batch or 64, args.img_s, args.gradient_mb * MB,
                    args.bucket_mb * MB, (args.latency_us or 50) * 1e-6,
                    args.link_gbit * 1e9 / 8, source="the command line")


def main(argv: list[str] | None = None) -> int:
    """spotring predict: print the table for 1 to 256 nodes (exit 2 on bad input)."""
    p = parser()
    args = p.parse_args(argv)
    for name in ("batch", "gpus_per_node", "samples"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} {getattr(args, name)}: must be 1 or more")
    if args.validate:
        print(_validation(validate_published()))
        return 0
    s = _scenario(p, args)
    overrides = {k: v for k, v in {"gpus_per_node": args.gpus_per_node, "samples": args.samples,
                                   "epochs": args.epochs, "price": args.price}.items()
                 if v is not None}
    print(_table(replace(s, **overrides), args.deadline_hours))
    return 0


if __name__ == "__main__":
    sys.exit(main())
