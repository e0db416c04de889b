"""Checkpoints: atomic, verified, pruned; resume continues exactly where a run stopped.

A checkpoint is a folder of parts (DCP's .metadata, each rank's data file, rank 0's
spotring.pt) published by its manifest, written last (spotring/checkpoint/layout.py); format 1,
one .pt beside its manifest, is still read. The names come from spotring.checkpoint."""

from __future__ import annotations

import errno
import hashlib
import io
import json
import logging
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import spotring
from spotring.checkpoint.layout import (
    EXTRAS,
    FORMAT,
    SINGLE_FILE,
    CheckpointNotSaved,
    Checkpoints,
    CorruptCheckpoint,
    files_of,
    find_resume,
    folder_name,
    manifest_name,
)
from spotring.checkpoint.manager import publish
from spotring.checkpoint.parts import METADATA, load_whole
from spotring.exits import ConfigError
from tests.conftest import REPO, assert_close, run_trainer

MODEL = {"name": "convnet", "l1": 0.0, "channels": [32, 64], "kernels": [5, 5], "hidden": 128}


def meta(step: int, model=MODEL) -> dict:
    return {"step": step, "epoch": 0, "offset": step, "model": model, "dataset": "mnist",
            "world_size": 1, "global_batch": 64}


def save(checkpoints: Checkpoints, step: int, model=MODEL):
    """One process's checkpoint of ``step``: a tensor through DCP, a position beside it."""
    return publish(checkpoints, {"model": {"w": torch.full((64, 64), float(step))}},
                   meta(step, model), {"position": step, "spotring": {"step": step}})


def data_part(directory: Path, step: int) -> Path:
    """The one rank's data file in the folder of ``step`` (DCP names it)."""
    (part,) = (p for p in (directory / folder_name(step)).iterdir()
               if p.name not in (METADATA, EXTRAS))
    return part


def test_save_keeps_the_last_k_and_nothing_half_written(tmp_path):
    checkpoints = Checkpoints(tmp_path, keep=2)
    for step in (10, 20):
        save(checkpoints, step)
    saved = save(checkpoints, 30)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        [folder_name(20), manifest_name(20), folder_name(30), manifest_name(30)])
    folder = tmp_path / folder_name(30)
    part = data_part(tmp_path, 30)
    assert sorted(p.name for p in folder.iterdir()) == sorted([METADATA, EXTRAS, part.name])
    # The manifest holds every part's size and sha256, as the disk has them.
    manifest = json.loads((tmp_path / manifest_name(30)).read_text())
    assert manifest["format"] == FORMAT and manifest["step"] == 30
    assert manifest["parts"] == {
        p.name: {"bytes": p.stat().st_size,
                 "sha256": hashlib.sha256(p.read_bytes()).hexdigest()}
        for p in folder.iterdir()}
    assert manifest["bytes"] == sum(p.stat().st_size for p in folder.iterdir())
    assert (saved.location, saved.bytes, saved.rank_bytes, saved.parts) == (
        str(folder), manifest["bytes"], manifest["bytes"], 3)
    assert re.fullmatch(rf"0\.0 MB in 3 parts \(at most 0\.0 MB from one rank\): "
                        rf"{re.escape(str(tmp_path))} in \d+\.\d\d s \(\d+\.\d MB/s\)",
                        saved.describe()), saved.describe()
    # Found newest first, manifests read; the newest valid one loads whole.
    assert [c.step for c in find_resume("auto", checkpoints)] == [30, 20]
    newest = checkpoints.newest_valid()
    assert newest.location == str(folder)
    loaded = load_whole(newest)
    assert loaded["position"] == 30 and loaded["spotring"] == {"step": 30}
    assert torch.equal(loaded["model"]["w"], torch.full((64, 64), 30.0))


# A writer SIGKILLed while it writes sys.argv[1] (stdin's bytes): written, not renamed.
KILLED_MID_WRITE = """
import os, signal, sys
from pathlib import Path
from spotring.stores import write_atomic
os.fsync = lambda fd: os.kill(os.getpid(), signal.SIGKILL)
write_atomic(Path(sys.argv[1]), sys.stdin.buffer.read())
"""


