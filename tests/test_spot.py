"""Spot-proof training: interruption notices, checkpoints on S3, resuming anywhere.

The instance metadata service is a loopback stub (tests/imds.py): nothing real serves
it off EC2. S3 is a real moto server on 127.0.0.1 speaking HTTP.
"""

from __future__ import annotations

import json
import signal
import subprocess
import threading
import time
from pathlib import Path

import boto3
import pytest
import torch

from spotring.checkpoint import CheckpointNotSaved, Checkpoints, find_resume
from spotring.launch.commands import local_command, local_environment
from spotring.preemption import NOTICE_SECONDS
from tests.conftest import QUICK, REPO, Run, assert_close, run_trainer
from tests.imds import MetadataStub

# 4800 synthetic samples, 2 workers x 32: 75 steps per epoch, 2 epochs; long enough
# for a notice to arrive mid-run, short enough for the suite.
SAMPLES, EPOCHS, GLOBAL_BATCH = 4800, 2, 2 * 32
STEPS = SAMPLES * EPOCHS // GLOBAL_BATCH
RUN = ["dataset=synthetic", "dataset.shape=[1,28,28]", f"dataset.train_size={SAMPLES}",
       "dataset.test_size=200", f"train.epochs={EPOCHS}", "train.threads=1",
       "telemetry.log_every=5", "preemption.poll_seconds=0.5", "train.dtype=float64"]


class Job:
    """A job watched as it runs: 2 ranks under mpirun (which passes the ranks' exit code
    on) unless told otherwise."""

    def __init__(self, run_dir: Path, overrides: list[str], env: dict[str, str],
                 launcher: str = "mpirun", nproc: int = 2) -> None:
        self.run_dir = run_dir
        args = [f"hydra.run.dir={run_dir}", *QUICK, *RUN, "train.batch_size=32", *overrides]
        self.proc = subprocess.Popen(local_command(launcher, nproc, args), cwd=REPO,
                                     env=local_environment(**env), stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True)
        self.lines: list[str] = []
        threading.Thread(target=lambda: self.lines.extend(self.proc.stdout), daemon=True).start()

    def steps_done(self) -> int:
        """The newest step rank 0 logged in metrics.jsonl (a lower bound)."""
        path = self.run_dir / "metrics.jsonl"
        steps = [json.loads(line)["step"] for line in path.read_text().splitlines()
                 if line.endswith("}")] if path.exists() else []
        return max(steps, default=0)

    def wait_for_step(self, step: int, timeout: float = 120) -> None:
        deadline = time.monotonic() + timeout
        while self.steps_done() < step:
            assert self.proc.poll() is None, "".join(self.lines)
            assert time.monotonic() < deadline, "".join(self.lines)
            time.sleep(0.05)

    def finish(self, timeout: float = 120) -> Run:
        self.proc.wait(timeout=timeout)
        time.sleep(0.2)  # let the reader thread drain the pipe
        return Run(self.run_dir, subprocess.CompletedProcess(self.proc.args, self.proc.returncode,
                                                              "".join(self.lines), ""))


def newest_checkpoint_step(directory: Path) -> int:
    found = find_resume("auto", Checkpoints(directory, keep=3))
    return found.manifest["step"] if found else -1


@pytest.mark.slow
def test_notice_checkpoints_at_once_exits_75_and_resumes_on_one_worker_exactly(tmp_path, train):
    whole = train("whole", *RUN, "train.batch_size=32", launcher="mpirun", nproc=2)
    imds = MetadataStub()
    try:
        job = Job(tmp_path / "spot", [], {"AWS_EC2_METADATA_SERVICE_ENDPOINT": imds.url})
        job.wait_for_step(40)
        announced = imds.announce_interruption()
        before = job.steps_done()
        # The checkpoint of the step where the ranks agreed to stop lands within seconds.
        while newest_checkpoint_step(tmp_path / "spot" / "checkpoints") < before:
            assert time.monotonic() - announced < 120, "no checkpoint within the 2 minutes"
            time.sleep(0.05)
        landed = time.monotonic() - announced
        run = job.finish()
    finally:
        imds.close()
    assert run.proc.returncode == 75, run.output[-4000:]
    assert landed < 10, f"checkpoint {landed:.1f} s after the notice"
    print(f"\ncheckpoint landed {landed:.2f} s after the interruption notice")
    preempted = json.loads((run.dir / "preempted.json").read_text())
    assert preempted["reason"].startswith("spot terminate notice")
    stopped_at = preempted["step"]
    assert before <= stopped_at < STEPS and newest_checkpoint_step(run.dir / "checkpoints") \
        == stopped_at
    assert any(m == "GET" and token for m, _, token in imds.requests)  # IMDSv2, with a token
    assert all(token for m, _, token in imds.requests if m == "GET")

    # The replacement has one worker: same global batch (32 x 1 x 2), same samples.
    resumed = train("spot", *RUN, "train.batch_size=32", "train.accumulation=2")
    assert f"resumed at step {stopped_at}" in resumed.output
    assert resumed.summary["steps"] == STEPS and resumed.summary["world_size"] == 1
    assert_close(resumed.params(), whole.params(), rtol=1e-10)  # float64: see test_equivalence


