"""The few statistics every benchmark here reports, defined once.

    interval_stats([img/s per interval])   mean +- 1.96 sigma, as Horovod's
                                           pytorch_synthetic_benchmark prints it: the
                                           spread of single intervals (about 95% of
                                           them fall inside), not a confidence interval
    median_range([per-repeat values])      the headline figure over interleaved repeats,
                                           with the lowest and highest repeat
    scaling(total_n, total_1, n)           speedup and efficiency against 1 worker

Warm-up is excluded by the caller (the intervals handed in are the measured ones).
"""

from __future__ import annotations

import statistics


def interval_stats(values: list[float]) -> dict[str, float]:
    """Mean and 1.96 x the standard deviation (population, as numpy's default that
    Horovod's benchmark uses) of per-interval rates."""
    if not values:
        raise ValueError("no measured intervals: warm-up took them all")
    return {"mean": statistics.fmean(values), "ci95": 1.96 * statistics.pstdev(values),
            "intervals": len(values)}


def median_range(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "low": min(values), "high": max(values),
            "repeats": len(values)}


def scaling(total_n: float, total_1: float, workers: int) -> dict[str, float]:
    """Speedup of N workers over 1 (total img/s), and efficiency = speedup / N."""
    speedup = total_n / total_1
    return {"speedup": speedup, "efficiency": speedup / workers}
