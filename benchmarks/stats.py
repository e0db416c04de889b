"""The statistics every benchmark here reports, defined once.

    mean_ci([img/s per interval])    the mean and the half-width of its 95% confidence
                                     interval (Student's t), over the measured intervals
                                     of all repeats of a configuration
    scaling(n_workers, one_worker, n)  speedup and efficiency against 1 worker, with
                                     their 95% intervals (first-order error propagation)

The intervals are taken as independent samples; a machine whose speed drifts between
repeats makes the interval narrower than the truth, so repeats are interleaved (see
benchmarks/throughput.py). Warm-up is excluded by the caller.
"""

from __future__ import annotations

import math
import statistics

Z_975 = statistics.NormalDist().inv_cdf(0.975)
# Below 10 degrees of freedom the expansion below is off by more than 0.02%: the table's.
T_975_FEW = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306,
             9: 2.262}


def t_975(dof: int) -> float:
    """Student's t quantile 0.975 for ``dof`` degrees of freedom (Cornish-Fisher expansion
    around the normal quantile from 10 degrees up, within 0.02% of the exact value)."""
    if dof in T_975_FEW:
        return T_975_FEW[dof]
    z = Z_975
    terms = [(z**3 + z) / 4, (5 * z**5 + 16 * z**3 + 3 * z) / 96,
             (3 * z**7 + 19 * z**5 + 17 * z**3 - 15 * z) / 384]
    return z + sum(term / dof ** (i + 1) for i, term in enumerate(terms))


def mean_ci(values: list[float]) -> dict[str, float]:
    """Mean, half-width of its 95% confidence interval (0 for a single value), count."""
    if not values:
        raise ValueError("no measured intervals: warm-up took them all")
    n = len(values)
    half = t_975(n - 1) * statistics.stdev(values) / math.sqrt(n) if n > 1 else 0.0
    return {"mean": statistics.fmean(values), "ci95": half, "n": n}


def scaling(many: dict[str, float], one: dict[str, float], workers: int) -> dict:
    """Speedup of ``workers`` workers' total img/s over one worker's (both mean_ci of img/s
    per worker), and efficiency = speedup / workers; each with its 95% half-width."""
    efficiency = many["mean"] / one["mean"]
    relative = math.hypot(many["ci95"] / many["mean"], one["ci95"] / one["mean"])
    return {"speedup": {"mean": workers * efficiency, "ci95": workers * efficiency * relative},
            "efficiency": {"mean": efficiency, "ci95": efficiency * relative}}


def interleaved(configurations: list, repeats: int):
    """(repeat, configuration) in the order runs are measured side by side: every
    configuration once per repeat, reversed every other repeat, so that a machine that
    speeds up or slows down during the run favours none of them."""
    for i in range(repeats):
        for config in configurations if i % 2 == 0 else configurations[::-1]:
            yield i, config
