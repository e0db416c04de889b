"""How many nodes? img/s, efficiency, time to train and cost for 1 to 256 nodes.

    python -m benchmarks.predict --preset horovod-resnet101 --deadline-hours 12
    python -m benchmarks.predict --img-s 194.86 --batch 128 --gradient-mb 102.2 \
        --link-gbit 10 --latency-us 50 --samples 1281167 --epochs 90 --price 0.9
    python -m benchmarks.predict --results latest     # this machine, from `make bench`
    python -m benchmarks.predict --measure            # this machine, measured now (~1 min)
    python -m benchmarks.predict --validate           # the published figures, and errors

The model (alpha-beta, ring allreduce; Thakur et al. 2005, Patarasuk & Yuan 2009).
Every step, each of the N = nodes x gpus_per_node workers

    computes      t_c = batch / (r1 s)         r1: img/s of one worker computing
                                               s: the share of its compute cores it
                                               keeps (below)
                  t_b = 2/3 t_c                backward is about twice the forward pass
    averages the G gradient bytes in k = ceil(G / bucket) ring allreduces, each of
                  2(N-1) messages (reduce-scatter, then all-gather):
                  T = k 2(N-1) alpha + 2(N-1)/N G / beta
                  alpha: latency per message; beta: bytes/s of the slowest link of the
                  ring: the network between nodes, the host's own links with one node
    overlaps      bucket i leaves when backward has made it and the link is free; with
                  buckets made evenly over t_b the last one ends at
                  t_b + max(T/k, T - t_b (k-1)/k), so a step exposes
                  t_x = max(T/k, T - t_b (k-1)/k)    (one bucket: no overlap at all)
    waits         for the slowest worker, as every synchronous step does: with step
                  times of standard deviation sigma = jitter x t_c, the slowest of N is
                  sigma e_N late, e_N = E[max of N standard normals] (0, 0.56, 1.03,
                  1.42, 2.59, 3.04 for N = 1, 2, 4, 8, 128, 512)
    and pays      c 2(N-1) alpha for c other blocking small allreduces per step (the
                  trainer's spot-notice vote where it blocks, summed at once over MPI
                  by engine=ddp engine.backend=mpi: c = 1; over Gloo and Horovod it is
                  sent at a step's end and read a step later, while the next step
                  computes: c = 0; the plain loop: 0)
    and wakes     the transport's threads, which slept through the compute: t_w, what
                  an allreduce of the gradient after compute takes over a back-to-back
                  one (measured, benchmarks/allreduce_ranks.py; 0 where not measured)
    and lends     the compute the CPU of the m allreduces it sends while it computes,
                  t_r each, where the transport's threads share its cores (below):
                  the gradient's before its last (k - 1 buckets; Horovod: one per
                  gradient tensor, below) and the vote where it does not block
    takes         t_step = t_c + sigma e_N + t_x + c 2(N-1) alpha + t_w + m t_r
                  img/s = N batch / t_step;  efficiency = batch / r1 / t_step

Shared cores. Where the workers compute on CPU cores, the engine's own background threads
run on the same cores: Horovod's negotiation cycle wakes every HOROVOD_CYCLE_TIME (1 ms)
whether or not a tensor is ready. A worker given c cores for its `threads` compute
threads, whose engine takes h cores in the background, keeps s = min(1, (c - h) /
threads) of them. h is measured, not fitted: the CPU a transport's threads take from a
program that keeps every core of the host computing (benchmarks/allreduce_ranks.py), or
from the engine's own training runs where those took less, or always where the engine's
thread spins (Horovod over MPI; this_machine.background_cores).
On GPUs, and where cores are spare, s = 1.

An allreduce sent during backward hides its latency there (t_x), but on shared cores
not its CPU: t_r, what one more allreduce sent while a program computes takes from it,
measured beside h by the same program (allreduce_ranks.py; its bursts without sends give
h). Here: Gloo 0.80 ms, Horovod over Gloo 0.35 ms (reference run). Over MPI, Horovod's
thread spins through every cycle whether or not a tensor is ready, and a tensor's
transfer is spent inside that spin: t_r = 0 there, and h comes from its training runs,
which count the sends (this_machine.SPINS; the bursts read 0.35-1.05 ms over MPI, which
training did not show). Horovod negotiates every
gradient tensor and fuses only those ready in the same cycle: the model sends each on
its own (m = tensors - 1 + the vote; an upper bound: the MNIST convnet's 8 went in 5.9
responses a step in Horovod's timeline). Inside one job at batch 32 / 64 / 128,
Horovod over Gloo's gradients sent as backward makes them added 5.2 / 5.2 / 6.7 ms to a
step, the same gradients sent at once after backward 2.6 / 2.5 / 4.2 ms: sending early
cost more than it hid. A worker with a whole spare core (c - threads >= 1), and a GPU
worker, lends nothing: t_r = 0. t_r = 0 too where it was not measured (results from
before it was; MPI's blocking calls, which are the compute's own thread).

Time to train = samples x epochs / img/s; cost = nodes x hours x price per node-hour.
The cost-optimal node count for a deadline is the cheapest that finishes in time.
Batch per worker is fixed (weak scaling, as Horovod benchmarks): the global batch grows
with N and the learning rate with it (the linear scaling rule).

Validation (--validate; tests/test_predict.py checks the 10%):

    Chameleon Cloud talk, MXNet ResNet-50, synthetic data, 1 GPU per node, SSH between
    nodes: 194.86, 389.81, 1466.31 img/s on 1, 2, 8 GPUs. Parameters: r1 = 194.86 (the
    talk's 1-GPU figure); batch 128 per GPU (MXNet's train_imagenet.py default: the talk
    does not say; with batch 32 the model predicts 8 GPUs 17% low, so the near-linear
    figure implies a large batch); G = 25,557,032 parameters x 4 B; bucket 4 MB
    (MXNet's kvstore sends each gradient, arrays over 10^6 values in slices, as backward
    makes them); 10 Gbit/s Ethernet (Chameleon's nodes) with alpha = 50 us (TCP).
    Horovod, docs/benchmarks.rst: 90% scaling efficiency for ResNet-101 on 128 servers
    x 4 Pascal GPUs over RoCE-capable 25 Gbit/s. Parameters: batch 64 and r1 = 1656.82
    / 16 = 103.6 img/s per GPU (the same page's tf_cnn_benchmarks ResNet-101 example);
    G = 44,549,160 x 4 B; bucket 64 MB (HOROVOD_FUSION_THRESHOLD's default until 0.21);
    beta = 25 Gbit/s, alpha = 10 us (RDMA; a flat NCCL ring crosses each node's NIC
    once each way per step, so the NIC is the ring's slowest link).
    Both GPU cases: jitter 1% (an assumption: a GPU's step time varies by about that
    in synthetic benchmarks; with 0 every figure is still within 10%, see the tests),
    c = 0 (the benchmarks run nothing but the gradient allreduces).
    This machine: benchmarks/this_machine.py.
"""

