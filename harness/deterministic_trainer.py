"""python harness/deterministic_trainer.py ARGS: `python -m spotring.trainer ARGS` with
PyTorch's deterministic algorithms on, so that the same steps give the same bits on a GPU
too (tests/test_gpu.py's preemption test compares a resumed run with an uninterrupted one
bit for bit).

GPU kernels that add with atomics (cuDNN's and cuBLAS's among them) sum in whatever order
their threads finish, so two runs of the same steps differ in the last bits.
torch.use_deterministic_algorithms picks deterministic kernels, and cuBLAS needs a fixed
workspace for them (CUBLAS_WORKSPACE_CONFIG, read when its first handle is made). The
trainer has no switch for this: it is a test's concern, not a training run's. Run by its
path, it imports nothing from harness/ or tests/ (tools/gpu-check runs it where neither
is on the path).
"""

from __future__ import annotations

import os

import torch

from spotring.trainer.__main__ import main

if __name__ == "__main__":
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    # warn_only: an operation with no deterministic kernel warns (in the run's output)
    # instead of ending the run; the comparison of the weights then shows what it cost.
    torch.use_deterministic_algorithms(True, warn_only=True)
    main()
