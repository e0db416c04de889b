"""spotring's API in one process (with real ranks: tests/test_resume.py):
what a user's script gets from init, track, save, restore, should_stop, log and finish."""

from __future__ import annotations

import ast
import inspect
import json
import logging
import pydoc
import re
import signal
import subprocess
import sys
import threading
from collections.abc import Callable

import pytest
import torch
from torch.utils.data import TensorDataset

import spotring
from harness.commands import call
from harness.faults import FaultProxy
from harness.launcher import needs_horovod
from spotring.checkpoint.layout import directory_of, folder_name, newest_valid
from spotring.exits import EXIT_CONFIG, EXIT_DIVERGED, EXIT_PREEMPTED, PREEMPTED, Diverged
from spotring.polling import poll
from tests.conftest import REPO

N, GLOBAL_BATCH = 40, 8
QUIET = spotring.PreemptionOptions(notices="none")  # no metadata service to look for


def dataset() -> TensorDataset:
    return TensorDataset(torch.randn(N, 3, generator=torch.Generator().manual_seed(0)),
                         torch.arange(N))


def job(tmp_path, **options) -> spotring.Job:
    return spotring.init(run_dir=tmp_path, preemption=QUIET, **options)


def steps(job: spotring.Job, model, optimizer, loader, count: int) -> list[int]:
    """``count`` optimizer steps (or to the epoch's end); the labels seen."""
    seen = []
    for x, y in loader:
        loss = model(x).pow(2).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        seen += y.tolist()
        job.should_stop()
        if len(seen) == count * GLOBAL_BATCH:
            break
    return seen


def trained(job: spotring.Job, count: int) -> Callable[[int], list[int]]:
    """A linear model, SGD and spotring's loader, tracked by ``job``, after ``count``
    steps; returns ``steps`` of them for more."""
    model = torch.nn.Linear(3, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    loader = job.loader(dataset(), GLOBAL_BATCH)
    model, optimizer = job.wrap(model, optimizer)
    job.track(model=model, optimizer=optimizer, loader=loader)
    steps(job, model, optimizer, loader, count)
    return lambda more: steps(job, model, optimizer, loader, more)


def test_a_restored_run_continues_mid_epoch_with_the_samples_and_weights_of_one_unbroken(
        tmp_path):
    def start(directory):
        j = job(directory)
        torch.manual_seed(0)
        model = torch.nn.Linear(3, 1)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        loader = j.loader(dataset(), GLOBAL_BATCH)
        model, optimizer = j.wrap(model, optimizer)
        counters = {"seen": 0}
        j.track(model=model, optimizer=optimizer, loader=loader, counters=counters)
        return j, model, optimizer, loader, counters

    j, model, optimizer, loader, counters = start(tmp_path / "whole")
    loader.set_epoch(1)
    whole = steps(j, model, optimizer, loader, 5)
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    j.close()

    j, model, optimizer, loader, counters = start(tmp_path / "cut")
    assert j.restore() is None  # nothing to restore: a fresh start
    loader.set_epoch(1)
    first = steps(j, model, optimizer, loader, 2)
    counters["seen"] = len(first)
    assert j.step_count == 5 + 2  # epoch 1 of 5 steps each, 2 done
    j.save()
    j.close()

    j, model, optimizer, loader, counters = start(tmp_path / "cut")
    assert j.restore() == 7 and counters == {"seen": 16} and loader.epoch == 1
    loader.set_epoch(1)  # the epoch it stands in: it keeps its place
    rest = steps(j, model, optimizer, loader, 3)
    j.close()
    assert first + rest == whole
    for name, value in model.state_dict().items():
        assert torch.equal(value, weights[name]), name


def test_a_stop_signal_is_agreed_a_step_later_and_save_and_exit_leaves_75_and_its_note(
        tmp_path):
    before = signal.getsignal(signal.SIGTERM)
    j = job(tmp_path)
    model, optimizer = j.wrap(torch.nn.Linear(3, 1), torch.optim.SGD([torch.zeros(1)], lr=1))
    loader = j.loader(dataset(), GLOBAL_BATCH)
    j.track(model=model, loader=loader)
    assert j.should_stop() is False
    signal.raise_signal(signal.SIGTERM)  # caught: a flag, the step goes on
    # The vote sent with a step's call is answered by the next one (it overlaps a step).
    assert j.should_stop() is False
    assert j.should_stop() is True
    with pytest.raises(SystemExit) as exit:
        j.save_and_exit()
    assert exit.value.code == EXIT_PREEMPTED
    note = json.loads((tmp_path / PREEMPTED).read_text())
    assert note["reason"] == "SIGTERM" and note["step"] == 0
    assert note["noticed_at"] <= note["local_saved_at"] <= note["saved_at"]
    assert (tmp_path / "checkpoints" / "ckpt-000000000.json").is_file()
    assert signal.getsignal(signal.SIGTERM) is before  # handed back on the way out


def test_log_and_finish_write_what_sweeps_and_reports_read(tmp_path):
    j = job(tmp_path)
    loader = j.loader(dataset(), GLOBAL_BATCH)
    j.track(loader=loader)
    loader.set_epoch(0)
    for _ in loader:
        pass
    j.log("test", accuracy=0.5, loss=torch.tensor(1.25))
    summary = j.finish(test_accuracy=0.5)
    assert json.loads((tmp_path / "summary.json").read_text()) == summary
    assert summary["test_accuracy"] == 0.5 and summary["steps"] == N // GLOBAL_BATCH
    assert summary["global_batch"] == GLOBAL_BATCH and summary["world_size"] == 1
    record = json.loads((tmp_path / "metrics.jsonl").read_text())
    assert {k: record[k] for k in ("kind", "step", "epoch", "accuracy", "loss")} == {
        "kind": "test", "step": 5, "epoch": 1, "accuracy": 0.5, "loss": 1.25}
    assert list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))