@pytest.mark.slow
def test_sigterm_is_a_notice_too(tmp_path):
    job = Job(tmp_path, [], {})
    job.wait_for_step(20)
    ranks = subprocess.run(["pgrep", "-P", str(job.proc.pid), "-f", "python"],
                           capture_output=True, text=True).stdout.split()
    assert ranks, "no rank processes under mpirun"
    subprocess.run(["kill", "-TERM", ranks[-1]], check=True)  # one rank, as the OS does
    run = job.finish()
    assert run.proc.returncode == 75, run.output[-4000:]
    assert json.loads((tmp_path / "preempted.json").read_text())["step"] >= 20


@pytest.mark.slow
def test_kill_9_without_notice_loses_at_most_every_steps(tmp_path, train):
    job = Job(tmp_path / "run", ["checkpoint.every_steps=10", "engine.timeout_s=20"], {})
    job.wait_for_step(35)
    done = job.steps_done()
    ranks = subprocess.run(["pgrep", "-P", str(job.proc.pid), "-f", "python"],
                           capture_output=True, text=True).stdout.split()
    subprocess.run(["kill", "-KILL", ranks[-1]], check=True)
    run = job.finish(timeout=60)
    assert run.proc.returncode != 0
    resumed = train("run", *RUN, "train.batch_size=32", "train.max_steps=60",
                    launcher="mpirun", nproc=2)
    step = int(resumed.output.split("resumed at step ")[1].split()[0])
    assert done - 10 <= step, f"resumed at {step}, but {done} steps were done when killed"
    assert resumed.summary["steps"] == 60


# ------------------------------------------------------------------------------- S3


def big_state(step: int, numel: int = 10 * 1024 * 1024) -> dict:
    # 40 MB by default: uploaded in three parts of 16 MB (stores.PART_BYTES).
    return {"model": {"w": torch.full((numel,), float(step))}, "step": step}


def save(checkpoints: Checkpoints, step: int, **state) -> None:
    checkpoints.save(big_state(step, **state), {"step": step, "epoch": 0, "offset": 0,
                                                "model": {"name": "convnet"}, "dataset": "mnist"})


def test_s3_checkpoints_resume_on_a_new_node_and_a_cut_upload_is_never_picked(tmp_path, s3):
    uri = "s3://spotring/runs/a"
    first_node = Checkpoints(tmp_path / "node1", keep=2, uri=uri)
    save(first_node, 10)
    save(first_node, 20)

    # The upload of step 30 is cut off after its first 16 MB part.
    original = first_node.remote.client.upload_part

    def cut(*args, **kwargs):
        if kwargs["PartNumber"] >= 2:
            raise ConnectionResetError("the spot instance went away mid-upload")
        return original(*args, **kwargs)

    first_node.remote.client.upload_part = cut
    with pytest.raises(Exception, match="went away"):
        save(first_node, 30)
    keys = [o["Key"] for o in boto3.client("s3").list_objects_v2(
        Bucket="spotring", Prefix="runs/a/")["Contents"]]
    assert "runs/a/ckpt-000000030.pt" not in keys and "runs/a/ckpt-000000030.json" not in keys

    # A new node: empty disk, same S3 prefix.
    second_node = Checkpoints(tmp_path / "node2", keep=2, uri=uri)
    found = find_resume("auto", second_node)
    assert found.manifest["step"] == 20 and found.location == f"{uri}/ckpt-000000020.pt"
    assert torch.equal(found.load()["model"]["w"][:3], torch.full((3,), 20.0))

    # Blob uploaded whole but its manifest never written: still invisible.
    second_node.remote.client.put_object(Bucket="spotring", Key="runs/a/ckpt-000000040.pt",
                                         Body=b"whatever")
    assert find_resume("auto", second_node).manifest["step"] == 20
    # A manifest whose object is corrupt is reported and skipped.
    manifest = json.loads(second_node.remote.read("ckpt-000000020.json"))
    second_node.remote.write("ckpt-000000050.json",
                             json.dumps(manifest | {"file": "ckpt-000000040.pt"}).encode())
    assert find_resume("auto", second_node).manifest["step"] == 20
    assert sorted(k for k in second_node.remote.names() if k.endswith(".json")) == [
        "ckpt-000000010.json", "ckpt-000000020.json", "ckpt-000000050.json"]


