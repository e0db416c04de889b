"""Bad input fails before anything starts, naming the bad value and what is valid."""

from __future__ import annotations

import pytest

from spotring.exits import ConfigError
from spotring.trainer.validation import validate
from tests.conftest import REPO, compose_config, run_trainer


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
])
def test_spotrings_own_options_are_checked_by_spotrings_rules_under_the_trainers_keys(
        override, says):
    assert says in problems(override)


def test_bad_input_exits_2_before_any_process_group(tmp_path):
    # Two workers under torchrun: every rank validates; rank 0 says what is wrong.
    run = run_trainer(tmp_path / "run", "train.batch_size=0", launcher="torchrun", nproc=2,
                      expect=None, timeout=120)
    assert "exitcode  : 2" in run.output  # torchrun's report of our exit code
    assert run.output.count("error:") == 1, run.output[-3000:]
    assert "train.batch_size=0: must be positive" in run.output
    assert "rank 1 (" in run.output and "stopped: bad configuration" in run.output
    assert f'File "{REPO / "trainer"}' not in run.output  # no traceback of ours
    assert not (tmp_path / "run" / "checkpoints").exists()
    assert not (tmp_path / "run" / "tensorboard").exists()


@pytest.mark.parametrize("overrides, launcher, expected", [
    (["train.batch_size=70000"], "single",
     "global batch 70000 (train.batch_size=70000 x 1 workers"),
    (["engine.backend=mpi"], "single",
     "engine.backend=mpi averages gradients over MPI on CPUs: start the job with mpirun"),
    # Horovod 0.28 itself segfaults in its first broadcast here.
    (["engine=horovod", "engine.backend=gloo"], "mpirun",
     "engine=horovod engine.backend=gloo needs Horovod's Gloo controller: start the job "
     "with horovodrun --gloo; under mpirun Horovod averages over MPI"),
])
def test_what_only_the_launch_can_tell_is_refused_before_training(tmp_path, overrides,
                                                                  launcher, expected):
    nproc = 1 if launcher == "single" else 2
    run = run_trainer(tmp_path / "run", *overrides, launcher=launcher, nproc=nproc, expect=2,
                      timeout=120)
    assert expected in run.output and "Traceback" not in run.output
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_missing_data_offline_is_reported_by_each_rank_that_lacks_it(tmp_path):
    run = run_trainer(tmp_path / "run", "data.root=/nonexistent/data", "data.download=false",
                      launcher="mpirun", nproc=2, expect=None, timeout=120)
    assert run.proc.returncode != 0
    for rank in (0, 1):
        assert f"rank {rank} (" in run.output
    assert run.output.count("dataset mnist not found: looked in /nonexistent/data") == 2
    assert "data.root=PATH" in run.output
    assert f'File "{REPO / "trainer"}' not in run.output
