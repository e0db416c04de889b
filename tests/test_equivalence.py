"""N workers with batch b take the steps one worker takes with batch N*b.

The world-size-invariant order gives both the same samples in every global batch;
DDP averages the gradients of the halves, which is the gradient of the whole up to
float rounding. The runs use train.dtype=float64: in float32 they agree to 5e-8 for
the first steps, then a rounding difference flips a near-tie in a max-pool or ReLU
and the runs drift apart chaotically (1e-3 after 25 steps, measured), which says
nothing about the trainer. In float64 they agree to 4e-16 after 25 steps; the tests
demand 1e-10 (the issue asks for 1e-5).
"""

from __future__ import annotations

import pytest

from tests.conftest import assert_close

# Real MNIST, 25 steps of global batch 64, SGD + Nesterov momentum.
STEPS = ["train.max_steps=25", "train.threads=1", "optim=sgd", "train.seed=3",
         "train.dtype=float64", "train.eval_samples=1000"]


@pytest.fixture(scope="module")
def one_worker(tmp_path_factory):
    from tests.conftest import run_trainer

    return run_trainer(tmp_path_factory.mktemp("one") / "run", *STEPS, "train.batch_size=64")


@pytest.mark.slow
@pytest.mark.parametrize("launcher, backend", [("torchrun", "gloo"), ("mpirun", "gloo"),
                                               ("mpirun", "mpi")])
def test_two_workers_equal_one_worker_with_twice_the_batch(train, one_worker, launcher,
                                                           backend):
    two = train(launcher, *STEPS, "train.batch_size=32", f"engine.backend={backend}",
                launcher=launcher, nproc=2)
    assert two.summary["backend"] == backend
    assert two.summary["world_size"] == 2 and two.summary["global_batch"] == 64
    assert two.summary["steps"] == one_worker.summary["steps"] == 25
    assert_close(two.params(), one_worker.params(), rtol=1e-10)
    # and the optimisation really moved: not a trivially equal pair of initial weights
    assert two.summary["final_lr"] == one_worker.summary["final_lr"]
    assert two.summary["test_accuracy"] > 0.5


@pytest.mark.slow
def test_gradient_accumulation_equals_the_larger_batch(train, one_worker):
    accumulated = train("acc", *STEPS, "train.batch_size=16", "train.accumulation=2",
                        launcher="torchrun", nproc=2)
    assert accumulated.summary["global_batch"] == 64
    assert_close(accumulated.params(), one_worker.params(), rtol=1e-10)