def test_a_non_finite_loss_or_weights_is_a_divergence(tmp_path):
    j = job(tmp_path)
    model = torch.nn.Linear(3, 1)
    j.track(model=model)
    j.check_finite(torch.tensor(1.0))
    with pytest.raises(Diverged, match="the train loss is nan at step 0"):
        j.check_finite(float("nan"))
    # A float16 layer of ones larger than float16's range is finite.
    norm = torch.nn.LayerNorm(70_000, dtype=torch.float16)
    j.track(norm=norm)
    j.save(background=False)
    for bad in ([float("nan")], [float("inf")], [float("inf"), float("-inf")]):
        with torch.no_grad():
            model.weight.zero_()
            model.weight.view(-1)[:len(bad)] = torch.tensor(bad)
        with pytest.raises(Diverged, match="the weights are not finite"):
            j.save()
    from spotring.checkpoint.layout import folder_name, manifest_name

    # Only the finite step 0's.
    assert {p.name for p in (tmp_path / "checkpoints").iterdir()} == {folder_name(0),
                                                                       manifest_name(0)}
    j.close()


def script(argv: list[str]) -> None:
    """A user's script, RUN_DIR GLOBAL_BATCH END: a job over 10 samples, whose loss is
    NaN where END is "nan"."""
    run_dir, global_batch, end = argv
    with spotring.init(run_dir=run_dir, preemption=QUIET) as j:
        j.loader(TensorDataset(torch.zeros(10, 1)), int(global_batch))
        if end == "nan":
            j.check_finite(float("nan"))


@pytest.mark.parametrize("args, code, says", [
    (["5", "-"], 0, ""),
    (["20", "-"], EXIT_CONFIG, "batch of 20 samples is larger than the dataset (10 samples)"),
    (["5", "nan"], EXIT_DIVERGED, "training diverged"),
])
def test_with_turns_what_went_wrong_into_the_exit_code_a_launcher_acts_on(
        tmp_path, args, code, says):
    done = call(script, str(tmp_path), *args)  # as its process would end (harness/commands.py)
    assert done.code == code, done.err
    assert says in done.err
    assert (tmp_path / "diverged.json").exists() == (code == EXIT_DIVERGED)


def test_a_background_saves_line_comes_from_the_training_thread_at_the_next_step(
        tmp_path, caplog):
    """Not from the save's own thread: there its line on stderr could fall between the
    text and the newline of a line the script prints, which unbuffered streams (as
    launchers make them) write apart."""
    with caplog.at_level(logging.INFO, logger="spotring"), job(tmp_path) as j:
        go_on = trained(j, 2)
        j.save(background=True)
        poll(lambda: not any(t.name.startswith("spotring-checkpoint")
                             for t in threading.enumerate()) or None,
             timeout_s=60, interval_s=0.01, what="the background save's end")
        def said() -> list[logging.LogRecord]:
            return [r for r in caplog.records if r.getMessage().startswith("checkpoint ")]

        assert said() == []  # published, and not said yet
        go_on(1)
        assert [(r.threadName, folder_name(2) in r.getMessage()) for r in said()] == [
            ("MainThread", True)], [r.getMessage() for r in said()]