@pytest.mark.parametrize("cut_in", ["a_part", "the_manifest"])
def test_what_a_save_cut_midway_leaves_goes_with_the_next_save(tmp_path, monkeypatch, cut_in):
    checkpoints = Checkpoints(tmp_path, keep=2)
    save(checkpoints, 10)
    part = data_part(tmp_path, 10).name  # the same name in every folder of one process
    if cut_in == "a_part":  # DCP's write of the data fails midway: a full disk
        fsync = os.fsync

        def full(fd: int) -> None:
            if os.readlink(f"/proc/self/fd/{fd}").endswith(part):
                raise OSError(errno.ENOSPC, "No space left on device")
            fsync(fd)

        monkeypatch.setattr(os, "fsync", full)
    else:  # every part written, the manifest's writer SIGKILLed before its rename
        write = checkpoints.local.write

        def killed(name: str, data: bytes) -> None:
            if name != manifest_name(20):
                return write(name, data)
            writer = subprocess.run([sys.executable, "-c", KILLED_MID_WRITE,
                                     str(tmp_path / name)], input=data, cwd=REPO)
            assert writer.returncode == -signal.SIGKILL
            raise ConnectionAbortedError("the writer was killed")  # this process is not

        monkeypatch.setattr(checkpoints.local, "write", killed)
    # What Checkpoints.save documents for any failure: CheckpointNotSaved, naming the rank.
    error = {"a_part": "rank 0: .*No space left on device",
             "the_manifest": "rank 0: ConnectionAbortedError: the writer was killed"}
    with pytest.raises(CheckpointNotSaved, match=error[cut_in]):
        save(checkpoints, 20)
    monkeypatch.undo()
    left = tmp_path / folder_name(20)
    assert (left / part).is_file()  # a part of step 20, no manifest
    if cut_in == "the_manifest":
        assert sorted(p.name for p in left.iterdir()) == sorted([METADATA, EXTRAS, part])
        (orphan,) = (p for p in tmp_path.iterdir()
                     if p.name.startswith(f".{manifest_name(20)}."))
        assert json.loads(orphan.read_text())["step"] == 20
    assert not (tmp_path / manifest_name(20)).exists()
    # Without its manifest step 20 does not exist for a reader.
    assert [c.step for c in checkpoints.found()] == [10]
    assert checkpoints.newest_valid().step == 10
    # A write still under way (in this test: modified later than the next save).
    later = time.time_ns() + 60 * 10**9
    under_way = tmp_path / f".{manifest_name(40)}.{os.getpid()}.0123abcd.tmp"
    under_way.write_bytes(b"")
    os.utime(under_way, ns=(later, later))
    save(checkpoints, 30)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        [under_way.name, folder_name(10), manifest_name(10), folder_name(30),
         manifest_name(30)])
    assert checkpoints.newest_valid().step == 30


@pytest.mark.parametrize("damage", ["truncate", "flip", "missing", "no_manifest",
                                    "bad_manifest"])
