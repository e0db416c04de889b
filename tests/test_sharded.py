"""Sharded checkpoints in one process: a single-file checkpoint of format 1 still
restores under either engine, a checkpoint slower than the notice is told, and a
background save copies only its rank's share. With real ranks (every rank writing its
part, restored on any world size under any engine, killed mid-save): tests/test_resume.py.
"""

from __future__ import annotations

import hashlib
import io
import json

import pytest
import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
)

import spotring
from spotring import runtime
from spotring.checkpoint import parts
from spotring.checkpoint.layout import (
    Checkpoints,
    manifest_name,
)
from tests.conftest import assert_close

STEPS, HALF = 16, 8


# ------------------------------------------------------------ in one process, fast


def one_job(run_dir, engine: str = "ddp"):
    job = spotring.init(engine=engine, run_dir=run_dir, notices="none", seed=0)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 1)).double()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    model, optimizer = job.wrap(model, optimizer)
    return job, model, optimizer


def a_step(model, optimizer) -> None:
    model(torch.ones(2, 3, dtype=torch.float64)).pow(2).sum().backward()
    optimizer.step()
    optimizer.zero_grad()


def single_file_checkpoint(directory, step: int) -> dict:
    """A checkpoint as spotring wrote it before sharded ones (format 1): one .pt of the
    whole state (the optimizer's keyed by position) beside its manifest; the weights."""
    torch.manual_seed(1)
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 1)).double()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    a_step(model, optimizer)
    state = {"model": model.state_dict(), "optimizer": optimizer.state_dict(),
             "counters": {"seen": 7},
             "spotring": {"step": step, "rng": [runtime.rng_state()], "world_size": 1,
                          "scaler": {}}}
    payload = io.BytesIO()
    torch.save(state, payload)
    name = manifest_name(step).removesuffix(".json") + ".pt"
    directory.mkdir(parents=True)
    (directory / name).write_bytes(payload.getvalue())
    (directory / manifest_name(step)).write_text(json.dumps({
        "format": 1, "file": name, "bytes": len(payload.getvalue()),
        "sha256": hashlib.sha256(payload.getvalue()).hexdigest(), "step": step}))
    return state


@pytest.mark.parametrize("engine", ["ddp", "fsdp"])
def test_a_single_file_checkpoint_of_before_restores_under_either_engine(tmp_path, engine):
    old = single_file_checkpoint(tmp_path / "checkpoints", 30)
    job, model, optimizer = one_job(tmp_path, engine)
    try:
        counters = {}
        job.track(model=model, optimizer=optimizer, counters=counters)
        assert job.restore() == 30 and counters == {"seen": 7}
        whole = get_model_state_dict(job.unwrap(model), options=StateDictOptions(
            full_state_dict=True))
        assert_close(whole, old["model"], 0.0)
        moments = get_optimizer_state_dict(job.unwrap(model), optimizer, options=StateDictOptions(
            full_state_dict=True))["state"]["0.weight"]["exp_avg"]
        assert torch.equal(moments, old["optimizer"]["state"][0]["exp_avg"])
        job.save(background=False)  # the next checkpoint is sharded
        assert Checkpoints(tmp_path / "checkpoints", keep=3).newest_valid().format == 2
    finally:
        job.close()


def test_a_checkpoint_slower_than_the_notice_is_told_once_with_what_would_fit(
        tmp_path, caplog, monkeypatch):
    job, model, optimizer = one_job(tmp_path)
    # A cloud whose notice is shorter than any write.
    monkeypatch.setattr(type(job.preemption), "notice_seconds", property(lambda _: 1e-6))
    try:
        job.track(model=model, optimizer=optimizer)
        for _ in range(2):
            a_step(model, optimizer)
            job.should_stop()  # a step taken
            job.save(background=False)
    finally:
        job.close()
    told = [r.getMessage() for r in caplog.records if "more than the 1e-06 s" in r.getMessage()]
    assert len(told) == 1, caplog.text
    assert "from the busiest of 1 ranks" in told[0] and "workers would write" in told[0]


class Replicas(parts.Comm):
    """``world_size`` ranks that hold the same state (DDP's replicas), planned in this one
    process: every rank's plan is this rank's."""

    def all_gather(self, obj):
        return [obj] * self.world_size


def test_a_background_save_copies_only_the_pieces_its_rank_writes():
    model = nn.Sequential(*(nn.Linear(64, 64) for _ in range(8)))
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 64)).sum().backward()
    optimizer.step()
    state = {"model": get_model_state_dict(model),
             "optimizer": get_optimizer_state_dict(model, optimizer)}
    total = sum(t.numel() * t.element_size() for t in state["model"].values()) * 3
    for world in (2, 3):
        shares = [parts.Stager(pinned=False).stage(state, Replicas(rank=r, world_size=world))
                  for r in range(world)]
        pieces = [set(share.copies) for share in shares]
        # Every piece is copied by exactly one rank, ...
        assert sum(map(len, pieces)) == len(set().union(*pieces))
        assert set().union(*pieces) == set(parts.Stager(False).stage(state, parts.ALONE)
                                           .copies)
        # ... and no rank copies much more than its share (within one block's tensors).
        copied = [sum(c.numel() * c.element_size() for c in s.copies.values()
                      if isinstance(c, torch.Tensor)) for s in shares]
        assert max(copied) <= total / world + 3 * 4 * 64 * 64, (world, copied)


def test_a_staged_copy_is_the_state_of_its_step_and_the_next_one_reuses_its_memory():
    model = nn.Linear(16, 16)
    stager = parts.Stager(pinned=False)
    first = stager.stage({"model": get_model_state_dict(model)}, parts.ALONE)
    (weight,) = [c for i, c in first.copies.items() if i.fqn == "model.weight"]
    then = weight.clone()
    with torch.no_grad():
        model.weight.add_(1.0)  # training goes on
    assert torch.equal(weight, then)
    second = stager.stage({"model": get_model_state_dict(model)}, parts.ALONE)
    (again,) = [c for i, c in second.copies.items() if i.fqn == "model.weight"]
    assert again.data_ptr() == weight.data_ptr() and torch.equal(again, then + 1.0)