from __future__ import annotations

import argparse
import functools
import math
from dataclasses import dataclass, replace

import numpy as np

NODE_COUNTS = [1, 2, 4, 8, 16, 32, 64, 128, 256]
BACKWARD_FRACTION = 2 / 3
MB = 1e6


@dataclass(frozen=True)
class Scenario:
    """Everything the model needs; the defaults are ImageNet's 90-epoch schedule."""

    name: str
    batch: int  # per worker
    img_s: float  # r1: one worker computing
    gradient_bytes: float
    bucket_bytes: float
    latency_s: float  # alpha between nodes
    bandwidth: float  # beta between nodes, bytes/s
    gpus_per_node: int = 1
    jitter: float = 0.01  # standard deviation of a worker's step time / its mean
    collectives: int = 0  # other blocking small allreduces per step
    compute_share: float = 1.0  # s: of its compute cores, what a worker keeps
    wakeup_s: float = 0.0  # t_w: a cold gradient allreduce over a back-to-back one
    sent_while_computing: int = 0  # m: allreduces sent while a worker computes
    sent_cpu_s: float = 0.0  # t_r: the CPU each takes from its compute
    intra_latency_s: float = 5e-6  # alpha and beta inside one node (PCIe)
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


@functools.cache  # predict() asks for it once per node count: 256 times for a table
def expected_max_of_normals(n: int) -> float:
    """E[max of n independent standard normal draws]: how many standard deviations the
    slowest of n workers is behind the mean (numerical integration)."""
    if n == 1:
        return 0.0
    x = np.linspace(-12.0, 12.0, 48001)
    pdf = np.exp(-x * x / 2) / math.sqrt(2 * math.pi)
    cdf = 0.5 * (1 + np.vectorize(math.erf)(x / math.sqrt(2)))
    return float(np.trapezoid(x * n * pdf * cdf ** (n - 1), x))


def step_seconds(s: Scenario, nodes: int) -> dict[str, float]:
    """One step on ``nodes`` nodes: compute, waiting for the slowest worker, and the
    exposed communication (gradients after overlap, and the other collectives)."""
    workers = nodes * s.gpus_per_node
    compute = s.batch / (s.img_s * s.compute_share)
    latency, bandwidth = ((s.latency_s, s.bandwidth) if nodes > 1
                          else (s.intra_latency_s, s.intra_bandwidth))
    k = max(1, math.ceil(s.gradient_bytes / s.bucket_bytes))
    total = ring_allreduce_seconds(s.gradient_bytes, workers, latency, bandwidth, k)
    backward = BACKWARD_FRACTION * compute
    exposed = max(total / k, total - backward * (k - 1) / k)
    others = ring_allreduce_seconds(0, workers, latency, bandwidth, s.collectives)
    wakeup, lent = ((s.wakeup_s, s.sent_while_computing * s.sent_cpu_s) if workers > 1
                    else (0.0, 0.0))
    return {"compute": compute, "wait": s.jitter * compute * expected_max_of_normals(workers),
            "communication": exposed + others + wakeup + lent}


