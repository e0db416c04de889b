"""Bad input fails before anything starts, naming the bad value and what is valid."""

from __future__ import annotations

import pytest

from harness.commands import call
from harness.launcher import needs_horovod
from spotring.exits import GRACE_VARIABLE, ConfigError
from spotring.trainer.__main__ import main as train
from spotring.trainer.validation import validate
from tests.conftest import QUICK, REPO, compose_config, run_trainer


def problems(*overrides: str) -> str:
    with pytest.raises(ConfigError) as e:
        validate(compose_config(*overrides))
    return str(e.value)


def test_the_default_config_is_valid_and_every_group_option_composes():
    validate(compose_config())
    for option in ["dataset=cifar10", "dataset=synthetic", "model=mnist_convnet", "model=lenet",
                   "model=cifar_convnet", "model=resnet20", "model=torchvision",
                   "optim=adamw", "schedule=goyal", "schedule=constant", "engine=ddp",
                   "engine=horovod", "+experiment=cifar10_resnet20"]:
        validate(compose_config(option))


@pytest.mark.parametrize("override, listed", [
    ("dataset=imagenet", ["cifar10", "mnist", "synthetic"]),
    ("model=vgg", ["convnet", "lenet", "resnet20", "torchvision"]),
    ("engine=deepspeed", ["ddp"]),
    ("optim=lamb", ["adamw", "sgd"]),
])
def test_unknown_group_option_lists_the_valid_ones(override, listed):
    with pytest.raises(ConfigError) as e:
        compose_config(override)
    text = str(e.value)
    assert text.endswith("`spotring train --cfg job`.")  # and says where to look
    assert override.split("=")[1] in text
    for name in listed:
        assert name in text
    options = text.split("Available options")[1]
    assert "schema" not in options  # the schemas are not offered as choices


@pytest.mark.parametrize("override, valid", [
    ("schedule.decay=linear", "cosine, step, none"),
    ("engine.backend=nccl2", "auto, nccl, gloo, mpi"),
    ("train.device=tpu", "auto, cpu, cuda"),
    ("train.dtype=float16", "float32, float64"),
    ("optim.name=adam", "sgd, adamw"),
    ("engine=horovod engine.compression=fp8", "none, fp16"),
    ("engine=horovod engine.op=sum", "average, adasum"),
])
def test_a_value_outside_a_fields_choices_is_refused_as_the_config_is_composed(override,
                                                                               valid):
    with pytest.raises(ConfigError) as e:
        compose_config(*override.split())
    bad = override.split()[-1]
    assert f"{bad}: Invalid value '{bad.split('=')[1]}', expected one of [{valid}]" in str(e.value)


def test_an_unknown_torchvision_model_is_caught_with_a_suggestion():
    text = problems("model=torchvision", "model.arch=resnet1800")
    assert "model.arch=resnet1800: unknown (did you mean resnet18" in text
    assert "resnet50" in text.split("valid:")[1]


@pytest.mark.parametrize("override", [
    "train.batch_size=0", "train.epochs=-0.5", "train.accumulation=0", "optim.lr=0.0",
    "optim.reference_batch=0", "train.max_steps=0", "train.eval_samples=0",
    "dataset=synthetic dataset.train_size=0",
])
def test_non_positive_sizes_are_refused(override):
    text = problems(*override.split())
    assert f"{override.split()[-1]}: must be positive" in text


def test_every_problem_is_listed_at_once():
    text = problems("train.batch_size=0", "optim.lr=-1", "schedule=goyal",
                    "schedule.milestones=[]")
    assert "train.batch_size=0" in text and "optim.lr=-1" in text
    assert "schedule.milestones=[]: decay=step needs at least one epoch" in text


def test_typo_in_a_key_is_refused_by_the_schema():
    with pytest.raises(ConfigError, match="batchsize"):
        compose_config("train.batchsize=64")


def test_an_option_the_chosen_engine_lacks_is_refused_naming_its_options_class():
    # The engine node is the engine's own options class (spotring.HorovodOptions).
    with pytest.raises(ConfigError, match="Key 'sync_bn' not in 'HorovodOptions'"):
        compose_config("engine=horovod", "engine.sync_bn=true")
    with pytest.raises(ConfigError, match="Key 'compression' not in 'DDPOptions'"):
        compose_config("engine.compression=fp16")


@pytest.mark.parametrize("override, says", [
    ("engine.timeout_s=0", "engine.timeout_s=0.0: must be positive"),
    ("engine.bucket_mb=0", "engine.bucket_mb=0.0: must be positive"),
    ("preemption.check_every_steps=0", "preemption.check_every_steps=0: must be positive"),
    ("checkpoint.keep=0", "checkpoint.keep=0: must be positive"),
    ("checkpoint.uri=bucket/prefix", "checkpoint.uri=bucket/prefix: expected s3://bucket/"),
    ("elastic.min_workers=0", "elastic.min_workers=0: must be positive"),
])
def test_spotrings_own_options_are_checked_by_spotrings_rules_under_the_trainers_keys(
        override, says):
    assert says in problems(override)


