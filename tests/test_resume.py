"""The library's guarantees with real ranks: a run stopped any way (a notice on any cloud,
SIGTERM, a rank killed, a rank killed while checkpoint parts are written, a damaged
part) resumes on any world size under any engine and ends with the samples and weights
of one uninterrupted run; a lost or hung rank ends the others with 69, naming it.

The ranks are spawned by the test (harness/ranks.py: forked from a server that imported
torch once, torchrun's environment, no agent) and run harness/workloads.py's residual(),
a user's float64 script on spotring's API, so a resumed run's per-step loss and final
weights are compared with the uninterrupted run's to 1e-10. The launchers' part (what
torchrun, mpirun, horovodrun, srun and spotring's launchers do with these exits) is
tests/test_launch_hostfile.py's, test_exits.py's and the launch tests'; the trainer's,
tests/test_trainer_contract.py's and test_spot.py's. The metadata services are
harness/imds.py's loopback stubs; the stores (S3, GCS, Azure Blob) are harness/stores.py's
emulators speaking HTTP, S3 behind harness/faults.py's proxy where a test holds the
uploads.
"""

from __future__ import annotations

import json
import random
import re
import shutil
import signal
import socket
import time
import uuid

import pytest

from harness import ranks, workloads
from harness.faults import FaultProxy
from harness.imds import STUBS, pointed_at
from harness.ranks import Ranks
from spotring.checkpoint.layout import Checkpoints, files_of, folder_name, manifest_name, manifests
from spotring.exits import EXIT_PEER_LOST, EXIT_PREEMPTED
from tests.conftest import assert_close

STEPS, HALF = 16, 8
# The stores a checkpoint.uri may name, by scheme: harness/stores.py's emulator fixtures.
EMULATORS = {"s3": "moto_s3", "gs": "gcs_emulator", "az": "azurite"}
TIMEOUT_S = 6  # engine.timeout_s where a rank hangs


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """One process alone, uninterrupted: (losses by step, weights)."""
    run_dir = tmp_path_factory.mktemp("reference")
    output = ranks.run(run_dir, 1, workloads.residual, steps=STEPS)
    return ranks.losses(output), workloads.weights(run_dir)


def continues(run_dir, reference, engine: str, workers: int, step: int, skipped: str = "",
              **env) -> None:
    """Resume ``run_dir``'s run from ``step`` to the end on ``workers`` under ``engine``
    (having said ``skipped``, where given): its steps and weights are the reference's."""
    output = ranks.run(run_dir, workers, workloads.residual, engine=engine, steps=STEPS,
                       env=env)
    assert f"at step {step} " in output and skipped in output, output[-3000:]
    assert sorted(ranks.losses(output)) == list(range(step + 1, STEPS + 1)), output[-3000:]
    for s, loss in ranks.losses(output).items():
        assert abs(loss - reference[0][s]) <= 1e-10 * max(1.0, abs(reference[0][s])), s
    assert_close(workloads.weights(run_dir), reference[1], 1e-10)


@pytest.mark.slow
@pytest.mark.parametrize("first", [("fsdp", 4), ("ddp", 2)])
def test_a_checkpoint_restores_on_any_world_size_under_any_engine(tmp_path, reference, first):
    engine, workers = first
    half = tmp_path / "half"
    output = ranks.run(half, workers, workloads.residual, engine=engine, steps=HALF)
    parts = sorted(p.name for p in (half / "checkpoints" / folder_name(HALF)).iterdir())
    # Every rank wrote its part; rank 0 the metadata and spotring's own.
    assert parts == sorted([".metadata", "spotring.pt",
                            *(f"__{r}_0.distcp" for r in range(workers))]), output
    others = [("fsdp", 1), ("fsdp", 2), ("fsdp", 3), ("ddp", 1), ("ddp", 2), ("ddp", 3)] \
        if engine == "fsdp" else [("fsdp", 4)]
    for then in others:
        run_dir = tmp_path / "-".join(map(str, then))
        shutil.copytree(half / "checkpoints", run_dir / "checkpoints")
        continues(run_dir, reference, *then, step=HALF)