def predict(s: Scenario, nodes: int) -> dict:
    t = step_seconds(s, nodes)
    step = sum(t.values())
    workers = nodes * s.gpus_per_node
    img_s = workers * s.batch / step
    hours = s.samples * s.epochs / img_s / 3600
    return {"nodes": nodes, "workers": workers, "img_s": img_s,
            "efficiency": s.batch / s.img_s / step, "compute_ms": 1e3 * t["compute"],
            "wait_ms": 1e3 * t["wait"], "communication_ms": 1e3 * t["communication"],
            "hours": hours, "node_hours": nodes * hours, "cost": nodes * hours * s.price}


def cost_optimal(s: Scenario, deadline_hours: float, max_nodes: int = 256) -> dict | None:
    """The cheapest node count (1..max_nodes) that trains within the deadline, or None."""
    fits = [p for p in map(lambda n: predict(s, n), range(1, max_nodes + 1))
            if p["hours"] <= deadline_hours]
    return min(fits, key=lambda p: (p["cost"], p["hours"])) if fits else None


def compute_share(cores_per_worker: float, threads: int, background_cores: float) -> float:
    """s: the share of its ``threads`` compute cores a worker keeps when it has
    ``cores_per_worker`` cores and its engine's threads take ``background_cores``."""
    return max(0.0, min(1.0, (cores_per_worker - background_cores) / threads))


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
    "chameleon-resnet50": Scenario(
        "Chameleon Cloud talk: MXNet ResNet-50, 1 P100 per node, 10 GbE", batch=128,
        img_s=194.86, gradient_bytes=25_557_032 * 4, bucket_bytes=4 * MB,
        latency_s=50e-6, bandwidth=10e9 / 8,
        source="the talk's 1-GPU img/s; MXNet defaults; Chameleon's 10 Gbit/s Ethernet"),
    "horovod-resnet101": Scenario(
        "Horovod benchmark: TensorFlow ResNet-101, 4 Pascal GPUs per server, 25 GbE RoCE",
        batch=64, img_s=1656.82 / 16, gradient_bytes=44_549_160 * 4, bucket_bytes=64 * 2**20,
        latency_s=10e-6, bandwidth=25e9 / 8, gpus_per_node=4,
        source="horovod docs/benchmarks.rst; fusion threshold 64 MB (Horovod < 0.21)"),
}

PUBLISHED = [  # (preset, nodes, what, published value, source)
    ("chameleon-resnet50", 1, "img_s", 194.86, "Chameleon Cloud talk, MXNet ResNet-50"),
    ("chameleon-resnet50", 2, "img_s", 389.81, "Chameleon Cloud talk, MXNet ResNet-50"),
    ("chameleon-resnet50", 8, "img_s", 1466.31, "Chameleon Cloud talk, MXNet ResNet-50"),
    ("horovod-resnet101", 128, "efficiency", 0.90,
     "Horovod docs/benchmarks.rst: 128 servers x 4 Pascal GPUs, 25 Gbit/s RoCE"),
]


def validate_published() -> list[dict]:
    rows = []
    for preset, nodes, what, published, source in PUBLISHED:
        predicted = predict(PRESETS[preset], nodes)[what]
        rows.append({"case": preset, "nodes": nodes, "what": what, "published": published,
                     "predicted": predicted, "error": predicted / published - 1,
                     "source": source})
    return rows



# ------------------------------------------------------------------------------- CLI


