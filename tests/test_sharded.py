"""Sharded checkpoints: every rank writes its part, and a checkpoint restores onto any
world size under any engine with the samples and weights of one uninterrupted run.

Real processes (torchrun, Gloo) run tests/sharded_script.py, a user's float64 script;
S3 is the moto server (tests/aws.py), behind tests/faults.py's proxy where a test
holds the uploads. Each resumed run is compared with one uninterrupted run alone: its
weights to 1e-10, and its per-step loss (the same samples give the same loss) to 1e-10.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import random
import shutil
import signal

import pytest
import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
)

import spotring
from spotring import runtime, sharded
from spotring.checkpoint import (
    Checkpoints,
    files_of,
    folder_name,
    manifest_name,
    manifests,
)
from spotring.exits import EXIT_PREEMPTED
from tests import sharded_script as script
from tests.conftest import assert_close
from tests.faults import FaultProxy

STEPS, HALF = 16, 8


@pytest.fixture(scope="module")
def project(tmp_path_factory):
    return script.write(tmp_path_factory.mktemp("project"))


@pytest.fixture(scope="module")
def reference(project, tmp_path_factory):
    """One process alone, uninterrupted: (losses by step, weights)."""
    run_dir = tmp_path_factory.mktemp("reference")
    output = script.run(project, run_dir, 1, "--steps", str(STEPS))
    return script.losses(output), script.weights(run_dir)


def resumed(project, tmp_path, reference, checkpoint_of, engine: str, workers: int) -> None:
    """Continue ``checkpoint_of``'s run from step HALF to the end on ``workers`` under
    ``engine``; its steps and weights are the reference's."""
    run_dir = tmp_path / f"{engine}-{workers}"
    shutil.copytree(checkpoint_of / "checkpoints", run_dir / "checkpoints")
    output = script.run(project, run_dir, workers, "--engine", engine, "--steps", str(STEPS))
    assert f"resumed from {run_dir / 'checkpoints'}/" in output and f"at step {HALF}" in output
    losses, expected = script.losses(output), reference[0]
    assert sorted(losses) == list(range(HALF + 1, STEPS + 1))
    for step, loss in losses.items():
        assert abs(loss - expected[step]) <= 1e-10 * max(1.0, abs(expected[step])), step
    assert_close(script.weights(run_dir), reference[1], 1e-10)


@pytest.mark.slow
@pytest.mark.parametrize("first", [("fsdp", 4), ("ddp", 2)])
def test_a_checkpoint_restores_on_any_world_size_under_any_engine(project, tmp_path,
                                                                    reference, first):
    engine, workers = first
    half = tmp_path / "half"
    output = script.run(project, half, workers, "--engine", engine, "--steps", str(HALF))
    parts = sorted(p.name for p in (half / "checkpoints" / folder_name(HALF)).iterdir())
    # Every rank wrote its part; rank 0 the metadata and spotring's own.
    assert parts == sorted([".metadata", "spotring.pt",
                            *(f"__{r}_0.distcp" for r in range(workers))]), output
    others = [("fsdp", 1), ("fsdp", 2), ("fsdp", 3), ("ddp", 1), ("ddp", 2), ("ddp", 3)] \
        if engine == "fsdp" else [("fsdp", 4)]
    for then in others:
        resumed(project, tmp_path, reference, half, *then)


def saving(directory) -> int | None:
    """The step of a checkpoint being written in ``directory``: its folder there, its
    manifest not yet."""
    if not directory.is_dir():
        return None
    steps = [int(m.removesuffix(".json").split("-")[1]) for m in
             manifests(p.name + ".json" for p in directory.iterdir() if p.is_dir())]
    return next((s for s in steps if not (directory / manifest_name(s)).exists()), None)


def save_in_flight(job: script.Started, run_dir, workers: int, at_least: int = 1) -> int | None:
    """Wait until every rank runs and a checkpoint of step ``at_least`` or later is being
    written; its step (None: the run ended first)."""
    seen = []

    def writing() -> bool:
        step = saving(run_dir / "checkpoints")
        seen[:] = [step] if len(job.pids()) == workers and (step or 0) >= at_least else []
        return bool(seen)

    return seen[0] if job.until(writing, "a checkpoint being written") else None