def stopped_at(job: Ranks) -> int:
    """The one step every rank stopped at, exiting 75 (the ranks without the notice for
    the others' vote)."""
    output = job.output()
    steps = {line.rsplit(" at step ", 1)[1].split(";")[0] for line in output.splitlines()
             if line.startswith("spotring: preempted (")}
    assert len(steps) == 1 and "another rank received a notice" in output, output[-5000:]
    return int(steps.pop())


@pytest.mark.slow
@pytest.mark.parametrize("notice", ["SIGTERM", *STUBS])
def test_a_notice_stops_every_rank_at_one_step_with_its_checkpoint_and_resumes_elsewhere(
        tmp_path, reference, monkeypatch, notice):
    """A notice on one rank (SIGTERM, as the OS sends it; or the cloud's metadata service,
    the only one answering, which rank 0 watches) stops all of them at one step, after a
    checkpoint of that step; rank 0 leaves preempted.json; the run continues there on 3
    FSDP workers. The run is held at step 3 until the notice has reached its rank."""
    stub = STUBS[notice]() if notice in STUBS else None
    for name, value in pointed_at(stub).items():
        monkeypatch.setenv(name, value)
    run_dir = tmp_path / "run"
    try:
        with Ranks(run_dir, 2, workloads.residual, steps=STEPS, save_every=STEPS,
                   vote_every=1, poll_seconds=0.1, hold_at=3) as job:
            assert job.until(lambda: job.step() >= 3, "step 3")
            if stub is None:
                job.signal(1, signal.SIGTERM)  # rank 1 acts on it once rank 0 goes on
            else:
                stub.announce()
                assert job.until(lambda: f"spotring: {stub.cloud} " in job.output(0),
                                 "the watcher's line of the notice")
            workloads.release(run_dir)
            assert job.wait() == [EXIT_PREEMPTED, EXIT_PREEMPTED], job.output()[-5000:]
            step = stopped_at(job)
            output = job.output()
    finally:
        if stub is not None:
            stub.close()
    assert step in (4, 5), output[-5000:]  # voted at the next step, read a step later
    note = json.loads((run_dir / "preempted.json").read_text())
    assert note["step"] == step and note["checkpoint"] == str(
        run_dir / "checkpoints" / folder_name(step))
    if stub is None:  # rank 0's note: rank 1 had the signal
        assert note["reason"] == "another rank received a notice"
        assert f"preempted (SIGTERM) at step {step}" in job.output(1)
    else:
        assert note["reason"].startswith(f"{stub.cloud} "), note
        assert f"watching {stub.cloud}'s metadata service at {stub.url}" in output
    if notice == "ec2":  # IMDSv2: every read carries the session token (and it read)
        tokens = [token for method, _, token in stub.requests if method == "GET"]
        assert tokens and all(tokens), stub.requests
    assert Checkpoints(run_dir / "checkpoints", keep=3).newest_valid().step == step
    continues(run_dir, reference, "fsdp", 3, step)


@pytest.mark.slow
def test_automatic_votes_grow_apart_on_fast_steps_and_a_sigterm_still_stops_all_at_one_step(
        tmp_path):
    """By default the ranks vote as often as keeps the vote near 1% of the steps' time:
    on steps of a millisecond or so, every few steps; a notice is acted on at the next
    vote all the same, by every rank at one step."""
    run_dir = tmp_path / "run"
    with Ranks(run_dir, 2, workloads.residual, steps=100_000, save_every=100_000, width=8,
               hold_at=400) as job:
        assert job.until(lambda: job.step() >= 400, "step 400")
        job.signal(1, signal.SIGTERM)
        workloads.release(run_dir)
        assert job.wait() == [EXIT_PREEMPTED, EXIT_PREEMPTED], job.output()[-5000:]
        step = stopped_at(job)
        interval = int(re.search(r"the ranks agreed to stop \(votes every (\d+) steps\)",
                                 job.output()).group(1))
    assert interval > 1, job.output()[-3000:]
    assert 400 < step <= 401 + interval  # the vote after the notice, read a step later
    assert json.loads((run_dir / "preempted.json").read_text())["step"] == step


