"""This machine as a results.json measured it: the predictor's scenario per engine,
and its predictions against the measured 2-worker figures (benchmarks/predict.py has the
model; `python -m benchmarks.predict --results RUN` prints both).

Each scenario takes: r1 and jitter from 2 single workers run at once (the host as busy
as with 2 workers: the two "nodes" share one memory system here; they log every step),
alpha and beta fitted to the allreduce measurements of the engine's transport, G, its
tensors and bucket of the engine, c and m of the engine, s from the host's cores, the
workers' threads and the CPU the engine's transport takes from them, t_r measured with
it (not charged where the thread spins: SPINS), t_w from its cold and back-to-back
allreduces of the gradient (Gloo's threads sleep through the compute; in the published
GPU cases t_w = t_r = 0: Horovod's thread cycles every millisecond, on a spare core,
and NCCL runs on the GPU). Two launches of one 2-worker job differ here by 10-40%, so
that comparison carries that noise: validate_machine gives beside the error each
repeat's, predicted from that repeat's own compute-only runs (their spread is the
noise); validate_split also compares with 2-worker steps measured inside one job
against that job's own compute blocks (benchmarks/step_split.py: r1 and jitter from
its free blocks, s = 1 because those blocks ran beside the engine's threads, but where
the thread spins longer in them than in synchronized steps: _share_of_free; the rest
as above).
"""

from __future__ import annotations

import math
import statistics
from dataclasses import replace

from benchmarks.allreduce import ENGINE_TRANSPORT, wakeup
from benchmarks.predict import Scenario, compute_share, fit_alpha_beta, predict
from benchmarks.runs import ENGINES
from benchmarks.stats import interval_stats, median_range
from benchmarks.throughput import reference, runs_by_setup, step_time

# Gradient buckets of the engines on this repository's trainer: DDP's bucket_cap_mb,
# Horovod's fusion buffer.
BUCKET_BYTES = {"ddp": 25 * 2**20, "ddp-mpi": 25 * 2**20, "plain": 25 * 2**20,
                "horovod-gloo": 128 * 2**20, "horovod-mpi": 128 * 2**20}
# The trainer's spot-notice vote (trainer/preemption.py) is one more small allreduce per
# step. It blocks only where the engine sums at once (Engine.start_sum's default, which
# engine=ddp engine.backend=mpi keeps); the others send it without waiting and read it a
# step later, while the next step computes.
BLOCKING_COLLECTIVES_PER_STEP = {"ddp-mpi": 1}
# Horovod's background thread negotiates each tensor and fuses only those ready in the
# same cycle: a gradient goes in up to one response per tensor, most sent during backward.
PER_TENSOR = {"horovod-gloo", "horovod-mpi"}
# Over MPI, Horovod's thread spins in MPI through every cycle's negotiation, tensor or
# not, and a tensor's transfer is spent inside that spin: the allreduces sent during the
# compute take nothing from it beyond h (t_r = 0), and h is the thread's CPU in the
# engine's training runs, which counts them. The bursts' t_r over MPI (0.35-1.05 ms,
# varying by launch) is not charged: charged, it put horovod-mpi's rows of three
# reference runs up to 32% off where this keeps them within 17% (within 2% in the
# latest), and in one job the steps that sent the gradients were faster than the
# blocks that sent nothing (README, "How well it predicts").
SPINS = {"horovod-mpi"}


def sent_while_computing(engine: str, gradient_bytes: float, tensors: int) -> int:
    """m: the allreduces a worker of ``engine`` sends per step while it computes: the
    gradient's before its last, and the trainer's vote where it does not block."""
    responses = (tensors if engine in PER_TENSOR
                 else math.ceil(gradient_bytes / BUCKET_BYTES[engine]))
    vote = (ENGINES[engine].program == "trainer"
            and engine not in BLOCKING_COLLECTIVES_PER_STEP)
    return responses - 1 + vote


def _row(throughput: dict, engine: str, batch: int, workers: int, independent: bool) -> dict:
    return next(r for r in throughput["rows"] if (r["engine"], r["batch"], r["workers"],
                                                  r["independent"])
                == (engine, batch, workers, independent))