def listed_only(store) -> None:
    """Every checkpoint object ``store`` holds is a manifest or a part one lists."""
    names = set(store.names())
    listed = set()
    for manifest in manifests(names):
        listed |= {manifest} | {f"{files_of(manifest)[1]}/{part}" for part in
                                json.loads(store.read(manifest))["parts"]}
    assert names == listed, sorted(names - listed)


@pytest.mark.slow
@pytest.mark.parametrize("where", ["disk", "s3"])
def test_a_rank_killed_while_parts_are_written_leaves_the_previous_checkpoint_newest(
        project, tmp_path, reference, s3, where):
    uri = f"s3://spotring/killed-{where}" if where == "s3" else None
    env = s3 | ({"SPOTRING_CHECKPOINT_URI": uri} if uri else {})
    run_dir = tmp_path / "run"
    args = ("--engine", "fsdp", "--steps", str(STEPS), "--save-every", "4",
            "--sleep", "0.05")
    victim = random.Random(where).randrange(2)
    with script.Started(project, run_dir, 2, *args, **env) as job:
        # The second save: the first one is the previous checkpoint.
        killed = save_in_flight(job, run_dir, 2, at_least=8)
        assert killed, job.output()[-4000:]
        os.kill(job.pids()[victim], signal.SIGKILL)
        assert job.wait() != 0
    checkpoints = Checkpoints(tmp_path / "elsewhere" if uri else run_dir / "checkpoints",
                              keep=3, uri=uri)
    assert checkpoints.newest_valid().step == killed - 4  # nothing of the unfinished one

    output = script.run(project, run_dir, 2, *args, **env)
    assert f"at step {killed - 4}" in output
    assert_close(script.weights(run_dir), reference[1], 1e-10)
    # The next saves removed what the killed one left: no part that no manifest lists.
    for store in Checkpoints(run_dir / "checkpoints", keep=3, uri=uri).stores:
        listed_only(store)