def test_any_way_out_of_with_lets_the_background_save_in_flight_finish(
        tmp_path, s3, monkeypatch, caplog):
    """sys.exit inside ``with`` while a background save uploads: the process waits for it
    (saying so) rather than end under it. S3 sits behind harness/faults.py's proxy, held
    until the wait is logged, so the save is in flight when sys.exit comes."""
    proxy = FaultProxy(s3["AWS_ENDPOINT_URL"])
    monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.endpoint)
    uri = "s3://spotring/way-out"

    def release_once_waited_for() -> None:
        poll(lambda: any("before exiting" in r.getMessage() for r in caplog.records) or None,
             timeout_s=60, interval_s=0.01, what="the wait for the save in flight")
        proxy.release()

    try:
        with caplog.at_level(logging.INFO, logger="spotring"), pytest.raises(SystemExit) as e, \
                job(tmp_path, checkpoint_uri=uri) as j:
            trained(j, 2)
            proxy.hold()
            j.save(background=True)
            threading.Thread(target=release_once_waited_for, daemon=True).start()
            sys.exit(3)
    finally:
        proxy.stop()
        monkeypatch.setenv("AWS_ENDPOINT_URL", s3["AWS_ENDPOINT_URL"])
    assert e.value.code == 3
    assert "waiting for the checkpoint of step 2, written in the background, before " \
           "exiting" in caplog.text and "checkpoint of step 2 complete" in caplog.text
    assert newest_valid(tmp_path / "elsewhere", uri).step == 2  # on S3, whole


def test_rank_0_notes_where_its_checkpoints_are_for_whoever_finds_the_run(tmp_path):
    """A launcher fetching a run, or a sweep resuming one, knows it by its run directory:
    rank 0 notes there where checkpoint.dir put the checkpoints."""
    elsewhere = tmp_path / "disk" / "ckpt"
    j = job(tmp_path / "run", checkpoint_dir=elsewhere)
    model = torch.nn.Linear(3, 1)
    j.track(model=model)
    j.save(background=False)
    j.close()
    assert directory_of(tmp_path / "run") == elsewhere
    assert newest_valid(directory_of(tmp_path / "run")).step == 0
    assert directory_of(tmp_path / "never-ran") == tmp_path / "never-ran" / "checkpoints"


def test_epochs_continue_mid_epoch_and_skip_one_restored_at_its_end():
    loader = spotring.DataLoader(dataset(), GLOBAL_BATCH, rank=0, world_size=1)
    loader.load_state_dict({"epoch": 1, "offset": 16, "seed": 0, "global_batch": 8})
    assert [(epoch, len(loader)) for epoch in loader.epochs(3)] == [(1, 3), (2, 5)]
    loader.load_state_dict({"epoch": 1, "offset": 40, "seed": 0, "global_batch": 8})
    assert list(loader.epochs(2)) == []  # the last epoch was done: a rerun trains nothing


# ----------------------------------------------------------------------------- options


def refused(capsys, **options) -> str:
    """What init says of ``options`` it refuses, having exited 2."""
    with pytest.raises(SystemExit) as exit:
        spotring.init(**options)
    assert exit.value.code == EXIT_CONFIG
    return capsys.readouterr().err


def test_in_place_fsdp_without_replicas_exits_2_naming_hsdp(tmp_path, monkeypatch, capsys):
    """Rank 0 of 2 (torchrun's variables): refused before any process group exists."""
    monkeypatch.chdir(tmp_path)
    for key, value in {"SPOTRING_RENDEZVOUS": "127.0.0.1:1", "RANK": "0", "WORLD_SIZE": "2",
                       "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
                       "MASTER_PORT": "1"}.items():
        monkeypatch.setenv(key, value)
    says = refused(capsys, engine=spotring.FSDPOptions(shard_size=2), in_place="on")
    assert ("elastic.in_place=on: engine=fsdp engine.shard_size=2 with 2 workers: a lost "
            "worker's shards would go with it; in place, FSDP needs replicas of them (HSDP: "
            "engine.shard_size=n with at least 2 groups of n workers)") in says, says
    assert list(tmp_path.iterdir()) == []


