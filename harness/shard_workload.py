"""A user's script on spotring.Shards, as a function for ranks spawned by harness/ranks.py
(tests/test_shards.py): harness/workloads.py's float64 residual network trained with AdamW
on a regression set kept as WebDataset shards in a store, read through
``job.loader(spotring.Shards(uri, decode=...), 12)`` with one loader worker per rank.

Every step, each rank prints the keys of the samples it trained on (``keys STEP RANK
KEY...``) and rank 0 the loss averaged over the ranks (``step N loss L``); it saves every
``save_every`` steps, stops on a notice with exit 75, and rank 0 leaves the model in
weights.pt of the run directory (harness.workloads.weights reads it). In place
(``in_place``: spotring/elastic/), each rank prints the keys of a step once it stood (not
one taken again), with the world size it was taken on (``keys STEP RANK/WORLD KEY...``).
"""

from __future__ import annotations

import re
from collections import defaultdict
from pathlib import Path

import torch

import spotring
from harness import workloads

GLOBAL_BATCH = 12  # splits over 1, 2, 3 and 4 workers
SAMPLES, SAMPLES_PER_SHARD, BLOCK_SAMPLES = 384, 50, 8  # 8 shards, the last of 34
STEPS_PER_EPOCH = SAMPLES // GLOBAL_BATCH


def samples() -> list[dict[str, bytes]]:
    """The regression set as shard samples: x (8 float64) and y (1 float64), as bytes."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(SAMPLES, 8, generator=g, dtype=torch.float64)
    y = torch.sin(x.sum(1)) + 0.1 * torch.randn(SAMPLES, generator=g, dtype=torch.float64)
    return [{"x": x[i].numpy().tobytes(), "y": y[i].numpy().tobytes()} for i in range(SAMPLES)]


def decode(sample: dict[str, bytes]) -> tuple[torch.Tensor, torch.Tensor, str]:
    return (torch.frombuffer(bytearray(sample["x"]), dtype=torch.float64),
            torch.frombuffer(bytearray(sample["y"]), dtype=torch.float64)[0], sample["__key__"])


def train(uri: str, cache_dir: str, steps: int, save_every: int = 8,
          hold_at: int | None = None, timeout_s: float | None = None,
          in_place: bool = False) -> None:
    """Train ``steps`` steps on the shards at ``uri``, caching blocks in ``cache_dir``;
    ``hold_at``: rank 0 waits after printing that step until the test releases the run
    (harness.workloads.release); ``in_place``: a job in place, voting every step."""
    elastic = {"in_place": "auto", "check_every_steps": 1} if in_place else {}
    with spotring.init(seed=0, timeout_s=timeout_s, **elastic) as job:
        shards = spotring.Shards(uri, decode=decode, cache_dir=cache_dir)
        loader = job.loader(shards, GLOBAL_BATCH, num_workers=1)
        model, optimizer = job.wrap(*_model())
        job.track(model=model, optimizer=optimizer, loader=loader)
        job.restore()
        for _ in loader.epochs(-(-steps // STEPS_PER_EPOCH)):
            # None left where the run resumed from a stop at its last step.
            for x, y, keys in loader if job.step_count < steps else ():
                loss = ((model(x) - y) ** 2).mean()
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
                taken = f"keys {job.step_count} {job.rank}"
                if not in_place:
                    print(f"{taken} {' '.join(keys)}", flush=True)
                mean = job.all_reduce(loss.detach()).item()
                stood = job.engine.failure is None
                taken += f"/{job.world_size}"
                if job.is_main:
                    print(f"step {job.step_count} loss {mean!r}", flush=True)
                    if job.step_count == hold_at:
                        workloads._held(job.run_dir)
                if job.should_stop():
                    job.save_and_exit()
                if in_place and stood:
                    print(f"{taken} {' '.join(keys)}", flush=True)
                if job.step_count % save_every == 0 and job.step_count < steps:
                    job.save(background=False)
                if job.step_count >= steps:
                    break
            if job.step_count >= steps:
                break
        job.save(background=False)
        if job.is_main:
            torch.save(job.unwrap(model).state_dict(), Path(job.run_dir) / "weights.pt")
        job.finish()


def _model() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    model = workloads.Net(32)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def keys_by_step(output: str, world_size: int) -> dict[int, list[str]]:
    """The keys of each step that every one of ``world_size`` ranks printed (a step a
    rank was killed in is left out), each step's sorted."""
    seen: dict[int, dict[int, list[str]]] = defaultdict(dict)
    for step, rank, keys in re.findall(r"^keys (\d+) (\d+) (.*)$", output, re.M):
        seen[int(step)][int(rank)] = keys.split()
    return {step: sorted(k for keys in ranks.values() for k in keys)
            for step, ranks in seen.items() if len(ranks) == world_size}


def keys_in_place(output: str) -> dict[int, list[str]]:
    """The keys of each step that stood (``train(in_place=True)``'s lines): those every
    rank of the world size it stood on printed, each step's sorted."""
    seen: dict[tuple[int, int], dict[int, list[str]]] = defaultdict(dict)
    for step, rank, world, keys in re.findall(r"^keys (\d+) (\d+)/(\d+) (.*)$", output, re.M):
        seen[int(step), int(world)][int(rank)] = keys.split()
    return {step: sorted(k for keys in ranks.values() for k in keys)
            for (step, world), ranks in seen.items() if len(ranks) == world}