@pytest.mark.slow
def test_a_corrupt_or_missing_part_is_named_and_the_checkpoint_before_restored(
        project, tmp_path, reference):
    first = tmp_path / "first"
    script.run(project, first, 2, "--steps", str(HALF))
    for damage in ("corrupt", "missing"):
        run_dir = tmp_path / damage
        shutil.copytree(first, run_dir)
        part = run_dir / "checkpoints" / folder_name(HALF) / "__1_0.distcp"
        if damage == "missing":
            part.unlink()
        else:
            data = bytearray(part.read_bytes())
            data[len(data) // 2] ^= 0xFF
            part.write_bytes(bytes(data))
        output = script.run(project, run_dir, 2, "--steps", "12")
        assert f"skipping checkpoint: {part}: {damage}" in output
        assert f"at step {HALF - 4}" in output
        losses = script.losses(output)
        assert all(abs(losses[s] - reference[0][s]) <= 1e-10 for s in range(5, 13))


@pytest.mark.slow
def test_a_notice_while_a_background_save_is_in_flight_ends_75_with_a_complete_checkpoint(
        project, tmp_path, reference, s3):
    """S3 sits behind a proxy that the test holds once training runs: the background
    save's uploads wait there, unanswered, while training goes on and a notice comes."""
    proxy = FaultProxy(s3["AWS_ENDPOINT_URL"])
    uri = "s3://spotring/notice-in-flight"
    env = s3 | {"AWS_ENDPOINT_URL": proxy.endpoint, "SPOTRING_CHECKPOINT_URI": uri}
    run_dir = tmp_path / "run"
    # One save, at step 8, which the notice finds in flight: the ranks vote every step,
    # so they agree to stop before the end, which waits for it.
    args = ("--engine", "fsdp", "--steps", str(STEPS), "--save-every", str(HALF),
            "--sleep", "0.1", "--vote-every", "1")
    try:
        with script.Started(project, run_dir, 2, *args, **env) as job:
            assert job.until(lambda: len(job.pids()) == 2 and job.step() >= 1, "step 1")
            proxy.hold()
            began = save_in_flight(job, run_dir, 2)
            assert began, job.output()[-4000:]
            # Steps are taken between the start of the background save and its manifest.
            assert job.until(lambda: job.step() >= began + 2, f"step {began + 2}")
            assert not (run_dir / "checkpoints" / manifest_name(began)).exists()
            os.kill(job.pids()[1], signal.SIGTERM)  # a notice on one rank
            assert job.until(lambda: "the ranks agreed to stop" in job.output(),
                             "the ranks' agreement to stop")
            proxy.release()
            code = job.wait()
            output = job.output()
    finally:
        proxy.stop()
    assert f"exitcode  : {EXIT_PREEMPTED}" in output, (code, output[-5000:])
    note = json.loads((run_dir / "preempted.json").read_text())
    assert note["step"] > began
    for checkpoints in (Checkpoints(run_dir / "checkpoints", keep=3),  # on disk
                        Checkpoints(tmp_path / "elsewhere", keep=3, uri=uri)):  # on S3 alone
        assert [c.step for c in checkpoints.found()][:2] == [note["step"], began]
        assert checkpoints.newest_valid().step == note["step"]

    output = script.run(project, run_dir, 3, "--engine", "fsdp", "--steps", str(STEPS),
                        SPOTRING_CHECKPOINT_URI=uri, **s3)
    assert f"at step {note['step']}" in output
    assert_close(script.weights(run_dir), reference[1], 1e-10)


@pytest.mark.slow
def test_random_stops_and_kills_on_random_world_sizes_end_with_the_uninterrupted_weights(
        project, tmp_path, reference):
    """The chaos schedule: segments on 1, 2 or 3 FSDP workers, each ended by SIGTERM on a
    rank (a notice), SIGKILL of a rank, or SIGKILL while a checkpoint is written, until a
    run reaches the end."""
    rng = random.Random(40)
    run_dir = tmp_path / "run"
    args = ("--engine", "fsdp", "--steps", str(STEPS), "--save-every", "2", "--sleep", "0.05")
    checkpoints = Checkpoints(run_dir / "checkpoints", keep=3)
    interrupted = []
    for _ in range(4):
        workers, end = rng.choice([1, 2, 3]), rng.choice(["SIGTERM", "SIGKILL", "mid-save"])
        newest = checkpoints.newest_valid()
        later = (newest.step if newest else 0) + rng.randint(1, 3)
        with script.Started(project, run_dir, workers, *args) as job:
            if end == "mid-save":
                due = save_in_flight(job, run_dir, workers)
            else:
                due = job.until(lambda job=job, workers=workers, later=later: len(
                    job.pids()) == workers and job.step() >= later, f"step {later}")
            if not due:
                break  # it reached the end first
            victim = job.pids()[rng.randrange(workers)]
            os.kill(victim, signal.SIGTERM if end == "SIGTERM" else signal.SIGKILL)
            if job.wait() == 0:
                break
            interrupted.append((workers, end))
    else:
        script.run(project, run_dir, rng.choice([1, 2, 3]), *args)
    assert len(interrupted) >= 3, interrupted  # the schedule ran, not the first run alone
    assert_close(script.weights(run_dir), reference[1], 1e-10)


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


class Replicas(sharded.Comm):
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
        shares = [sharded.Stager(pinned=False).stage(state, Replicas(rank=r, world_size=world))
                  for r in range(world)]
        pieces = [set(share.copies) for share in shares]
        # Every piece is copied by exactly one rank, ...
        assert sum(map(len, pieces)) == len(set().union(*pieces))
        assert set().union(*pieces) == set(sharded.Stager(False).stage(state, sharded.ALONE)
                                           .copies)
        # ... and no rank copies much more than its share (within one block's tensors).
        copied = [sum(c.numel() * c.element_size() for c in s.copies.values()
                      if isinstance(c, torch.Tensor)) for s in shares]
        assert max(copied) <= total / world + 3 * 4 * 64 * 64, (world, copied)


def test_a_staged_copy_is_the_state_of_its_step_and_the_next_one_reuses_its_memory():
    model = nn.Linear(16, 16)
    stager = sharded.Stager(pinned=False)
    first = stager.stage({"model": get_model_state_dict(model)}, sharded.ALONE)
    (weight,) = [c for i, c in first.copies.items() if i.fqn == "model.weight"]
    then = weight.clone()
    with torch.no_grad():
        model.weight.add_(1.0)  # training goes on
    assert torch.equal(weight, then)
    second = stager.stage({"model": get_model_state_dict(model)}, sharded.ALONE)
    (again,) = [c for i, c in second.copies.items() if i.fqn == "model.weight"]
    assert again.data_ptr() == weight.data_ptr() and torch.equal(again, then + 1.0)