def test_engine_options_come_as_an_object_or_as_keywords_over_it(tmp_path):
    j = job(tmp_path, engine=spotring.DDPOptions(bucket_mb=50, sync_bn=True), timeout_s=20)
    assert j.options == spotring.DDPOptions(bucket_mb=50, sync_bn=True, timeout_s=20)
    j.close()
    j = job(tmp_path, bucket_mb=10, backend="gloo")
    assert (j.options.bucket_mb, j.options.backend, j.engine.backend) == (10, "gloo", "gloo")
    j.close()


@pytest.mark.parametrize("options, says", [
    ({"engine": "deepspeed"}, "engine=deepspeed: unknown; valid: ddp, fsdp, horovod"),
    ({"engine": "horovod", "bucket_mb": 50},
     "bucket_mb: not an option of engine=horovod (HorovodOptions: backend, timeout_s, "
     "compression, op, timeline)"),
    ({"engine": "ddp", "compression": "fp16"},
     "compression: not an option of engine=ddp (DDPOptions: backend, timeout_s, bucket_mb, "
     "sync_bn)"),
    ({"backend": "nccl2"}, "backend=nccl2: unknown (did you mean nccl?); valid: auto, nccl, "
                           "gloo, mpi"),
    ({"engine": "horovod", "compression": "fp8"}, "compression=fp8: unknown"),
    ({"timeout_s": 0}, "timeout_s=0: must be positive"),
    ({"device": "tpu"}, "device=tpu: unknown (did you mean cpu?); valid: auto, cpu, cuda"),
    ({"keep": 0, "check_every_steps": 0},
     "checkpoint.keep=0: must be positive; preemption.check_every_steps=0: must be positive"),
    ({"checkpoint_uri": "bucket/prefix"},
     "checkpoint.uri=bucket/prefix: expected s3://bucket/prefix, gs://bucket/prefix, "
     "az://container/prefix or file:///path"),
    ({"checkpoint": spotring.CheckpointOptions(keep=5), "poll_seconds": 1},
     None),  # a TypeError: init has no such keyword (PreemptionOptions has)
    ({"in_place": "auto", "min_workers": 2},
     "elastic.min_workers=2 with 1 workers: the job would stop at its first loss; valid "
     "here: 1 to 1"),
    pytest.param({"in_place": "on", "engine": "horovod"},
                 "elastic.in_place=on: engine=horovod cannot form its process group anew as "
                 "workers leave and join", marks=needs_horovod),
    ({"in_place": "sometimes"}, "elastic.in_place=sometimes: unknown; valid: off, auto, on"),
    ({"elastic": spotring.ElasticOptions(in_place="auto", rendezvous="nowhere")},
     "elastic.rendezvous=nowhere: expected host:port"),
])
def test_an_option_the_engine_or_its_class_lacks_exits_2_naming_what_is_valid(
        tmp_path, monkeypatch, capsys, options, says):
    monkeypatch.chdir(tmp_path)  # where the run directory would be: runs/<script>
    monkeypatch.setenv("SPOTRING_RENDEZVOUS", "127.0.0.1:1")  # in place: refused unasked
    if says is None:
        with pytest.raises(TypeError, match="poll_seconds"):
            spotring.init(**options)
        return
    assert says in refused(capsys, **options)
    assert list(tmp_path.iterdir()) == []  # no run directory, no checkpoints