def machine_scenario(results: dict, engine: str, workers: int, batch: int,
                     busy: bool = True) -> Scenario:
    """This machine as measured in a results.json, for ``engine``: r1 and jitter of one
    worker with the host as busy as with ``workers`` workers (r1 of one worker alone:
    busy=False), and the rest as in _this_machine."""
    throughput = results["throughput"]
    run = _row(throughput, reference(engine), batch, workers, True)
    computing = run["step_time"]
    img_s = (1000 * batch / computing["mean_ms"] if busy else
             _row(throughput, reference(engine), batch, 1, False)["per_worker_median"]["median"])
    return _this_machine(results, engine, workers, batch, _gradient(throughput), img_s,
                         computing["sd_ms"] / computing["mean_ms"], run["threads"],
                         f"{throughput['workload']}, {engine}, "
                         f"{'busy' if busy else 'alone'} compute")


def _gradient(section: dict) -> tuple[int, int]:
    """Bytes and tensors of the gradient a throughput or step_split section measured
    (results from before tensors were counted: 1, which lends nothing over Gloo)."""
    return section["gradient_bytes"], section.get("gradient_tensors", 1)


def _this_machine(results: dict, engine: str, workers: int, batch: int,
                  gradient: tuple[int, int], img_s: float, jitter: float, threads: int,
                  what: str) -> Scenario:
    """alpha and beta fitted to the engine's transport, the engine's bucket, the
    trainer's vote where it blocks, the share of its core each worker keeps from the
    transport's background threads, what waking them costs a step, and what the
    allreduces sent during the compute take from it; the rest as given."""
    allreduce = results["allreduce"]
    transport = ENGINE_TRANSPORT[engine]
    latency, bandwidth = fit_alpha_beta(allreduce["transports"][transport], allreduce["ranks"])
    woken = wakeup(allreduce, transport)
    cores = results["machine"]["cores"] / workers
    share = compute_share(cores, threads, background_cores(results, engine, workers, batch))
    nbytes, tensors = gradient
    # Not measured (results from before it was, or a transport that cannot send without
    # waiting), or spent inside a spin that h counts: nothing lent.
    sent_cpu = (0.0 if engine in SPINS
                else allreduce.get("response_cpu_seconds", {}).get(transport, 0.0))
    return Scenario(
        f"this machine: {what}, 1 core per worker", batch, img_s,
        nbytes, BUCKET_BYTES[engine], latency, bandwidth,
        jitter=jitter, collectives=BLOCKING_COLLECTIVES_PER_STEP.get(engine, 0),
        compute_share=share, wakeup_s=woken["wakeup"] if woken else 0.0,
        sent_while_computing=sent_while_computing(engine, nbytes, tensors),
        sent_cpu_s=sent_cpu if cores - threads < 1 else 0.0, samples=60_000, epochs=2,
        source=f"{what}, {transport} allreduce fit")


def background_cores(results: dict, engine: str, workers: int, batch: int) -> float:
    """h, the CPU the engine's threads take while each worker computes: the smaller of
    two measurements, neither exact; for an engine whose thread spins (SPINS), the
    training runs' where there are any.

    - The transport's bursts (allreduce_ranks.py): a synthetic program whose figure
      varies from second to second (Horovod over MPI: 0.25-0.37 within one minute,
      against 0.27-0.33 in its training runs the same hour).
    - The engine's own training runs with as many workers, one thread each, at the other
      batch sizes, so that no run is predicted from itself (the trainer's summary.json,
      the busiest rank's). They also count what the threads do while the loop waits for
      the allreduce, and for the allreduces sent during the compute, which the model
      charges apart (t_x, m t_r), so they overstate h: by far where the threads sleep
      through the compute, as Gloo's do (0.05-0.07 against 0.002). A spinning thread's
      sends are not charged apart, and how long it spins depends on how far apart the
      ranks' cycles run, which training sets (0.33-0.35 against the bursts' 0.19):
      there they are the better measurement.

    A run's predicted img/s moves about 7% per 0.05 of h, so the overstatement matters."""
    burst = results["allreduce"]["background_cpu_cores"][ENGINE_TRANSPORT[engine]]
    trained = [r["other_threads_cores"] for r in results["throughput"]["runs"]
               if (r["engine"], r["workers"], r["threads"], r["independent"])
               == (engine, workers, 1, False)
               and r["batch"] != batch and r.get("other_threads_cores") is not None]
    if not trained:
        return burst
    trained_h = statistics.median(trained)
    return trained_h if engine in SPINS else min(burst, trained_h)