def test_a_damaged_newest_checkpoint_is_reported_naming_the_part_and_skipped(
        tmp_path, damage, caplog):
    checkpoints = Checkpoints(tmp_path, keep=3)
    save(checkpoints, 10)
    save(checkpoints, 20)
    part, manifest = data_part(tmp_path, 20), tmp_path / manifest_name(20)
    data = part.read_bytes()
    problem = None
    if damage == "truncate":
        part.write_bytes(data[: len(data) // 2])
        problem = f"{part}: truncated, {len(data) // 2} of {len(data)} bytes"
    elif damage == "flip":  # DCP would read this and return wrong weights
        middle = len(data) // 2
        part.write_bytes(data[:middle] + bytes([data[middle] ^ 0xFF]) + data[middle + 1:])
        problem = f"{part}: corrupt, sha256 does not match its manifest"
    elif damage == "missing":
        (part.parent / EXTRAS).unlink()
        problem = f"{part.parent / EXTRAS}: missing"
    elif damage == "no_manifest":  # a crash before the manifest's rename
        manifest.unlink()
    else:
        manifest.write_text("{not json")
    with caplog.at_level(logging.WARNING, logger="spotring"):
        found = checkpoints.newest_valid()
    assert found.step == 10
    assert torch.equal(load_whole(found)["model"]["w"], torch.full((64, 64), 10.0))
    if damage == "bad_manifest":
        assert f"skipping checkpoint: {manifest}: unreadable" in caplog.text
    if problem is not None:
        assert f"skipping checkpoint: {problem}" in caplog.text
        # Found, not yet checked; checking names the part.
        newest = find_resume("auto", checkpoints)[0]
        assert newest.step == 20 and newest.problems(newest.parts()) == [problem]
        with pytest.raises(CorruptCheckpoint, match=re.escape(problem)):
            newest.verify()
    if damage == "no_manifest":
        assert "skipping checkpoint" not in caplog.text


def test_resume_path_names_a_checkpoint_by_its_manifest_or_folder(tmp_path):
    checkpoints = Checkpoints(tmp_path, keep=3)
    save(checkpoints, 10)
    for path in (tmp_path / manifest_name(10), tmp_path / folder_name(10)):
        (found,) = find_resume(str(path), checkpoints)
        assert found.step == 10 and found.location == str(tmp_path / folder_name(10))
        found.verify()
        assert load_whole(found)["position"] == 10
    part = data_part(tmp_path, 10)
    part.write_bytes(part.read_bytes()[:100])
    (found,) = find_resume(str(tmp_path / folder_name(10)), checkpoints)
    with pytest.raises(CorruptCheckpoint, match=re.escape(f"{part}: truncated, 100 of ")):
        found.verify()
    with pytest.raises(ConfigError, match="no such checkpoint"):
        find_resume(str(tmp_path / "nope"), checkpoints)
    # A manifest of a newer spotring is refused, naming it, not skipped for an older one.
    newer = tmp_path / manifest_name(20)
    newer.write_text(json.dumps(meta(20) | {"format": FORMAT + 1, "parts": {}}))
    with pytest.raises(ConfigError, match=f"{re.escape(str(newer))} is in checkpoint format "
                                          f"{FORMAT + 1}, written by a newer spotring"):
        find_resume("auto", checkpoints)


def restore_job(run_dir: Path, source: str) -> int | None:
    """A job of one process, tracking a model and its optimizer, restored from ``source``."""
    job = spotring.init(run_dir=run_dir, notices="none", device="cpu", threads=1)
    try:  # not `with`: it would turn a ConfigError into exit 2
        model = torch.nn.Linear(3, 1)
        model, optimizer = job.wrap(model, torch.optim.SGD(model.parameters(), lr=0.1))
        job.track(model=model, optimizer=optimizer)
        return job.save(background=False) if source == "save" else job.restore(source)
    finally:
        job.close()


def test_resume_path_refuses_a_corrupt_checkpoint_naming_the_part(tmp_path):
    """resume=PATH names one checkpoint: one that fails its manifest is refused, not
    skipped for a fresh start (docs/design.md: "resume=PATH takes that file, verified
    against its manifest")."""
    assert restore_job(tmp_path / "first", "save") == 0
    directory = tmp_path / "first" / "checkpoints"
    assert restore_job(tmp_path / "again", str(directory / folder_name(0))) == 0
    part = data_part(directory, 0)
    part.write_bytes(part.read_bytes()[:10])
    with pytest.raises(ConfigError, match=re.escape(f"{part}: truncated, 10 of ")):
        restore_job(tmp_path / "second", str(directory / folder_name(0)))


def legacy(directory: Path, step: int) -> Path:
    """A format-1 checkpoint of ``step`` as spotring wrote it before sharded checkpoints:
    the whole state in one .pt beside its manifest. Returns the .pt."""
    manifest, _, single = files_of(manifest_name(step))
    buffer = io.BytesIO()
    torch.save({"model": {"w": torch.full((64, 64), float(step))}, "position": step},
               buffer)
    payload = buffer.getvalue()
    (directory / single).write_bytes(payload)
    (directory / manifest).write_text(json.dumps(
        {"format": SINGLE_FILE, "file": single, "bytes": len(payload),
         "sha256": hashlib.sha256(payload).hexdigest()} | meta(step)))
    return directory / single


def test_a_format_1_checkpoint_is_still_read_verified_and_pruned(tmp_path, caplog):
    directory = tmp_path / "upgraded"
    directory.mkdir()
    single = legacy(directory, 10)
    checkpoints = Checkpoints(directory, keep=2)
    found = checkpoints.newest_valid()
    assert (found.step, found.location, found.format) == (10, str(single), 1)
    assert load_whole(found)["position"] == 10
    (by_path,) = find_resume(str(single), checkpoints)
    assert by_path.step == 10 and load_whole(by_path)["position"] == 10
    # After the upgrade: a format-2 checkpoint beside it, damaged, falls back to it.
    save(checkpoints, 20)
    data_part(directory, 20).unlink()
    assert checkpoints.newest_valid().location == str(single)
    # Its own damage is named, the .pt being its one part.
    data = single.read_bytes()
    single.write_bytes(data[:-1])
    with caplog.at_level(logging.WARNING, logger="spotring"):
        assert checkpoints.newest_valid() is None
    assert f"skipping checkpoint: {single}: truncated, {len(data) - 1} of {len(data)} bytes" \
        in caplog.text
    # Newer saves drop it with the rest beyond keep.
    save(checkpoints, 30)
    save(checkpoints, 40)
    assert sorted(p.name for p in directory.iterdir()) == sorted(
        [folder_name(30), manifest_name(30), folder_name(40), manifest_name(40)])


def test_resume_never_refuses_to_mix_with_existing_checkpoints(tmp_path):
    checkpoints = Checkpoints(tmp_path, keep=3)
    assert find_resume("never", checkpoints) == []
    save(checkpoints, 10)
    with pytest.raises(ConfigError, match="already holds checkpoints"):
        find_resume("never", checkpoints)


def test_a_checkpoint_of_another_run_is_refused_with_both_named(tmp_path):
    checkpoints = Checkpoints(tmp_path, keep=3)
    save(checkpoints, 10, model={"name": "lenet"})
    (found,) = find_resume("auto", checkpoints)
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
def test_resume_mid_epoch_ends_with_the_parameters_of_an_uninterrupted_run(tmp_path):
    # 2000 samples / 64 = 31 steps per epoch: step 40 is in the middle of epoch 2. One
    # worker here; resuming with several (and on another number of them) is in
    # test_resume.py, test_spot.py and test_horovod.py.
    def train(name: str, *overrides: str, expect: int = 0):
        return run_trainer(tmp_path / name, *overrides, launcher="spawned", expect=expect)

    whole = train("whole", *STEPS, "train.max_steps=70")
    first = train("parts", *STEPS, "train.max_steps=40", "checkpoint.every_steps=15")
    assert [c.step for c in first.checkpoints()] == [30, 31, 40]  # every 15, epoch, end
    # A newer spotring's checkpoint format is refused, naming both, before training.
    manifest = first.dir / "checkpoints" / manifest_name(40)
    written = manifest.read_text()
    manifest.write_text(json.dumps(json.loads(written) | {"format": FORMAT + 1}))
    newer = train("parts", *STEPS, "train.max_steps=70", expect=2)
    assert f"{manifest_name(40)} is in checkpoint format {FORMAT + 1}, written by a newer " \
           f"spotring; this spotring reads format {FORMAT} and older" in newer.output
    assert "Traceback" not in newer.output
    manifest.write_text(written)
    second = train("parts", *STEPS, "train.max_steps=70")
    assert "resumed at step 40 (epoch 2, sample 576 of its order)" in second.output
    # metrics.jsonl numbers that epoch as the log does (steps 32 to 62 are epoch 2).
    records = map(json.loads, (second.dir / "metrics.jsonl").read_text().splitlines())
    assert {r["epoch"] for r in records if r["kind"] == "train" and 40 < r["step"] <= 62} == {2}
    assert second.summary["steps"] == 70 and second.summary["steps_this_run"] == 30
    assert second.summary["resumed_from"] == str(first.dir / "checkpoints" / folder_name(40))
    assert_close(second.params(), whole.params(), rtol=0)  # bit for bit
    assert second.summary["test_loss"] == whole.summary["test_loss"]
    # And a run resumed at its very end finishes at once.
    again = train("parts", *STEPS, "train.max_steps=70")
    assert again.summary["steps"] == 70 and again.summary["steps_this_run"] == 0