@pytest.mark.slow
@pytest.mark.parametrize("lost, how, engine", [
    # Each engine saved, lost a rank, and restored on another world size: at both ends.
    pytest.param(1, "SIGKILL", "fsdp", marks=pytest.mark.ends),
    pytest.param(0, "SIGKILL", "ddp", marks=pytest.mark.ends),
    (1, "SIGSTOP", "ddp")])
def test_a_lost_rank_ends_the_others_with_69_naming_it_and_the_run_resumes(
        tmp_path, reference, lost, how, engine):
    """No notice, no goodbye: a rank killed (or hung, as a wedged GPU leaves it) at step 5
    ends the others within engine.timeout_s, naming it; the run then resumes from its
    newest checkpoint, losing the steps since (every 2 steps here: step 4). Each engine's
    collectives (FSDP's, DDP's allreduce over Gloo) meet a lost rank."""
    run_dir = tmp_path / "run"
    # A hung rank is found by the timeout; a killed one by its closed connections at once,
    # so there the timeout only has to outlast a loaded machine's stalls.
    timeout_s = TIMEOUT_S if how == "SIGSTOP" else 60
    with Ranks(run_dir, 2, workloads.residual, engine=engine, steps=STEPS, save_every=2,
               blocking=True, timeout_s=timeout_s, hold_at=5) as job:
        assert job.until(lambda: job.step() >= 5, "step 5")
        job.signal(lost, getattr(signal, how))
        workloads.release(run_dir)
        released = time.monotonic()
        survivor = job.processes[1 - lost]
        survivor.join(timeout_s + 30)  # bounds a failure: it must not wait longer
        waited, code = time.monotonic() - released, survivor.exitcode
        output = job.output(1 - lost)
    assert code == EXIT_PEER_LOST, output[-5000:]
    if how == "SIGSTOP":  # a hung rank is waited for as long as the timeout says
        assert waited > TIMEOUT_S - 1, waited
    if lost == 0:
        assert "rank 0, which serves the rendezvous store, is unreachable" in output
    else:
        assert f"lost rank 1 ({socket.gethostname()} pid {job.pids[1]})" in output, output
    assert Checkpoints(run_dir / "checkpoints", keep=3).newest_valid().step == 4
    continues(run_dir, reference, "ddp", 3, 4)


def saving(directory) -> int | None:
    """The step of a checkpoint being written in ``directory``: its folder there, its
    manifest not yet."""
    if not directory.is_dir():
        return None
    steps = [int(m.removesuffix(".json").split("-")[1]) for m in
             manifests(p.name + ".json" for p in directory.iterdir() if p.is_dir())]
    return next((s for s in steps if not (directory / manifest_name(s)).exists()), None)


def save_in_flight(job: Ranks, at_least: int = 1) -> int | None:
    """Wait until a checkpoint of step ``at_least`` or later is being written; its step
    (None: the run ended first)."""
    seen = []

    def writing() -> bool:
        step = saving(job.run_dir / "checkpoints")
        seen[:] = [step] if (step or 0) >= at_least else []
        return bool(seen)

    return seen[0] if job.until(writing, "a checkpoint being written") else None


def frozen_mid_save(job: Ranks, at_least: int = 1) -> int | None:
    """Every rank stopped (SIGSTOP) while a checkpoint of step ``at_least`` or later is
    being written, its manifest not yet there; its step (None: the run ended first). A
    save that completed before the ranks stopped is let go, and the next one waited for."""
    while (step := save_in_flight(job, at_least)) is not None:
        for rank in range(len(job.processes)):
            job.signal(rank, signal.SIGSTOP)
        if not (job.run_dir / "checkpoints" / manifest_name(step)).exists():
            return step
        for rank in range(len(job.processes)):
            job.signal(rank, signal.SIGCONT)
        at_least = step + 1
    return None


def kill_frozen(job: Ranks, victim: int) -> None:
    """SIGKILL ``victim`` of ranks frozen_mid_save stopped, and let the others go on."""
    job.signal(victim, signal.SIGKILL)
    for rank in range(len(job.processes)):
        if rank != victim:
            job.signal(rank, signal.SIGCONT)


def listed_only(store) -> None:
    """Every checkpoint object ``store`` holds is a manifest or a part one lists."""
    names = set(store.names())
    listed = set()
    for manifest in manifests(names):
        listed |= {manifest} | {f"{files_of(manifest)[1]}/{part}" for part in
                                json.loads(store.read(manifest))["parts"]}
    assert names == listed, sorted(names - listed)


