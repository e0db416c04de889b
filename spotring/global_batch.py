"""The global batch on W workers: G = B x W x K, the one home of that rule.

The global batch G (samples per optimizer step, over all workers) is what makes a run
the same run on any number of workers W (spotring/sampler.py). Each worker takes B
samples per micro-step over K micro-steps. Free of torch, so that launchers that
restart a job on fewer nodes can import it.
"""

from __future__ import annotations

from spotring.exits import ConfigError

SHOWN_DIVISORS = 16  # valid worker counts listed in full up to this many


def _divisors(n: int) -> list[int]:
    small = [d for d in range(1, int(n ** 0.5) + 1) if n % d == 0]
    return sorted(set(small + [n // d for d in small]))


def check_world_size(global_batch: int, world_size: int) -> None:
    """Refuse W workers that cannot share G equally, listing those that can."""
    for name, value in (("global batch", global_batch), ("number of workers", world_size)):
        if value < 1:
            raise ConfigError(f"the {name} must be at least 1, not {value}")
    if global_batch % world_size == 0:
        return
    valid = _divisors(global_batch)
    listed = ", ".join(map(str, valid))
    if len(valid) > SHOWN_DIVISORS:
        listed = (", ".join(map(str, valid[:SHOWN_DIVISORS - 2])) + f", ..., {valid[-1]} "
                  f"({len(valid)} in all)")
    below = max(d for d in valid if d < world_size)
    above = [d for d in valid if d > world_size]
    nearest = f"are {below} and {above[0]}" if above else f"is {below}"
    raise ConfigError(
        f"a global batch of {global_batch} samples cannot be split over {world_size} "
        f"workers: every optimizer step averages exactly {global_batch} samples, taken in "
        f"equal parts by every worker, so the number of workers must divide it. Valid "
        f"worker counts for a global batch of {global_batch}: {listed}; the nearest to "
        f"{world_size} {nearest}. Run on one of those, or choose another global batch "
        "(which changes the sample sequence a resumed run sees).")


def split_global_batch(global_batch: int, world_size: int,
                       batch_size: int | None = None) -> tuple[int, int]:
    """(B, K): the micro-batch each of ``world_size`` (W) workers takes and the
    accumulation steps that keep ``global_batch`` G = B x W x K.

    Without ``batch_size``, K = 1. With it (the most samples one worker fits in memory),
    the smallest K with G % (W x K) == 0 and G // (W x K) <= batch_size. Raises
    ConfigError where W does not divide G, naming the worker counts that do.
    """
    check_world_size(global_batch, world_size)
    if batch_size is not None and batch_size < 1:
        raise ConfigError(f"the batch size must be at least 1, not {batch_size}")
    per_worker = global_batch // world_size
    if batch_size is None:
        return per_worker, 1
    # K = per_worker (micro-batches of one sample) always qualifies.
    accumulation = min(k for k in _divisors(per_worker) if per_worker // k <= batch_size)
    return per_worker // accumulation, accumulation
