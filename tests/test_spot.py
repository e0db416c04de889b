"""Spot-proof training: interruption notices, checkpoints on S3, resuming anywhere.

The instance metadata service is a loopback stub (harness/imds.py): nothing real serves
it off EC2. S3 is a real moto server on 127.0.0.1 speaking HTTP.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import subprocess
import threading
import time
from pathlib import Path

import boto3
import pytest
import torch

import spotring
from harness.imds import MetadataStub
from harness.watcher import OneRank, next_decision
from spotring.checkpoint.layout import (
    EXTRAS,
    Checkpoint,
    CheckpointNotSaved,
    Checkpoints,
    find_resume,
    folder_name,
    manifest_name,
    manifests,
    newest_valid,
)
from spotring.checkpoint.manager import publish
from spotring.checkpoint.parts import METADATA, load_whole
from spotring.exits import EXIT_CONFIG, EXIT_PREEMPTED
from spotring.launch.commands import local_command, local_environment
from spotring.options import PreemptionOptions
from spotring.preemption import NOTICE_SECONDS
from spotring.stores import PART_BYTES
from tests.conftest import QUICK, REPO, Run, assert_close, run_trainer

# Synthetic MNIST-sized samples, 2 workers x 32: long enough that the run is still going
# when the notice comes, whenever that is; the resumed run and the reference stop a few
# steps after the notice's step (train.max_steps does not change the LR's horizon).
RUN = ["dataset=synthetic", "dataset.shape=[1,28,28]", "dataset.train_size=64000",
       "dataset.test_size=200", "train.epochs=1", "train.threads=1", "telemetry.log_every=1",
       "preemption.poll_seconds=0.2", "train.dtype=float64", "train.batch_size=32"]


class Job:
    """The trainer running under ``launcher`` (``nproc`` ranks), watched as it runs."""

    def __init__(self, run_dir: Path, overrides: list[str], env: dict[str, str],
                 launcher: str, nproc: int) -> None:
        self.run_dir = run_dir
        args = [f"hydra.run.dir={run_dir}", *QUICK, *overrides]
        self.proc = subprocess.Popen(local_command(launcher, nproc, args), cwd=REPO,
                                     env=local_environment(**env), stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True,
                                     start_new_session=True)
        self.lines: list[str] = []
        self.reader = threading.Thread(target=lambda: self.lines.extend(self.proc.stdout),
                                       daemon=True)
        self.reader.start()

    def steps_done(self) -> int:
        """The newest step rank 0 logged in metrics.jsonl (a lower bound)."""
        path = self.run_dir / "metrics.jsonl"
        steps = [json.loads(line)["step"] for line in path.read_text().splitlines()
                 if line.endswith("}")] if path.exists() else []
        return max(steps, default=0)

    def wait_for_step(self, step: int, timeout: float = 300) -> None:
        deadline = time.monotonic() + timeout
        while self.steps_done() < step:
            assert self.proc.poll() is None, "".join(self.lines)
            assert time.monotonic() < deadline, "".join(self.lines)
            time.sleep(0.05)

    def finish(self, timeout: float = 300) -> Run:
        try:
            self.proc.wait(timeout=timeout)
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
        self.reader.join(timeout=30)  # the pipe's last lines
        return Run(self.run_dir, subprocess.CompletedProcess(self.proc.args, self.proc.returncode,
                                                              "".join(self.lines), ""))


@pytest.mark.slow
def test_the_trainer_stops_on_a_notice_and_a_fresh_machine_resumes_from_s3_exactly(
        tmp_path, s3):
    """The trainer is a user of the library (whose stops and resumes tests/test_resume.py
    proves): its checkpoint.uri and preemption options reach spotring.init, its loop
    stops every rank at one step on an EC2 notice with a checkpoint on S3 and exit 75
    (torchrun reports it; rank 0's preempted.json says why), and the same command on a
    fresh machine with one worker and accumulation 2 (the same global batch) skips a
    newer checkpoint whose upload was cut and ends with an uninterrupted run's weights."""
    uri = "s3://spotring/runs/trainer"
    imds = MetadataStub()
    try:
        job = Job(tmp_path / "spot", [*RUN, f"checkpoint.uri={uri}"],
                  s3 | {"AWS_EC2_METADATA_SERVICE_ENDPOINT": imds.url}, "torchrun", 2)
        job.wait_for_step(10)
        imds.announce_interruption()
        run = job.finish()
    finally:
        imds.close()
    assert f"exitcode  : {EXIT_PREEMPTED}" in run.output, run.output[-4000:]
    note = json.loads((run.dir / "preempted.json").read_text())
    step = note["step"]
    assert note["reason"].startswith("EC2 spot terminate notice for ") and step >= 10, note
    # The notice budget: on S3 and read back well within EC2's two minutes.
    assert note["noticed_at"] <= note["local_saved_at"] <= note["saved_at"] \
        < note["noticed_at"] + NOTICE_SECONDS
    remote = Checkpoints(tmp_path / "unused", keep=3, uri=uri).remote
    stopped = newest_valid(tmp_path / "unused", uri)
    assert stopped.step == step and note["upload_bytes"] == stopped.manifest["bytes"]
    line = next(x for x in run.output.splitlines() if "notice budget (EC2" in x)
    assert f"to every store and read back {note['saved_at'] - note['noticed_at']:.2f} s" in line

    # Newer than the stop's checkpoint on S3: a manifest whose data part is short, as an
    # upload cut by the reclaim leaves it. A fresh machine skips it, naming the part.
    later = step + 1
    short = f"{folder_name(step)}/__0_0.distcp"  # rank 0's data part
    cut = short.replace(folder_name(step), folder_name(later))
    for name in stopped.parts():
        data = remote.read(name)
        if name == short:
            whole = len(data)
            data = data[: whole // 2]
        remote.write(name.replace(folder_name(step), folder_name(later)), data)
    remote.write(manifest_name(later), json.dumps(stopped.manifest | {"step": later}).encode())
    end = [f"train.max_steps={step + 5}"]
    resumed = run_trainer(tmp_path / "fresh", *RUN, f"checkpoint.uri={uri}", *end,
                          "train.accumulation=2", launcher="spawned", env=s3)
    assert f"skipping checkpoint: {uri}/{cut}: truncated, {whole // 2} of {whole} bytes" \
        in resumed.output
    assert f"resumed at step {step}" in resumed.output
    assert resumed.summary["resumed_from"] == f"{uri}/{folder_name(step)}"
    assert resumed.summary["world_size"] == 1 and resumed.summary["steps"] == step + 5
    whole_run = run_trainer(tmp_path / "whole", *RUN, *end, "train.batch_size=64",
                            launcher="spawned")
    assert_close(resumed.params(), whole_run.params(), rtol=1e-10)  # float64


# ------------------------------------------------------------------------------- S3


def big_state(step: int, numel: int = 10 * 1024 * 1024) -> dict:
    # 40 MB by default, in one part: uploaded in three chunks of 16 MB (stores.PART_BYTES).
    return {"model": {"w": torch.full((numel,), float(step))}}


def save(checkpoints: Checkpoints, step: int, **state):
    return publish(checkpoints, big_state(step, **state),
                   {"step": step, "epoch": 0, "offset": 0, "model": {"name": "convnet"},
                    "dataset": "mnist"}, {"step": step})


def data_part(checkpoint: Checkpoint) -> str:
    """The name in its store of a checkpoint's one data part (DCP's, of rank 0)."""
    (part,) = (name for name in checkpoint.parts()
               if name.rsplit("/", 1)[1] not in (METADATA, EXTRAS))
    return part


def test_s3_checkpoints_resume_on_a_new_node_and_a_cut_upload_is_never_picked(
        tmp_path, s3, caplog):
    uri = "s3://spotring/runs/a"
    first_node = Checkpoints(tmp_path / "node1", keep=2, uri=uri)
    save(first_node, 10)
    saved = save(first_node, 20)
    assert saved.location == str(tmp_path / "node1" / folder_name(20))
    # Every part on S3, as long as its manifest says; the data part went up in chunks.
    on_s3 = first_node.found([first_node.remote])[0]
    assert on_s3.location == f"{uri}/{folder_name(20)}"
    assert first_node.remote.sizes(folder_name(20) + "/") == {
        name: part["bytes"] for name, part in on_s3.parts().items()}
    assert first_node.remote.size(data_part(on_s3)) > 2 * PART_BYTES

    # The upload of step 30's data part is cut off after its first 16 MB chunk.
    original = first_node.remote.client.upload_part

    def cut(*args, **kwargs):
        if kwargs["PartNumber"] >= 2:
            raise ConnectionResetError("the spot instance went away mid-upload")
        return original(*args, **kwargs)

    first_node.remote.client.upload_part = cut
    with pytest.raises(CheckpointNotSaved) as cut_off:
        save(first_node, 30)
    # It names the rank and the object.
    assert (f"rank 0: CheckpointNotSaved: {uri}/{folder_name(30)}/" in str(cut_off.value)
            and "not uploaded (ConnectionResetError: the spot instance went away "
            "mid-upload)" in str(cut_off.value))
    client = boto3.client("s3")
    keys = [o["Key"] for o in client.list_objects_v2(Bucket="spotring",
                                                     Prefix="runs/a/")["Contents"]]
    assert f"runs/a/{manifest_name(30)}" not in keys
    assert not [k for k in keys if k.startswith(f"runs/a/{folder_name(30)}/")], keys
    # The cut multipart upload was aborted: nothing of it is kept (nor billed).
    assert not client.list_multipart_uploads(Bucket="spotring", Prefix="runs/a/").get("Uploads")
    assert manifest_name(30) not in first_node.local.names()  # nor on the node's disk

    # A new node: empty disk, same S3 prefix.
    second_node = Checkpoints(tmp_path / "node2", keep=2, uri=uri)
    assert [c.step for c in find_resume("auto", second_node)] == [20, 10]
    found = second_node.newest_valid()
    assert found.step == 20 and found.location == f"{uri}/{folder_name(20)}"
    assert torch.equal(load_whole(found)["model"]["w"][:3], torch.full((3,), 20.0))

    # Parts uploaded whole but their manifest never written: still invisible.
    remote = second_node.remote
    for name in found.parts():
        client.copy_object(Bucket="spotring", CopySource=f"spotring/runs/a/{name}",
                           Key=f"runs/a/{name.replace(folder_name(20), folder_name(40))}")
    assert second_node.newest_valid().step == 20
    assert [c.step for c in second_node.found()] == [20, 10]
    # A manifest whose part is corrupt (as long as written, other bytes) is reported,
    # naming the part, and skipped.
    manifest = json.loads(remote.read(manifest_name(20)))
    for name in found.parts():
        data = remote.read(name)
        if name.endswith(EXTRAS):
            data = data[:-100] + bytes([data[-100] ^ 0xFF]) + data[-99:]
        remote.write(name.replace(folder_name(20), folder_name(50)), data)
    remote.write(manifest_name(50), json.dumps(manifest | {"step": 50}).encode())
    with caplog.at_level(logging.WARNING, logger="spotring"):
        assert second_node.newest_valid().step == 20
    assert f"skipping checkpoint: {uri}/{folder_name(50)}/{EXTRAS}: corrupt, sha256 does not " \
           "match its manifest" in caplog.text
    assert manifests(remote.names()) == [manifest_name(s) for s in (50, 20, 10)]


def test_an_unreachable_bucket_exits_2_at_init_before_anything(tmp_path, s3, capsys):
    with pytest.raises(SystemExit) as e:
        spotring.init(run_dir=tmp_path / "run", checkpoint_uri="s3://no-such-bucket/x",
                      notices="none")
    assert e.value.code == EXIT_CONFIG
    assert "error: checkpoint.uri=s3://no-such-bucket/x: cannot reach bucket no-such-bucket" \
        in capsys.readouterr().err
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGUSR1], ids=["TERM", "USR1"])
def test_a_signal_stops_at_a_step_boundary_and_its_handler_stays_until_restored(signum):
    # SLURM's warning before the time limit is SIGTERM or, as some users prefer, SIGUSR1.
    from spotring.preemption import Decision, Preemption

    before = signal.getsignal(signum)
    watcher = Preemption(PreemptionOptions(notices="none", poll_seconds=1), OneRank(),
                         local_rank=0)
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
    from spotring.preemption import Decision, Preemption

    imds = MetadataStub(unavailable=1)
    monkeypatch.setenv("AWS_EC2_METADATA_SERVICE_ENDPOINT", imds.url)
    watcher = Preemption(PreemptionOptions(notices="ec2", poll_seconds=0.05), OneRank(),
                         local_rank=0)
    try:
        imds.recommend_rebalance()
        assert next_decision(watcher) == Decision(None, True)  # checkpoint, and go on
        announced = time.time()
        imds.announce_interruption()
        decision = next_decision(watcher)  # the rebalance is not answered twice
        assert decision.stop.startswith("EC2 spot terminate notice for ") \
            and not decision.checkpoint
        assert announced <= watcher.noticed_at <= time.time()  # when the watcher saw it
    finally:
        watcher.close()
        watcher.restore_signals()
        imds.close()
    assert imds.requests[0] == ("PUT", "/latest/api/token", False)  # the one refused