@pytest.fixture
def uri(request, monkeypatch) -> str | None:
    """Where checkpoints also go, as ``request.param`` names the store: None (the
    checkpoint directory alone), or a fresh prefix in the moto S3, GCS emulator or
    Azurite of harness/stores.py, whose environment is set here (and so in the ranks)."""
    if request.param == "disk":
        return None
    emulator = request.getfixturevalue(EMULATORS[request.param])
    for name, value in emulator.env().items():
        monkeypatch.setenv(name, value)
    return emulator.uri(f"{request.node.name}-{uuid.uuid4().hex[:8]}")


@pytest.mark.slow
@pytest.mark.parametrize("uri", ["disk", *EMULATORS], indirect=True)
def test_a_rank_killed_while_parts_are_written_leaves_the_previous_checkpoint_newest(
        tmp_path, reference, uri):
    env = {"SPOTRING_CHECKPOINT_URI": uri} if uri else {}
    run_dir = tmp_path / "run"
    args = {"engine": "fsdp", "steps": STEPS, "save_every": 4, "sleep": 0.05}
    with Ranks(run_dir, 2, workloads.residual, env=env, **args) as job:
        # The second save or later: the first one is the previous checkpoint.
        killed = frozen_mid_save(job, at_least=8)
        assert killed, job.output()[-4000:]
        kill_frozen(job, random.Random(str(uri)).randrange(2))
        assert job.wait() != [0, 0]
    checkpoints = Checkpoints(tmp_path / "elsewhere" if uri else run_dir / "checkpoints",
                              keep=3, uri=uri)
    assert checkpoints.newest_valid().step == killed - 4  # nothing of the unfinished one

    output = ranks.run(run_dir, 2, workloads.residual, env=env, **args)
    assert f"at step {killed - 4} " in output
    assert_close(workloads.weights(run_dir), reference[1], 1e-10)
    # The next saves removed what the killed one left: no part that no manifest lists.
    for store in Checkpoints(run_dir / "checkpoints", keep=3, uri=uri).stores:
        listed_only(store)


@pytest.mark.slow
@pytest.mark.parametrize("uri", [  # read back through DCP from a store: at both ends
    pytest.param(scheme, marks=[pytest.mark.ends] if scheme == "s3" else [])
    for scheme in EMULATORS], indirect=True)