def validate_machine(results: dict) -> list[dict]:
    """Predicted against measured img/s for every multi-worker configuration of a run
    whose transport was measured too."""
    rows = []
    runs = runs_by_setup(results["throughput"])
    for row in results["throughput"]["rows"]:
        engine, n = row["engine"], row["workers"]
        if n == 1 or row["independent"] or \
                ENGINE_TRANSPORT[engine] not in results["allreduce"]["transports"]:
            continue
        busy = machine_scenario(results, engine, n, row["batch"])
        alone = machine_scenario(results, engine, n, row["batch"], busy=False)
        p = predict(busy, n)
        rows.append({"case": f"this machine, {engine}, batch {row['batch']}", "engine": engine,
                     "nodes": n, "batch": row["batch"], "what": "img_s",
                     "published": row["total_median"], "predicted": p["img_s"],
                     "error": p["img_s"] / row["total_median"] - 1,
                     "error_per_repeat": median_range(paired_errors(runs, busy, engine, n,
                                                                    row["batch"])),
                     "predicted_compute_alone": predict(alone, n)["img_s"],
                     "jitter": busy.jitter, "compute_share": busy.compute_share,
                     "wait_ms": p["wait_ms"],
                     "communication_ms": p["communication_ms"],
                     "measured_communication_ms": row.get("communication_ms"),
                     "latency_us": busy.latency_s * 1e6, "bandwidth_gbps": busy.bandwidth / 1e9,
                     "source": busy.source})
    return rows


def paired_errors(runs: dict[tuple, list[dict]], s: Scenario, engine: str, workers: int,
                  batch: int) -> list[float]:
    """Each repeat's run of ``engine`` (``runs``: throughput.runs_by_setup) predicted from
    r1 and jitter of the same repeat's compute-only runs (adjacent in time, alike in
    load), against its measured img/s: how far two launches of one configuration apart
    can be, shown beside the error."""
    errors = []
    for run, alone in zip(runs[(engine, workers, batch, False)],
                          runs[(reference(engine), workers, batch, True)], strict=True):
        t = step_time(batch, alone["per_worker"])
        p = predict(replace(s, img_s=1000 * batch / t["mean_ms"],
                            jitter=t["sd_ms"] / t["mean_ms"]), workers)
        errors.append(p["img_s"] / (workers * interval_stats(run["per_worker"])["mean"]) - 1)
    return errors


def _share_of_free(results: dict, engine: str, workers: int, row: dict) -> float:
    """s for one job's synchronized steps against its free blocks, which computed beside
    the engine's own threads (Horovod's cycle runs whether or not a tensor is ready), so
    that r1 has paid for them already: 1. But where the thread spins (SPINS), it spins
    longer in free blocks, whose ranks' cycles drift apart, than in synchronized ones:
    the share the sync blocks kept over the free blocks', from the CPU the engine's
    threads took in each (step_split's other_threads_cores; 1 where not measured)."""
    took = row.get("other_threads_cores")
    if engine not in SPINS or took is None:
        return 1.0
    cores = results["machine"]["cores"] / workers
    return compute_share(cores, 1, took["sync"]) / compute_share(cores, 1, took["free"])


def validate_split(results: dict) -> list[dict]:
    """Predicted against measured communication and img/s of every row of the
    step_split section: the 2-worker step measured inside one job, against its own
    compute (benchmarks/step_split.py), so that launch-to-launch noise is not in it."""
    rows = []
    split = results["step_split"]
    for row in split["rows"]:
        engine, n, batch = row["engine"], split["workers"], row["batch"]
        if ENGINE_TRANSPORT[engine] not in results["allreduce"]["transports"]:
            continue
        s = replace(_this_machine(results, engine, n, batch, _gradient(split),
                                  1000 * batch / row["free_ms"],
                                  row["free_sd_ms"] / row["free_ms"], 1,
                                  f"{engine}'s path in one job, batch {batch}"),
                    compute_share=_share_of_free(results, engine, n, row))
        p = predict(s, n)
        measured = n * batch / (row["free_ms"] + row["communication_ms"]) * 1000
        rows.append({"case": f"one job, {engine}, batch {batch}", "engine": engine,
                     "nodes": n, "batch": batch, "what": "img_s", "published": measured,
                     "predicted": p["img_s"], "error": p["img_s"] / measured - 1,
                     "added_ms": p["wait_ms"] + p["communication_ms"],
                     "measured_added_ms": row["communication_ms"],
                     "compute_share": s.compute_share, "jitter": s.jitter, "source": s.source})
    return rows