def test_close_waits_for_the_watcher(monkeypatch):
    # A watcher thread still running at interpreter exit drops the last reference to the
    # pending votes there, and freeing their tensor aborted runs that had succeeded.
    from spotring.preemption import Preemption

    imds = MetadataStub()
    monkeypatch.setenv("AWS_EC2_METADATA_SERVICE_ENDPOINT", imds.url)
    watcher = Preemption(PreemptionOptions(notices="ec2", poll_seconds=0.05), OneRank(),
                         local_rank=0)
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


@pytest.mark.parametrize("cut", ["manifest_put", "short_part", "manifest_differs"])
def test_a_save_cut_before_its_manifest_or_read_back_wrong_is_never_resumed_from(
        tmp_path, s3, monkeypatch, caplog, cut):
    uri = f"s3://spotring/runs/{cut}"
    node = Checkpoints(tmp_path / "node1", keep=3, uri=uri)
    save(node, 10, numel=1024)
    name_in_folder = data_part(node.newest_valid()).rsplit("/", 1)[1]
    part = f"{folder_name(20)}/{name_in_folder}"  # step 20's data part
    write, upload = node.remote.write, node.remote.upload

    def damaged_write(name: str, data: bytes) -> None:
        if name.endswith(".json") and cut == "manifest_put":
            raise ConnectionResetError("the spot instance went away mid-upload")
        if name.endswith(".json") and cut == "manifest_differs":  # another writer's
            other = json.loads(data)
            other["parts"][name_in_folder]["sha256"] = "0" * 64
            data = json.dumps(other).encode()
        write(name, data)

    def short_upload(name: str, path: Path) -> None:
        if name == part and cut == "short_part":  # a store that kept fewer bytes
            return write(name, path.read_bytes()[:-1])
        return upload(name, path)

    monkeypatch.setattr(node.remote, "write", damaged_write)
    monkeypatch.setattr(node.remote, "upload", short_upload)
    with pytest.raises(CheckpointNotSaved) as e:
        save(node, 20, numel=1024)
    written = (tmp_path / "node1" / part).stat().st_size
    error = {"manifest_put": "rank 0: ConnectionResetError: the spot instance went away",
             "short_part": f"{uri}/{part}: {written - 1} bytes stored of the {written} "
                           "written",
             "manifest_differs": f"{uri}/{manifest_name(20)}: reads back other than written"}
    assert error[cut] in str(e.value)
    assert (manifest_name(20) in node.remote.names()) == (cut == "manifest_differs")

    fresh_node = Checkpoints(tmp_path / "node2", keep=3, uri=uri)
    with caplog.at_level(logging.WARNING, logger="spotring"):
        assert fresh_node.newest_valid().step == 10
    if cut == "manifest_differs":
        assert f"skipping checkpoint: {uri}/{part}: corrupt, sha256 does not match its " \
               "manifest" in caplog.text
    else:
        assert [c.step for c in fresh_node.found()] == [10]
