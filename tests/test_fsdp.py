"""engine=fsdp (spotring/engines/fsdp.py): FSDP2 on N workers takes the steps DDP takes on
N and one process alone takes with the whole batch, and bad input is named before
anything runs.

The runs are harness/fsdp_train.py, a user's script: a float64 network of two blocks, AdamW
with weight decay and an LR schedule built before wrap, a tracked spotring.DataLoader, 5
steps, every rank starting from weights of its own. In float64 the engines agree to
rounding (measured: 2e-16); the tests demand 1e-10 of the largest difference of any
weight.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.distributed.tensor import DTensor

import spotring
from harness.cores import cores
from harness.fsdp_train import STEPS, Block, Net
from spotring import engines
from spotring.engines.fsdp import blocks_of
from spotring.exits import ConfigError
from spotring.launch.commands import local_command, local_environment
from spotring.runtime import Launch
from spotring.trainer.data import evaluation_batches
from spotring.trainer.validation import validate
from tests.conftest import REPO, compose_config

TOLERANCE = 1e-10  # the largest |difference| of any weight, float64


def train(out: Path, *args: str, nproc: int = 1) -> dict:
    """harness/fsdp_train.py with ``args`` on ``nproc`` ranks (torchrun; alone for 1): what
    rank 0 saved."""
    command = local_command("torchrun" if nproc > 1 else "single", nproc, [str(out), *args],
                            module="harness.fsdp_train")
    with cores(nproc):
        proc = subprocess.run(command, cwd=REPO, env=local_environment(), capture_output=True,
                              text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return torch.load(out, weights_only=True)


def largest_difference(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max((a[k] - b[k]).abs().max().item() for k in a)


@pytest.fixture(scope="module")
def alone(tmp_path_factory) -> dict:
    """One process, engine=ddp (the plain model), the whole global batch of 16 at once."""
    return train(tmp_path_factory.mktemp("alone") / "alone.pt")


@pytest.mark.parametrize("engine, nproc, args", [
    pytest.param("ddp", 2, [], marks=pytest.mark.slow),
    # 4 per micro-step: 2 micro-steps, the first without gradient sync.
    pytest.param("fsdp", 2, ["--batch-size", "4"], marks=pytest.mark.slow),
    # HSDP with groups of one: every rank holds the whole model, gradients all-reduced
    # (what torch 2.7 fails on CPUs: the oldest end runs it too).
    pytest.param("fsdp", 2, ["--shard-size", "1"], marks=[pytest.mark.slow, pytest.mark.ends]),
    # A group of one: sharded alone too, in one process, which keeps one core busy.
    pytest.param("fsdp", 1, [], marks=pytest.mark.slow(cores=1)),
], ids=["ddp-2", "fsdp-2-accumulating", "hsdp-2x1", "fsdp-alone"])
def test_fsdp_takes_the_steps_of_ddp_and_of_one_process(tmp_path, alone, engine, nproc, args):
    run = train(tmp_path / "run.pt", "--engine", engine, *args, nproc=nproc)
    assert (run["engine"], run["world_size"], run["steps"]) == (engine, nproc, STEPS)
    difference = largest_difference(run["weights"], alone["weights"])
    print(f"\n{engine} on {nproc} {args}: largest difference from one process {difference:.1e}")
    assert difference <= TOLERANCE
    assert run["lr"] == alone["lr"]  # the schedule built before wrap followed the steps
    # and the optimisation really moved: not a trivially equal pair of initial weights
    torch.manual_seed(0)
    initial = {k: v.detach().double() for k, v in Net().named_parameters()}
    assert largest_difference(run["weights"], initial) > 0.1
    assert run["optimizer_steps_the_model"]
    # Sharded in place, the module is itself (a DDP wrapper has it inside).
    assert run["unwrap_is_itself"] == (engine == "fsdp" or nproc == 1)
    if engine == "fsdp" and "--shard-size" not in args:
        # Sharded: each rank holds part of every parameter, together the whole.
        assert sum(run["local_numel"]) == run["numel"]
        assert nproc == 1 or max(run["local_numel"]) < run["numel"]
    elif engine == "fsdp":
        assert run["local_numel"] == [run["numel"]] * nproc  # replicated
    assert run["accumulation"] == (2 if "--batch-size" in args else 1)


# ------------------------------------------------------------- bad input, no processes


def test_fp16_with_fsdp_is_refused_naming_bf16():
    (problem,) = spotring.FSDPOptions().problems(precision="fp16")
    assert problem.startswith("precision=fp16 with engine=fsdp") and "use bf16" in problem
    assert spotring.FSDPOptions().problems(precision="bf16") == []
    with pytest.raises(ConfigError, match="precision=fp16 with engine=fsdp"):
        validate(compose_config("engine=fsdp", "train.precision=fp16"))


def test_a_shard_size_that_does_not_divide_the_world_size_is_refused_naming_those_that_do():
    four = Launch("torchrun", 0, 4, 0, 4)
    with pytest.raises(ConfigError) as refused:
        engines.check(spotring.FSDPOptions(shard_size=3), four, torch.device("cpu"))
    assert "engine.shard_size=3 with 4 workers" in str(refused.value)
    assert "valid with 4 workers: 0, 1, 2, 4" in str(refused.value)
    for size in (0, 1, 2, 4):
        engines.check(spotring.FSDPOptions(shard_size=size), four, torch.device("cpu"))
    assert spotring.FSDPOptions(shard_size=-1).problems("engine.") == [
        "engine.shard_size=-1: must be 0 (shard across all workers) or the size n >= 1 of "
        "the groups that shard (HSDP)"]


def test_a_block_class_the_model_lacks_is_refused_naming_it_and_those_it_has():
    with pytest.raises(ConfigError) as refused:
        blocks_of(Net(), ["Blok"])
    assert str(refused.value) == (
        "engine.blocks=Blok: unknown (did you mean Block?); valid: Block, LayerNorm, Linear "
        "(the classes of Net's layers that hold parameters)")
    with pytest.raises(ConfigError, match="engine.blocks=Conv2d: unknown"):
        blocks_of(Net(), [nn.Conv2d])
    assert spotring.FSDPOptions(blocks="Block").problems() == [
        "blocks='Block': expected \"auto\", a list of class names such as [Block] (or of "
        "nn.Module classes), or a function module -> bool"]


def test_the_trainer_refuses_what_fsdp_cannot_do_and_evaluates_in_as_many_batches_per_rank():
    with pytest.raises(ConfigError, match="model.l1=0.001 with engine=fsdp"):
        validate(compose_config("engine=fsdp", "model.l1=0.001"))
    validate(compose_config("engine=fsdp", "engine.blocks=[Block]", "engine.shard_size=2"))
    # Each evaluation forward gathers parameters from every rank: 2001 samples on 2 ranks
    # are 2 batches each, not 1001 (2 batches of 1000) and 1000 (1).
    shards = [evaluation_batches(2001, None, 1000, rank, 2) for rank in (0, 1)]
    assert [[len(b) for b in shard] for shard in shards] == [[501, 500], [500, 500]]
    assert torch.cat([*shards[0], *shards[1]]).tolist() == list(range(2001))


def test_the_blocks_are_the_layers_in_containers_or_those_named():
    def names(model: nn.Module, blocks) -> list[str]:
        found = {id(m): n for n, m in model.named_modules()}
        return [found[id(m)] for m in blocks_of(model, blocks)]

    net = Net()
    assert names(net, "auto") == ["blocks.1", "blocks.0"]
    assert names(net, ["Block"]) == names(net, [Block]) == ["blocks.1", "blocks.0"]
    # Nested: children before their parents, the order fully_shard takes them in.
    assert names(net, lambda m: isinstance(m, (Block, nn.LayerNorm))) == [
        "blocks.1.norm", "blocks.1", "blocks.0.norm", "blocks.0"]
    # A Sequential's layers, looked into where a layer is itself a container; layers
    # without parameters are not blocks.
    stack = nn.Sequential(nn.Linear(2, 4), nn.ReLU(), nn.Sequential(nn.Linear(4, 4),
                                                                    nn.Linear(4, 1)))
    assert names(stack, "auto") == ["2.1", "2.0", "0"]
    # A ResNet's blocks, each with its downsampling inside it.
    from torchvision.models import resnet18

    assert names(resnet18(), "auto") == [f"layer{s}.{b}" for s in (4, 3, 2, 1) for b in (1, 0)]


def test_alone_the_model_is_sharded_and_the_optimizer_follows_it_or_is_built(tmp_path):
    job = spotring.init(engine="fsdp", run_dir=tmp_path, notices="none")
    try:
        torch.manual_seed(0)
        model = Net().double()
        tensors = len(list(model.parameters()))
        stepped = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        model(torch.ones(2, 4, dtype=torch.float64)).sum().backward()
        stepped.step()
        with pytest.raises(ConfigError, match="the optimizer holds state already"):
            job.wrap(model, stepped)
        with pytest.raises(ConfigError, match="steps 1 tensors that are not the model's"):
            job.wrap(model, torch.optim.SGD([*model.parameters(), nn.Parameter(torch.ones(3))],
                                            lr=0.1))
        sharded, optimizer = job.wrap(model, lambda params: torch.optim.AdamW(params, lr=0.1))
        assert sharded is model and job.unwrap(model) is model
        params = list(model.parameters())
        assert len(params) == tensors and all(isinstance(p, DTensor) for p in params)
        assert [id(p) for p in optimizer.param_groups[0]["params"]] == [id(p) for p in params]
    finally:
        job.close()


def test_bf16_computes_with_bfloat16_weights_and_keeps_shards_and_optimizer_in_float32(
        tmp_path):
    job = spotring.init(engine="fsdp", run_dir=tmp_path, notices="none")
    try:
        model = Net()  # float32
        seen = []
        model.blocks[0].linear.register_forward_pre_hook(
            lambda module, _: seen.append(module.weight.dtype))
        model, optimizer = job.wrap(model, torch.optim.AdamW(model.parameters()),
                                    precision="bf16")
        with job.autocast():
            loss = model(torch.ones(2, 4)).float().pow(2).mean()
        job.backward(loss)
        job.step(optimizer)
        assert seen == [torch.bfloat16]  # gathered in bfloat16 for the forward pass
        assert {p.dtype for p in model.parameters()} == {torch.float32}
        assert {v.dtype for s in optimizer.state.values() for k, v in s.items()
                if k != "step"} == {torch.float32}
    finally:
        job.close()
