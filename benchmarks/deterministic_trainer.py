"""python -m spotring.benchmarks.deterministic_trainer ARGS: `python -m spotring.trainer
ARGS` with PyTorch's deterministic algorithms on, so that the same steps give the same bits
on a GPU too.

GPU kernels that add with atomics (cuDNN's and cuBLAS's among them) sum in whatever order
their threads finish; two runs of the same steps then differ in the last bits, and an
interrupted and resumed run cannot be compared bit for bit with an uninterrupted one.
torch.use_deterministic_algorithms picks deterministic kernels, and cuBLAS needs a fixed
workspace for them (CUBLAS_WORKSPACE_CONFIG, read when its first handle is made). The
trainer has no switch for this: it is a measurement's concern, not a training run's
(benchmarks/gpu_check.py's preemption check starts this).
"""

from __future__ import annotations

import os

import torch

from spotring.trainer.__main__ import main as trainer_main


def main() -> None:
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    # warn_only: an operation with no deterministic kernel warns (in the run's output)
    # instead of ending the run; the comparison of the weights then shows what it cost.
    torch.use_deterministic_algorithms(True, warn_only=True)
    trainer_main()


if __name__ == "__main__":
    main()
