"""Checkpoints: atomic, verified, pruned; resume continues exactly where a run stopped."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from spotring.checkpoint import Checkpoints, CorruptCheckpoint, find_resume
from spotring.exits import ConfigError
from tests.conftest import REPO, assert_close

MODEL = {"name": "convnet", "l1": 0.0, "channels": [32, 64], "kernels": [5, 5], "hidden": 128}


def save(checkpoints: Checkpoints, step: int, model=MODEL) -> None:
    checkpoints.save({"model": {"w": torch.full((64, 64), float(step))}, "position": step},
                     {"step": step, "epoch": 0, "offset": step, "model": model,
                      "dataset": "mnist", "world_size": 1, "global_batch": 64})


def test_save_keeps_the_last_k_and_nothing_half_written(tmp_path):
    checkpoints = Checkpoints(tmp_path, keep=2)
    for step in (10, 20, 30):
        save(checkpoints, step)
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "ckpt-000000020.json", "ckpt-000000020.pt", "ckpt-000000030.json", "ckpt-000000030.pt"]
    manifest = json.loads((tmp_path / "ckpt-000000030.json").read_text())
    assert manifest["bytes"] == (tmp_path / "ckpt-000000030.pt").stat().st_size
    assert find_resume("auto", checkpoints).load()["position"] == 30


# A writer SIGKILLed while it writes sys.argv[1]: the bytes are written, not yet renamed.
KILLED_MID_WRITE = """
import os, signal, sys
from pathlib import Path
from spotring.stores import write_atomic
os.fsync = lambda fd: os.kill(os.getpid(), signal.SIGKILL)
write_atomic(Path(sys.argv[1]), b"half a checkpoint")
"""


def test_the_file_of_a_writer_killed_mid_write_goes_with_the_next_save(tmp_path):
    checkpoints = Checkpoints(tmp_path, keep=2)
    save(checkpoints, 10)
    killed = subprocess.run([sys.executable, "-c", KILLED_MID_WRITE,
                             str(tmp_path / "ckpt-000000020.pt")], cwd=REPO)
    assert killed.returncode == -signal.SIGKILL
    (orphan,) = (p for p in tmp_path.iterdir() if p.name.startswith(".ckpt-000000020.pt."))
    assert orphan.read_bytes() == b"half a checkpoint"
    # A write still under way (in this test: modified later than the next save).
    later = time.time_ns() + 60 * 10**9
    under_way = tmp_path / f".ckpt-000000030.pt.{os.getpid()}.0123abcd.tmp"
    under_way.write_bytes(b"")
    os.utime(under_way, ns=(later, later))
    save(checkpoints, 20)
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        under_way.name, "ckpt-000000010.json", "ckpt-000000010.pt", "ckpt-000000020.json",
        "ckpt-000000020.pt"]
    assert find_resume("auto", checkpoints).manifest["step"] == 20


@pytest.mark.parametrize("damage", ["truncate", "flip", "no_manifest", "bad_manifest"])
def test_a_damaged_newest_checkpoint_is_reported_and_skipped(tmp_path, damage, caplog):
    checkpoints = Checkpoints(tmp_path, keep=3)
    save(checkpoints, 10)
    save(checkpoints, 20)
    blob, manifest = tmp_path / "ckpt-000000020.pt", tmp_path / "ckpt-000000020.json"
    data = blob.read_bytes()
    if damage == "truncate":
        blob.write_bytes(data[: len(data) // 2])
    elif damage == "flip":  # torch.load would accept this and return wrong weights
        blob.write_bytes(data[:-200] + bytes([data[-200] ^ 0xFF]) + data[-199:])
    elif damage == "no_manifest":  # a crash between the two renames
        manifest.unlink()
    else:
        manifest.write_text("{not json")
    found = find_resume("auto", checkpoints)
    assert found.manifest["step"] == 10
    assert torch.equal(found.load()["model"]["w"], torch.full((64, 64), 10.0))
    if damage != "no_manifest":
        assert "skipping checkpoint" in caplog.text and "ckpt-000000020" in caplog.text
    if damage == "truncate":
        assert f"truncated, {len(data) // 2} of {len(data)} bytes" in caplog.text
    if damage == "flip":
        assert "sha256 does not match" in caplog.text


def test_resume_path_verifies_the_file_and_refuses_a_corrupt_one(tmp_path):
    checkpoints = Checkpoints(tmp_path, keep=3)
    save(checkpoints, 10)
    blob = tmp_path / "ckpt-000000010.pt"
    assert find_resume(str(blob), checkpoints).manifest["step"] == 10
    blob.write_bytes(blob.read_bytes()[:100])
    with pytest.raises(ConfigError, match="truncated"):
        find_resume(str(blob), checkpoints)
    with pytest.raises(ConfigError, match="no such checkpoint"):
        find_resume(str(tmp_path / "nope.pt"), checkpoints)
    with pytest.raises(CorruptCheckpoint):
        checkpoints.verify("ckpt-000000010.json", checkpoints.local)


def test_resume_never_refuses_to_mix_with_existing_checkpoints(tmp_path):
    checkpoints = Checkpoints(tmp_path, keep=3)
    assert find_resume("never", checkpoints) is None
    save(checkpoints, 10)
    with pytest.raises(ConfigError, match="already holds checkpoints"):
        find_resume("never", checkpoints)


def test_a_checkpoint_of_another_run_is_refused_with_both_named(tmp_path):
    checkpoints = Checkpoints(tmp_path, keep=3)
    save(checkpoints, 10, model={"name": "lenet"})
    found = find_resume("auto", checkpoints)
    with pytest.raises(ConfigError) as e:
        found.check_matches({"model": MODEL, "dataset": "mnist"})
    assert "lenet" in str(e.value) and "convnet" in str(e.value)
    found.check_matches({"model": {"name": "lenet"}, "dataset": "mnist", "other": 1})


def test_the_trainer_checks_the_network_not_its_l1_penalty():
    from spotring.trainer.loop import annotations
    from tests.conftest import compose_config

    plain, penalised = (annotations(compose_config("model=lenet", *more))
                        for more in ([], ["model.l1=1e-5"]))
    assert plain == penalised and plain["dataset"] == "mnist"
    assert annotations(compose_config("model=convnet"))["model"] != plain["model"]


# ------------------------------------------------------------------ resume, end to end

STEPS = ["dataset=synthetic", "dataset.shape=[1,28,28]", "dataset.train_size=2000",
         "train.batch_size=64", "train.epochs=3", "train.seed=5"]


@pytest.mark.slow
def test_resume_mid_epoch_ends_with_the_parameters_of_an_uninterrupted_run(train):
    # 2000 samples / 64 = 31 steps per epoch: step 40 is in the middle of epoch 2. One
    # worker here; resuming with several (and on another number of them) is in
    # test_spot.py and test_horovod.py.
    whole = train("whole", *STEPS, "train.max_steps=70")
    first = train("parts", *STEPS, "train.max_steps=40", "checkpoint.every_steps=15")
    assert [p.name for p in first.checkpoints()] == [
        "ckpt-000000030.pt", "ckpt-000000031.pt", "ckpt-000000040.pt"]  # every 15, epoch, end
    # A newer spotring's checkpoint format is refused, naming both, before training.
    manifest = first.dir / "checkpoints" / "ckpt-000000040.json"
    written = manifest.read_text()
    manifest.write_text(json.dumps(json.loads(written) | {"format": 2}))
    newer = train("parts", *STEPS, "train.max_steps=70", expect=2)
    assert "ckpt-000000040.json is in checkpoint format 2, written by a newer spotring; " \
           "this spotring reads format 1 and older" in newer.output
    assert "Traceback" not in newer.output
    manifest.write_text(written)
    second = train("parts", *STEPS, "train.max_steps=70")
    assert "resumed at step 40 (epoch 2, sample 576 of its order)" in second.output
    # metrics.jsonl numbers that epoch as the log does (steps 32 to 62 are epoch 2).
    records = map(json.loads, (second.dir / "metrics.jsonl").read_text().splitlines())
    assert {r["epoch"] for r in records if r["kind"] == "train" and 40 < r["step"] <= 62} == {2}
    assert second.summary["steps"] == 70 and second.summary["steps_this_run"] == 30
    assert second.summary["resumed_from"].endswith("ckpt-000000040.pt")
    assert_close(second.params(), whole.params(), rtol=0)  # bit for bit
    assert second.summary["test_loss"] == whole.summary["test_loss"]
    # And a run resumed at its very end finishes at once.
    again = train("parts", *STEPS, "train.max_steps=70")
    assert again.summary["steps"] == 70 and again.summary["steps_this_run"] == 0
