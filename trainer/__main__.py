"""python -m trainer: synchronous data-parallel training, configured by Hydra.

One machine, the default (MNIST, 2 workers on CPU or one per GPU):

    make train
    torchrun --standalone --nproc-per-node 2 -m trainer

Other datasets, models, engines; anything in `python -m trainer --cfg job`:

    torchrun --nproc-per-node 4 -m trainer dataset=cifar10 model=resnet20 train.epochs=30
    horovodrun -np 2 -H localhost:2 python -m trainer engine=horovod
    mpirun -np 2 python -m trainer engine=ddp            # or engine=horovod

Several machines (every host has this repository and its .venv at the same path):

    horovodrun -np 16 -H a:8,b:8 python -m trainer engine=horovod
    torchrun --nnodes 2 --nproc-per-node 8 --rdzv-endpoint a:29500 -m trainer
    make launch NODES=8                                   # EC2 spot instances

Resume: run the same command with the same run directory (resume=auto is the
default), e.g. `hydra.run.dir=runs/mnist`, or give `resume=PATH/ckpt-000000500.pt`.
Every rank reads this; only rank 0 writes logs, TensorBoard files and checkpoints.
"""

from __future__ import annotations

import logging
import sys

import hydra
from omegaconf import DictConfig

from trainer import config, job, runtime


@hydra.main(version_base="1.3", config_path="../conf", config_name="config")
def _hydra_main(cfg: DictConfig) -> None:
    sys.exit(job.run(cfg))


def main() -> None:
    rank = runtime.env_rank()
    if rank > 0:
        # Only rank 0 keeps a run directory and a log file; the others must not write
        # Hydra's files (or leave empty directories stamped with their own start times)
        # and only speak up, on stderr, when something is wrong.
        logging.basicConfig(level=logging.WARNING,
                            format=f"[rank {rank}] %(levelname)s %(name)s: %(message)s")
        sys.argv += ["hydra.output_subdir=null", "hydra/job_logging=none",
                     "hydra/hydra_logging=none"]
        if not any(arg.startswith("hydra.run.dir=") for arg in sys.argv):
            sys.argv.append("hydra.run.dir=.")
    config.register()
    _hydra_main()


if __name__ == "__main__":
    main()