@pytest.mark.slow
def test_a_run_resumes_from_s3_on_a_fresh_machine(tmp_path, s3):
    uri = ["checkpoint.uri=s3://spotring/runs/fresh", "dataset.train_size=640",
           "train.batch_size=32"]
    first = run_trainer(tmp_path / "one", *RUN, *uri, "train.max_steps=15", env=s3)
    assert first.summary["checkpoints"].endswith("and s3://spotring/runs/fresh")
    second = run_trainer(tmp_path / "two", *RUN, *uri, "train.max_steps=25", env=s3)
    assert "resumed at step 15" in second.output and second.summary["steps"] == 25
    assert second.summary["resumed_from"] == "s3://spotring/runs/fresh/ckpt-000000015.pt"


def test_unreachable_bucket_fails_before_training(tmp_path, s3):
    run = run_trainer(tmp_path / "run", "checkpoint.uri=s3://no-such-bucket/x",
                      "train.max_steps=1", expect=2, env=s3)
    assert "checkpoint.uri=s3://no-such-bucket/x: cannot reach bucket no-such-bucket" in \
        run.output
    assert not (tmp_path / "run" / "checkpoints").exists()


class OneRank:
    """The engine of a job of one rank, where the vote's sum is the rank's own vote."""

    device = torch.device("cpu")

    def start_sum(self, tensor, name):
        return lambda: tensor


def next_decision(watcher, timeout=10.0):
    """The first decision other than "go on", polled as the loop does at each step."""
    from spotring.preemption import Decision

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        decision = watcher.decide()
        if decision != Decision(None, False):
            return decision
        time.sleep(0.02)
    raise AssertionError(f"no decision within {timeout} s")


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGUSR1], ids=["TERM", "USR1"])
def test_a_signal_stops_at_a_step_boundary_and_its_handler_stays_until_restored(signum):
    # SLURM's warning before the time limit is SIGTERM or, as some users prefer, SIGUSR1.
    from omegaconf import OmegaConf

    from spotring.preemption import Decision, Preemption

    before = signal.getsignal(signum)
    cfg = OmegaConf.create({"imds": False, "poll_seconds": 1, "check_every_steps": 1})
    watcher = Preemption(cfg, OneRank(), local_rank=0)
    try:
        signal.raise_signal(signum)  # the process lives on: the handler only votes
        assert next_decision(watcher) == Decision(signal.Signals(signum).name, False)
        # Done watching, a job may still be naming a lost rank (torchrun's SIGTERM lands
        # there): a signal must not end it before restore_signals.
        watcher.close()
        assert signal.getsignal(signum) == watcher._on_signal
        signal.raise_signal(signum)
    finally:
        watcher.close()
        watcher.restore_signals()
    assert signal.getsignal(signum) == before


def test_the_watcher_survives_a_missed_first_probe_and_sees_a_rebalance_then_a_notice(
        monkeypatch):
    from omegaconf import OmegaConf

    from spotring.preemption import Decision, Preemption

    imds = MetadataStub(unavailable=1)
    monkeypatch.setenv("AWS_EC2_METADATA_SERVICE_ENDPOINT", imds.url)
    cfg = OmegaConf.create({"imds": True, "poll_seconds": 0.05, "check_every_steps": 1})
    watcher = Preemption(cfg, OneRank(), local_rank=0)
    try:
        imds.recommend_rebalance()
        assert next_decision(watcher) == Decision(None, True)  # checkpoint, and go on
        announced = time.time()
        imds.announce_interruption()
        decision = next_decision(watcher)  # the rebalance is not answered twice
        assert decision.stop.startswith("spot terminate notice for ") and not decision.checkpoint
        assert announced <= watcher.noticed_at <= time.time()  # when the watcher saw it
    finally:
        watcher.close()
        watcher.restore_signals()
        imds.close()
    assert imds.requests[0] == ("PUT", "/latest/api/token", False)  # the one refused


def test_close_waits_for_the_watcher(monkeypatch):
    # A watcher thread still running at interpreter exit drops the last reference to the
    # pending votes there, and freeing their tensor aborted runs that had succeeded.
    from omegaconf import OmegaConf

    from spotring.preemption import Preemption

    imds = MetadataStub()
    monkeypatch.setenv("AWS_EC2_METADATA_SERVICE_ENDPOINT", imds.url)
    cfg = OmegaConf.create({"imds": True, "poll_seconds": 0.05, "check_every_steps": 1})
    watcher = Preemption(cfg, OneRank(), local_rank=0)
    try:
        deadline = time.monotonic() + 10
        while len(imds.requests) < 3 and time.monotonic() < deadline:  # it is polling
            time.sleep(0.05)
        watcher.decide()  # votes in flight, as at the end of every run
        watcher.close()
        assert "spot-notice-watcher" not in [t.name for t in threading.enumerate()]
    finally:
        watcher.restore_signals()
        imds.close()