def test_a_launchers_checkpoint_uri_without_a_scheme_exits_2_naming_the_variable(
        tmp_path, monkeypatch, capsys):
    """The s3:// forgotten in a launcher's environment (a SkyPilot envs: block) would send
    every checkpoint to ./mybucket/prefix, which goes with the machine: refused as the
    option is, naming the variable, before anything exists."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("SPOTRING_CHECKPOINT_URI", "mybucket/prefix")
    assert ("SPOTRING_CHECKPOINT_URI=mybucket/prefix: expected s3://bucket/prefix, "
            "gs://bucket/prefix, az://container/prefix or file:///path") in refused(capsys)
    assert list(tmp_path.iterdir()) == []


def test_checkpoint_and_preemption_options_as_objects(tmp_path, monkeypatch):
    monkeypatch.setenv("SPOTRING_CHECKPOINT_URI", "")  # no launcher's default here
    j = spotring.init(run_dir=tmp_path, keep=1,
                      checkpoint=spotring.CheckpointOptions(dir=str(tmp_path / "ckpt"), keep=5),
                      preemption=spotring.PreemptionOptions(notices="none",
                                                            check_every_steps=2))
    assert (j.checkpoints.where, j.checkpoints.keep) == (str(tmp_path / "ckpt"), 1)
    model, optimizer = j.wrap(torch.nn.Linear(3, 1), torch.optim.SGD([torch.zeros(1)], lr=1))
    j.track(model=model)
    # Votes every 2nd call: a signal is seen at the 3rd (the 2nd sends, the 3rd answers).
    signal.raise_signal(signal.SIGTERM)
    assert [j.should_stop() for _ in range(3)] == [False, False, True]
    j.close()


def test_a_new_engine_is_one_registered_module(tmp_path, monkeypatch):
    """What a module of spotring/engines/ does (register) makes the engine valid in init,
    in its messages (sorted by name, whatever registered first) and in the trainer's
    schema, with its own options."""
    from dataclasses import dataclass

    from hydra.core.config_store import ConfigStore

    from spotring import engines
    from spotring.engines.ddp import SingleProcess
    from spotring.trainer import config, validation

    @dataclass
    class AloneOptions(spotring.EngineOptions):
        name: str = "alone"
        ratio: float = 1.0

    class Alone(SingleProcess):
        name = "alone"

    monkeypatch.setattr(engines, "_registered", dict(engines.registry()))
    engines.register("alone", AloneOptions, create=Alone)
    j = job(tmp_path, engine=AloneOptions(ratio=2.0))
    assert j.engine.name == "alone" and j.finish()["engine"] == "alone"
    with pytest.raises(spotring.ConfigError, match="engine=alnoe: unknown .did you mean alone.*; "
                                          "valid: alone, ddp, fsdp, horovod"):
        engines.options_for("alnoe")
    config.register()
    assert ConfigStore.instance().load("schema/engine/alone.yaml").node.ratio == 1.0
    cfg = config.compose(["~engine", "+schema/engine@engine=alone", "engine.ratio=3"])
    validation.validate(cfg)
    assert cfg.engine.ratio == 3


# ------------------------------------------------------------------------ the surface


def public_names() -> set[str]:
    """The names spotring/__init__.py names for type checkers (if TYPE_CHECKING)."""
    tree = ast.parse((REPO / "spotring/__init__.py").read_text())
    guarded = next(n for n in tree.body if isinstance(n, ast.If)
                   and ast.unparse(n.test).endswith("TYPE_CHECKING"))
    return {alias.asname or alias.name for node in guarded.body for alias in node.names}


def test_all_the_lazy_exports_and_the_type_checking_imports_agree():
    assert set(spotring.__all__) == public_names()
    assert len(spotring.__all__) == len(set(spotring.__all__))
    for name in spotring.__all__:
        assert getattr(spotring, name) is not None, name
    with pytest.raises(AttributeError, match="has no attribute 'Any'"):
        spotring.Any  # noqa: B018


def test_dir_and_help_offer_the_api_and_no_helper():
    assert dir(spotring) == sorted(spotring.__all__)
    text = pydoc.render_doc(spotring, renderer=pydoc.plaintext)
    for name in ("init", "DDPOptions", "CheckpointOptions", "warmup_schedule"):
        assert name in text


def test_docs_api_names_every_public_name():
    doc = (REPO / "docs/api.md").read_text()
    assert [name for name in spotring.__all__
            if not re.search(rf"`[^`]*\b{name}\b[^`]*`", doc)] == []


def test_every_public_call_documents_each_of_its_parameters():
    """Each parameter of a public function or method is named in its docstring (for a
    constructor, the class's and, for an options class, those of the classes it extends).
    Exceptions are left out: a user catches them and reads their message."""
    missing = []
    for name in spotring.__all__:
        obj = getattr(spotring, name)
        calls = [(name, obj)] if inspect.isfunction(obj) else []
        if inspect.isclass(obj) and not issubclass(obj, BaseException):
            calls += [(f"{name}.{m}", f) for m, f in vars(obj).items()
                      if inspect.isfunction(f) and (not m.startswith("_") or m == "__init__")]
        for where, function in calls:
            doc = inspect.getdoc(function) or ""
            if where.endswith(".__init__"):
                doc += "".join(inspect.getdoc(c) or "" for c in obj.__mro__)
            params = [p for p in inspect.signature(function).parameters
                      if p not in ("self", "cls")]
            missing += [f"{where}({p})" for p in params
                        if not re.search(rf"\b{p}\b", doc)]
    assert missing == []


def test_import_spotring_and_its_help_load_no_torch():
    code = ("import sys, spotring, spotring.cli; dir(spotring); spotring.cli.main(['--help']);"
            "print(sorted(m for m in sys.modules if m.split('.')[0] == 'torch'))")
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().splitlines()[-1] == "[]"