def test_every_rank_stores_its_part_and_a_fresh_machine_restores_from_the_store_alone(
        tmp_path, reference, uri):
    """Each cloud's store: both ranks' parts go up (the store holds every part its
    manifest lists); then, on 3 workers with an empty disk, the newest checkpoint's
    corrupt part is named and skipped, and the one before it continues the run."""
    env = {"SPOTRING_CHECKPOINT_URI": uri}
    ranks.run(tmp_path / "first", 2, workloads.residual, env=env, engine="fsdp", steps=HALF)
    stored = Checkpoints(tmp_path / "elsewhere", keep=3, uri=uri)
    remote = stored.remote
    listed_only(remote)
    newest = stored.found([remote])[0]
    assert newest.step == HALF and {n.rsplit("/", 1)[1] for n in newest.parts()} == {
        ".metadata", "spotring.pt", "__0_0.distcp", "__1_0.distcp"}
    part = f"{folder_name(HALF)}/__1_0.distcp"  # rank 1's, as rank 1 uploaded it
    data = bytearray(remote.read(part))
    data[len(data) // 2] ^= 0xFF
    remote.write(part, bytes(data))
    continues(tmp_path / "fresh", reference, "ddp", 3, HALF - 4, SPOTRING_CHECKPOINT_URI=uri,
              skipped=f"skipping checkpoint: {remote.location(part)}: corrupt")


@pytest.mark.slow
def test_a_corrupt_or_missing_part_is_named_and_the_checkpoint_before_restored(
        tmp_path, reference):
    first = tmp_path / "first"
    ranks.run(first, 2, workloads.residual, steps=HALF)
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
        output = ranks.run(run_dir, 2, workloads.residual, steps=12)
        assert f"skipping checkpoint: {part}: {damage}" in output
        assert f"at step {HALF - 4} " in output
        losses = ranks.losses(output)
        assert all(abs(losses[s] - reference[0][s]) <= 1e-10 for s in range(5, 13))


@pytest.mark.slow
def test_a_notice_while_a_background_save_is_in_flight_ends_75_with_a_complete_checkpoint(
        tmp_path, reference, s3):
    """S3 sits behind a proxy that the test holds once training runs: the background
    save's uploads wait there, unanswered, while training goes on and a notice comes."""
    proxy = FaultProxy(s3["AWS_ENDPOINT_URL"])
    uri = "s3://spotring/notice-in-flight"
    env = {"AWS_ENDPOINT_URL": proxy.endpoint, "SPOTRING_CHECKPOINT_URI": uri}
    run_dir = tmp_path / "run"
    # One save, at step 8, which the notice finds in flight: the ranks vote every step,
    # so they agree to stop before the end, which waits for it.
    try:
        with Ranks(run_dir, 2, workloads.residual, env=env, engine="fsdp", steps=STEPS,
                   save_every=HALF, sleep=0.1, vote_every=1) as job:
            assert job.until(lambda: job.step() >= 1, "step 1")
            proxy.hold()
            began = save_in_flight(job)
            assert began, job.output()[-4000:]
            # Steps are taken between the start of the background save and its manifest.
            assert job.until(lambda: job.step() >= began + 2, f"step {began + 2}")
            assert not (run_dir / "checkpoints" / manifest_name(began)).exists()
            job.signal(1, signal.SIGTERM)  # a notice on one rank
            assert job.until(lambda: "the ranks agreed to stop" in job.output(),
                             "the ranks' agreement to stop")
            proxy.release()
            codes = job.wait()
    finally:
        proxy.stop()
    assert codes == [EXIT_PREEMPTED, EXIT_PREEMPTED], job.output()[-5000:]
    note = json.loads((run_dir / "preempted.json").read_text())
    assert note["step"] > began
    for checkpoints in (Checkpoints(run_dir / "checkpoints", keep=3),  # on disk
                        Checkpoints(tmp_path / "elsewhere", keep=3, uri=uri)):  # on S3 alone
        assert [c.step for c in checkpoints.found()][:2] == [note["step"], began]
        assert checkpoints.newest_valid().step == note["step"]
    continues(run_dir, reference, "fsdp", 3, note["step"], SPOTRING_CHECKPOINT_URI=uri)


@pytest.mark.slow
def test_random_stops_and_kills_on_random_world_sizes_end_with_the_uninterrupted_weights(
        tmp_path, reference):
    """The chaos schedule: segments on 1, 2 or 3 FSDP workers, each ended by SIGTERM on a
    rank (a notice), SIGKILL of a rank, or SIGKILL while a checkpoint is written, until a
    run reaches the end."""
    rng = random.Random(40)
    run_dir = tmp_path / "run"
    args = {"engine": "fsdp", "steps": STEPS, "save_every": 2, "sleep": 0.05}
    checkpoints = Checkpoints(run_dir / "checkpoints", keep=3)
    interrupted = []
    for _ in range(4):
        workers, end = rng.choice([1, 2, 3]), rng.choice(["SIGTERM", "SIGKILL", "mid-save"])
        newest = checkpoints.newest_valid()
        later = (newest.step if newest else 0) + rng.randint(1, 3)
        with Ranks(run_dir, workers, workloads.residual, **args) as job:
            victim = rng.randrange(workers)
            if end == "mid-save":
                if not frozen_mid_save(job):
                    break  # it reached the end first
                kill_frozen(job, victim)
            else:
                if not job.until(lambda job=job, later=later: job.step() >= later,
                                 f"step {later}"):
                    break
                job.signal(victim, signal.SIGTERM if end == "SIGTERM" else signal.SIGKILL)
            if job.wait() == [0] * workers:
                break
            interrupted.append((workers, end))
    else:
        ranks.run(run_dir, rng.choice([1, 2, 3]), workloads.residual, **args)
    assert len(interrupted) >= 3, interrupted  # the schedule ran, not the first run alone
    assert_close(workloads.weights(run_dir), reference[1], 1e-10)