# ------------------------------------------------------------ the notice budget on S3


@pytest.mark.parametrize("cut", ["manifest_put", "short_pt", "manifest_differs"])
def test_a_save_cut_before_its_manifest_or_read_back_wrong_is_never_resumed_from(
        tmp_path, s3, monkeypatch, caplog, cut):
    uri = f"s3://spotring/runs/{cut}"
    node = Checkpoints(tmp_path / "node1", keep=3, uri=uri)
    save(node, 10, numel=1024)
    write = node.remote.write

    def damaged(name: str, data: bytes) -> None:
        if name.endswith(".json") and cut == "manifest_put":
            raise ConnectionResetError("the spot instance went away mid-upload")
        if name.endswith(".pt") and cut == "short_pt":  # a store that kept fewer bytes
            data = data[:-1]
        if name.endswith(".json") and cut == "manifest_differs":  # another writer's
            data = json.dumps(json.loads(data) | {"sha256": "0" * 64}).encode()
        write(name, data)

    monkeypatch.setattr(node.remote, "write", damaged)
    error = {"manifest_put": "went away mid-upload",
             "short_pt": f"{uri}/ckpt-000000020.pt: .* bytes stored of the .* written",
             "manifest_differs": f"{uri}/ckpt-000000020.json: reads back other than written"}
    with pytest.raises((ConnectionResetError, CheckpointNotSaved), match=error[cut]):
        save(node, 20, numel=1024)
    assert ("ckpt-000000020.json" in node.remote.names()) == (cut == "manifest_differs")

    fresh_node = Checkpoints(tmp_path / "node2", keep=3, uri=uri)
    assert find_resume("auto", fresh_node).manifest["step"] == 10
    if cut == "manifest_differs":
        assert f"skipping checkpoint: {uri}/ckpt-000000020.pt: corrupt" in caplog.text


@pytest.mark.slow
def test_a_stop_records_its_notice_to_s3_time_and_a_fresh_node_resumes_from_that_upload(
        tmp_path, s3):
    uri = "s3://spotring/runs/budget"
    job = Job(tmp_path / "spot", [f"checkpoint.uri={uri}"], s3, launcher="single", nproc=1)
    job.wait_for_step(10)
    signalled = time.time()
    job.proc.send_signal(signal.SIGTERM)
    run = job.finish()
    assert run.proc.returncode == 75, run.output[-4000:]
    note = json.loads((run.dir / "preempted.json").read_text())
    step = note["step"]
    assert signalled <= note["noticed_at"] <= note["local_saved_at"] <= note["saved_at"] \
        <= (run.dir / "preempted.json").stat().st_mtime
    blob = f"ckpt-{step:09d}.pt"
    on_s3 = boto3.client("s3").head_object(Bucket="spotring", Key=f"runs/budget/{blob}")
    assert note["upload_bytes"] == on_s3["ContentLength"] and note["upload_seconds"] > 0
    # The log line tells the same times, to its precision, and the upload's MB/s.
    line = next(x for x in run.output.splitlines() if "notice budget (SIGTERM)" in x)
    spent = note["saved_at"] - note["noticed_at"]
    assert f"to every store and read back {spent:.2f} s: " \
           f"{NOTICE_SECONDS - spent:.2f} s left" in line
    assert f"to the local copy {note['local_saved_at'] - note['noticed_at']:.2f} s" in line
    rate = note["upload_bytes"] / 1e6 / note["upload_seconds"]
    assert f"{uri} in {note['upload_seconds']:.2f} s ({rate:.1f} MB/s)" in line

    # Newer than the stop's checkpoint on S3: a manifest whose object is short, as an
    # upload cut by the reclaim leaves it. A fresh node skips it, naming it.
    remote = Checkpoints(tmp_path / "unused", keep=3, uri=uri).remote
    manifest = json.loads(remote.read(f"ckpt-{step:09d}.json"))
    later = f"ckpt-{step + 1:09d}"
    remote.write(f"{later}.pt", remote.read(blob)[: manifest["bytes"] // 2])
    remote.write(f"{later}.json", json.dumps(manifest | {"file": f"{later}.pt"}).encode())
    resumed = run_trainer(tmp_path / "fresh", *RUN, f"checkpoint.uri={uri}",
                          "train.batch_size=32", f"train.max_steps={step + 1}", env=s3)
    assert f"skipping checkpoint: {uri}/{later}.pt: truncated" in resumed.output
    assert f"resumed at step {step}" in resumed.output