def _print_table(s: Scenario, deadline: float | None) -> None:
    print(f"{s.name}\n"
          f"  batch {s.batch} per worker, {s.img_s:.1f} img/s per worker computing (r1), "
          f"gradient {s.gradient_bytes / MB:.1f} MB in buckets of {s.bucket_bytes / MB:.1f} MB, "
          f"{s.gpus_per_node} worker(s) per node\n"
          f"  network: alpha {s.latency_s * 1e6:.1f} us, beta {s.bandwidth * 8 / 1e9:.2f} Gbit/s;"
          f" {s.samples} samples x {s.epochs:g} epochs; ${s.price:.2f} per node-hour\n")
    print(f"{'nodes':>6} {'img/s':>10} {'eff':>6} {'compute ms':>11} {'comm ms':>8} "
          f"{'hours':>9} {'node-hours':>11} {'cost $':>10}")
    optimum = cost_optimal(s, deadline) if deadline else None
    counts = sorted(set(NODE_COUNTS) | ({optimum["nodes"]} if optimum else set()))
    for n in counts:
        p = predict(s, n)
        mark = "  <- cost-optimal" if optimum and n == optimum["nodes"] else ""
        print(f"{n:>6} {p['img_s']:>10.1f} {p['efficiency']:>6.1%} {p['compute_ms']:>11.1f} "
              f"{p['communication_ms']:>8.1f} {p['hours']:>9.2f} {p['node_hours']:>11.1f} "
              f"{p['cost']:>10.2f}{mark}")
    if deadline:
        if optimum:
            print(f"\ncost-optimal for a {deadline:g} h deadline: {optimum['nodes']} nodes, "
                  f"{optimum['hours']:.2f} h, ${optimum['cost']:.2f}")
        else:
            fastest = max((predict(s, n) for n in range(1, 257)), key=lambda p: p["img_s"])
            print(f"\nno node count up to 256 meets {deadline:g} h; the fastest is "
                  f"{fastest['nodes']} nodes at {fastest['hours']:.2f} h")


def _print_validation(rows: list[dict]) -> None:
    print(f"{'case':<28} {'nodes':>5} {'what':>10} {'measured':>10} {'predicted':>10} "
          f"{'error':>7}")
    for r in rows:
        print(f"{r['case']:<28} {r['nodes']:>5} {r['what']:>10} {r['published']:>10.4g} "
              f"{r['predicted']:>10.4g} {r['error']:>+7.1%}")
    print()


def _measure_now(batch: int) -> dict:
    """This machine, now: the trainer with 1 and 2 workers (engine=ddp), 2 single workers
    at once, and a 2-rank Gloo allreduce; written as a results folder."""
    from benchmarks import allreduce, record, throughput
    from benchmarks.runs import MNIST, Timing

    return record.write(None, "predict", lambda folder: {
        "throughput": throughput.measure_sweep(MNIST, ["ddp"], [1, 2], [batch], 1, Timing(),
                                               1, folder),
        "allreduce": allreduce.measure(["gloo"], 2, allreduce.sizes(factor=4), 0.1, 1)})


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    source = p.add_mutually_exclusive_group()
    source.add_argument("--preset", choices=list(PRESETS))
    source.add_argument("--results", metavar="FOLDER", help="this machine, from a results "
                        "folder of `make bench` ('latest': the newest)")
    source.add_argument("--measure", action="store_true", help="measure this machine now")
    source.add_argument("--validate", action="store_true", help="the published figures")
    p.add_argument("--engine", default="ddp", help="with --results: whose transport")
    p.add_argument("--img-s", type=float, help="img/s of one worker alone")
    p.add_argument("--batch", type=int, default=64, help="per worker")
    p.add_argument("--gradient-mb", type=float, help="MB of gradients per step")
    p.add_argument("--bucket-mb", type=float, default=25.0)
    p.add_argument("--link-gbit", type=float, help="network bandwidth between nodes")
    p.add_argument("--latency-us", type=float, default=50.0, help="per message")
    p.add_argument("--gpus-per-node", type=int, default=None)
    p.add_argument("--samples", type=int, default=None, help="per epoch")
    p.add_argument("--epochs", type=float, default=None)
    p.add_argument("--price", type=float, default=None, help="USD per node-hour")
    p.add_argument("--deadline-hours", type=float, default=None)
    args = p.parse_args()

    if args.validate:
        _print_validation(validate_published())
        return
    if args.preset:
        s = PRESETS[args.preset]
    elif args.results or args.measure:
        from benchmarks import record
        from benchmarks.this_machine import machine_scenario, validate_machine

        if args.measure:
            results = _measure_now(args.batch)
        else:
            results = record.load(record.find(args.results))
        _print_validation(validate_machine(results))
        row = next(r for r in results["throughput"]["rows"]
                   if r["engine"] == args.engine and r["workers"] > 1 and not r["independent"])
        s = machine_scenario(results, args.engine, row["workers"], row["batch"])
    else:
        missing = [f"--{k.replace('_', '-')}" for k in ("img_s", "gradient_mb", "link_gbit")
                   if getattr(args, k) is None]
        if missing:
            p.error(f"give --preset, --results, --measure, or {', '.join(missing)}")
        s = Scenario("given", args.batch, args.img_s, args.gradient_mb * MB,
                     args.bucket_mb * MB, args.latency_us * 1e-6, args.link_gbit * 1e9 / 8)
    overrides = {k: v for k, v in {"gpus_per_node": args.gpus_per_node, "samples": args.samples,
                                   "epochs": args.epochs, "price": args.price}.items()
                 if v is not None}
    _print_table(replace(s, **overrides), args.deadline_hours)


if __name__ == "__main__":
    main()