def test_in_place_without_a_global_batch_is_refused(monkeypatch):
    """In place, asked for here or by a launcher's environment, needs train.global_batch:
    a process that joins, alone until it is taken in, would make its global batch from
    train.batch_size x 1 worker."""
    monkeypatch.delenv("SPOTRING_IN_PLACE", raising=False)
    assert "elastic.in_place=auto with train.global_batch unset" in problems(
        "elastic.in_place=auto")
    monkeypatch.setenv("SPOTRING_IN_PLACE", "on")
    assert "elastic.in_place=on with train.global_batch unset" in problems()
    validate(compose_config("train.global_batch=128"))


# Open MPI's variables for rank 0 of a job of 1, as mpirun sets them: runtime.detect reads
# nothing else to tell the launcher (a real mpirun: test_missing_data_under_mpirun_...).
MPIRUN = {"OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "1",
          "OMPI_COMM_WORLD_LOCAL_RANK": "0", "OMPI_COMM_WORLD_LOCAL_SIZE": "1"}


@pytest.mark.parametrize("overrides, launch, expected", [
    (["train.batch_size=70000"], {},
     "global batch 70000 (train.batch_size=70000 x 1 workers"),
    (["engine.backend=mpi"], {},
     "engine.backend=mpi averages gradients over MPI on CPUs: start the job with mpirun"),
    # Horovod 0.28 itself segfaults in its first broadcast here.
    pytest.param(["engine=horovod", "engine.backend=gloo"], MPIRUN,
                 "engine=horovod engine.backend=gloo needs Horovod's Gloo controller: start "
                 "the job with horovodrun --gloo; under mpirun Horovod averages over MPI",
                 marks=needs_horovod),
    # A launcher's checkpoint URI whose s3:// was forgotten: refused as checkpoint.uri is.
    ([], {"SPOTRING_CHECKPOINT_URI": "mybucket/prefix"},
     "SPOTRING_CHECKPOINT_URI=mybucket/prefix: expected s3://bucket/prefix"),
])
def test_what_only_the_launch_can_tell_is_refused_before_training(tmp_path, monkeypatch,
                                                                  overrides, launch,
                                                                  expected):
    for name, value in launch.items():  # the launcher's variables; none: started alone
        monkeypatch.setenv(name, value)
    done = call(train, f"hydra.run.dir={tmp_path / 'run'}", *QUICK, *overrides)
    assert done.code == 2, done.err[-3000:]
    assert expected in done.err and "Traceback" not in done.err
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_a_bad_exit_grace_is_named_beside_the_bad_input(tmp_path, monkeypatch):
    monkeypatch.setenv(GRACE_VARIABLE, "soon")
    done = call(train, f"hydra.run.dir={tmp_path / 'run'}", "train.batch_size=0")
    assert done.code == 2
    assert done.err.startswith("spotring: error: bad configuration:\n"
                               "  - train.batch_size=0: must be positive\n"), done.err
    assert done.err.endswith(f"\n{GRACE_VARIABLE}=soon: not a number of seconds; valid: 0 or "
                             "more (3 where unset)\n"), done.err


# ------------------------------------------------------- under a real launcher, once each
# What only the real processes show: the exit code and every rank's line get through the
# launcher, which stops every rank once one exits (spotring.exits.report_bad_input). Each
# rank waits 1 s after its line rather than 3: on this 2-core machine at a load of 9, the
# two ranks' exits were up to 1.8 s apart, and no line was lost in 15 runs without a wait
# (the first rank's own shut-down and the launcher's reaction give the later one time).
GRACE = {GRACE_VARIABLE: "1"}


@pytest.mark.slow
def test_bad_input_under_torchrun_exits_2_before_any_process_group(tmp_path):
    # Every rank validates; rank 0 says what is wrong, rank 1 that it stopped.
    run = run_trainer(tmp_path / "run", "train.batch_size=0", launcher="torchrun", nproc=2,
                      expect=None, timeout=120, env=GRACE)
    assert "exitcode  : 2" in run.output  # torchrun's report of our exit code
    assert run.output.count("error:") == 1, run.output[-3000:]
    assert "train.batch_size=0: must be positive" in run.output
    assert "rank 1 (" in run.output and "stopped: bad configuration" in run.output
    assert f'File "{REPO / "trainer"}' not in run.output  # no traceback of ours
    assert not (tmp_path / "run" / "checkpoints").exists()
    assert not (tmp_path / "run" / "tensorboard").exists()


@pytest.mark.slow
def test_missing_data_under_mpirun_is_reported_by_each_rank_that_lacks_it(tmp_path):
    run = run_trainer(tmp_path / "run", "data.root=/nonexistent/data", "data.download=false",
                      launcher="mpirun", nproc=2, expect=2, timeout=120, env=GRACE)
    for rank in (0, 1):
        assert f"rank {rank} (" in run.output
    assert run.output.count("dataset mnist not found: looked in /nonexistent/data") == 2
    assert "data.root=PATH" in run.output
    assert f'File "{REPO / "trainer"}' not in run.output
    assert not (tmp_path / "run" / "checkpoints").exists()
