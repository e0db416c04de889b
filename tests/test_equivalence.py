"""N workers with batch b take the steps one worker takes with batch N*b.

The world-size-invariant order gives both the same samples in every global batch;
DDP averages the gradients of the halves, which is the gradient of the whole up to
float rounding. The runs use train.dtype=float64: in float32 they agree to 5e-8 for
the first steps, then a rounding difference flips a near-tie in a max-pool or ReLU
and the runs drift apart chaotically (1e-3 after 25 steps, measured), which says
nothing about the trainer. In float64 they agree to 4e-16 after 25 steps (measured);
the tests take 20 steps (conftest.PARITY) and demand 1e-10 (the issue asks for 1e-5).
"""

from __future__ import annotations

import pytest

from tests.conftest import PARITY, assert_close


@pytest.mark.slow
@pytest.mark.parametrize("launcher, backend", [("torchrun", "gloo"), ("mpirun", "mpi")])
def test_two_workers_equal_one_worker_with_twice_the_batch(train, one_worker, ddp_2x32,
                                                           launcher, backend):
    two = ddp_2x32 if launcher == "torchrun" else train(  # torchrun's: shared with Horovod's
        launcher, *PARITY, "train.batch_size=32", f"engine.backend={backend}",
        launcher=launcher, nproc=2)
    assert two.summary["backend"] == backend
    assert two.summary["world_size"] == 2 and two.summary["global_batch"] == 64
    assert two.summary["steps"] == one_worker.summary["steps"] == 20
    assert_close(two.params(), one_worker.params(), rtol=1e-10)
    # and the optimisation really moved: not a trivially equal pair of initial weights
    assert two.summary["final_lr"] == one_worker.summary["final_lr"]
    assert two.summary["test_accuracy"] > 0.3  # chance is 0.1


@pytest.mark.slow
def test_gradient_accumulation_equals_the_larger_batch(train, one_worker):
    accumulated = train("acc", *PARITY, "train.batch_size=16", "train.accumulation=2",
                        launcher="spawned", nproc=2)
    assert accumulated.summary["global_batch"] == 64
    assert_close(accumulated.params(), one_worker.params(), rtol=1e-10)


@pytest.mark.slow
def test_fsdp_in_the_trainer_equals_one_worker_with_twice_the_batch(train, one_worker):
    # engine=fsdp's blocks "auto": each layer of the Sequential network, sharded on its own.
    sharded = train("fsdp", *PARITY, "train.batch_size=32", "engine=fsdp", launcher="spawned",
                    nproc=2)
    assert (sharded.summary["engine"], sharded.summary["world_size"]) == ("fsdp", 2)
    assert sharded.summary["steps"] == one_worker.summary["steps"] == 20
    assert_close(sharded.params(), one_worker.params(), rtol=1e-10)
