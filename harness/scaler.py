"""fp16's GradScaler through an engine's step, on the CPU (tests/test_precision.py):
``scaler_steps`` takes a finite step and an overflowing one and reports what each did.

    python -m harness.scaler    # through Horovod's DistributedOptimizer, one rank: JSON

In a process of its own under Horovod, so that Horovod's threads stay out of pytest's.
"""

from __future__ import annotations

import json

import torch
from torch import nn

from spotring import HorovodOptions, engines, runtime


def scaler_steps(engine: engines.Engine) -> dict[str, float]:
    """Two steps of a tiny model through engine.step with an enabled GradScaler at scale
    2^10 (on the CPU, which validate refuses for runs, so that the path is exercised
    without a GPU): a finite one, which must equal the unscaled step exactly (a power of
    two scales float32 exactly), and one whose gradients are not finite (an inf in the
    batch): skipped, and the scale halved."""
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    reference = nn.Linear(4, 2)
    reference.load_state_dict(model.state_dict())
    x, y = torch.randn(8, 4), torch.tensor([0, 1] * 4)
    model, optimizer = engine.prepare(model, torch.optim.SGD(model.parameters(), lr=0.5), 1)
    plain = torch.optim.SGD(reference.parameters(), lr=0.5)
    nn.functional.cross_entropy(reference(x), y).backward()
    plain.step()
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    result = {}
    for name, batch in [("finite", x), ("overflow", x.index_fill(1, torch.tensor([0]), torch.inf))]:
        before = [p.detach().clone() for p in model.parameters()]
        scaler.scale(nn.functional.cross_entropy(model(batch), y)).backward()
        engine.step(optimizer, scaler)
        optimizer.zero_grad()
        result[f"{name}_scale"] = scaler.get_scale()
        result[f"{name}_moved"] = any(not torch.equal(a, b)
                                      for a, b in zip(before, model.parameters(), strict=True))
        if name == "finite":
            result["finite_exact"] = all(
                torch.equal(a, b)
                for a, b in zip(model.parameters(), reference.parameters(), strict=True))
    return result


def horovod_scaler_steps() -> None:
    """scaler_steps through Horovod's DistributedOptimizer, one rank; prints JSON."""
    launch = runtime.detect()
    engine = engines.create(HorovodOptions(), launch, torch.device("cpu"))
    print(json.dumps(scaler_steps(engine)))
    engine.shutdown()


if __name__ == "__main__":
    horovod_scaler_steps()
