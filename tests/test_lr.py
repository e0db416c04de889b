"""spotring.lr: the linear scaling rule with gradual warmup as a torch scheduler, against
LRs computed by hand, and the same curve as the built-in trainer's."""

from __future__ import annotations

import io

import pytest
import torch

from spotring import scaled_lr, warmup_schedule
from spotring.exits import ConfigError
from spotring.trainer.schedule import lr_schedule
from tests.conftest import compose_config

# lr 0.1 at 256 samples a step, run at 1024: k = 4, the peak 0.4 after 10 steps of 50.
RULE = {"reference_batch": 256, "global_batch": 1024, "warmup_steps": 10, "total_steps": 50}


def sgd(*lrs: float) -> torch.optim.SGD:
    """SGD with one param group per LR."""
    return torch.optim.SGD([{"params": [torch.nn.Parameter(torch.zeros(1))], "lr": lr}
                            for lr in lrs])


def run(optimizer: torch.optim.Optimizer, scheduler, steps: int) -> list[list[float]]:
    """Each group's LR at each of ``steps`` optimizer steps, stepping the scheduler after."""
    lrs = []
    for _ in range(steps):
        lrs.append([group["lr"] for group in optimizer.param_groups])
        optimizer.step()
        scheduler.step()
    return lrs


def lrs(steps: int = 61, lr: float = 0.1, **settings) -> list[float]:
    """The LR of each step from warmup_schedule(**settings), for a base ``lr``."""
    optimizer = sgd(lr)
    return [lr for lr, in run(optimizer, warmup_schedule(optimizer, **settings), steps)]


def test_cosine_warms_up_then_decays_to_the_final_fraction():
    lr = lrs(**RULE, decay="cosine", final_lr_fraction=0.1)
    assert lr[0] == pytest.approx(0.1)  # the reference batch's LR
    assert lr[5] == pytest.approx(0.25)  # 0.1 + (0.4 - 0.1) * 5 / 10: the same step up each step
    assert lr[9] == pytest.approx(0.37)
    assert lr[10] == pytest.approx(0.4)  # k x 0.1
    assert lr[30] == pytest.approx(0.22)  # half way: 0.04 + (0.4 - 0.04) / 2
    assert lr[40] == pytest.approx(0.04 + 0.36 * (1 - 2**-0.5) / 2)  # cos(3 pi / 4) = -sqrt(1/2)
    assert lr[50] == lr[60] == pytest.approx(0.04)  # 0.1 x 0.4, and no lower past the end


def test_step_decay_multiplies_by_gamma_at_each_milestone():
    lr = lrs(**RULE, decay="step", milestones=(40, 20), gamma=0.5)
    assert lr[5] == pytest.approx(0.25)
    assert lr[10] == lr[19] == pytest.approx(0.4)
    assert lr[20] == lr[39] == pytest.approx(0.2)
    assert lr[40] == lr[60] == pytest.approx(0.1)


def test_no_decay_holds_the_peak():
    lr = lrs(**RULE, decay="none")
    assert lr[5] == pytest.approx(0.25)
    assert lr[10] == lr[49] == lr[60] == pytest.approx(0.4)


def test_a_batch_below_the_reference_scales_down_without_warmup():
    lr = lrs(reference_batch=256, global_batch=64, warmup_steps=10, total_steps=50, decay="none")
    assert lr[0] == lr[5] == lr[10] == lr[60] == pytest.approx(0.025)


def test_param_groups_keep_their_own_lr_and_ratio():
    optimizer = sgd(0.1, 0.01)
    grouped = run(optimizer, warmup_schedule(optimizer, **RULE), 61)
    assert [first for first, _ in grouped] == pytest.approx(lrs(**RULE))
    assert all(first == pytest.approx(10 * second) for first, second in grouped[:50])


def test_a_resumed_scheduler_continues_the_same_lrs():
    optimizer = sgd(0.1, 0.03)
    scheduler = warmup_schedule(optimizer, **RULE, decay="step", milestones=[20, 40])
    before = run(optimizer, scheduler, 25)
    saved = io.BytesIO()
    torch.save({"optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict()}, saved)

    saved.seek(0)
    state = torch.load(saved, weights_only=True)
    optimizer = sgd(0.1, 0.03)  # built as before: the reference batch's LRs
    scheduler = warmup_schedule(optimizer, **RULE, decay="step", milestones=[20, 40])
    optimizer.load_state_dict(state["optimizer"])
    scheduler.load_state_dict(state["scheduler"])

    optimizer_0 = sgd(0.1, 0.03)
    unbroken = run(optimizer_0, warmup_schedule(optimizer_0, **RULE, decay="step",
                                                milestones=[20, 40]), 50)
    assert before + run(optimizer, scheduler, 25) == unbroken


def test_scaled_lr_is_the_linear_scaling_rule():
    assert scaled_lr(0.1, 256, 8192) == pytest.approx(3.2)  # Goyal et al.'s k = 32
    assert scaled_lr(0.1, 256, 64) == pytest.approx(0.025)
    with pytest.raises(ConfigError, match=r"^global_batch=0: must be a positive number"):
        scaled_lr(0.1, 256, 0)


@pytest.mark.parametrize(("change", "message"), [
    ({"decay": "linear"}, "decay='linear': must be one of none, step, cosine"),
    ({"decay": "step"}, "milestones=(): decay='step' needs at least one step to decay at"),
    ({"reference_batch": -8}, "reference_batch=-8: must be a positive number of samples"),
    ({"global_batch": 0}, "global_batch=0: must be a positive number of samples"),
    ({"warmup_steps": 51}, "warmup_steps=51: must be between 0 and total_steps=50"),
    ({"warmup_steps": -1}, "warmup_steps=-1: must be between 0 and total_steps=50"),
    ({"total_steps": 0, "warmup_steps": 0}, "total_steps=0: must be positive"),
])
def test_bad_arguments_are_config_errors_naming_value_and_valid_ones(change, message):
    with pytest.raises(ConfigError) as raised:
        warmup_schedule(sgd(0.1), **(RULE | change))
    assert str(raised.value) == message


@pytest.mark.parametrize(("overrides", "settings"), [
    # 20 steps an epoch, 3 epochs: 10 warmup steps of 60, cosine down to 0.2 x peak.
    (["schedule=cosine", "schedule.final_lr_fraction=0.2"],
     {"warmup_steps": 10, "total_steps": 60, "decay": "cosine", "final_lr_fraction": 0.2}),
    # The paper's: 1 warmup epoch here, /10 at epochs 1.5 and 2.
    (["schedule=goyal", "schedule.warmup_epochs=1", "schedule.milestones=[2,1.5]"],
     {"warmup_steps": 20, "total_steps": 60, "decay": "step", "milestones": (30, 40)}),
])
def test_the_trainers_schedule_is_warmup_schedules(overrides, settings):
    trainer = lr_schedule(compose_config(*overrides, "optim.lr=0.05", "optim.reference_batch=128",
                                         "train.epochs=3"),
                          global_batch=512, steps_per_epoch=20)
    ours = lrs(70, lr=0.05, reference_batch=128, global_batch=512, **settings)
    assert ours == pytest.approx([trainer(t) for t in range(70)], rel=1e-12)
