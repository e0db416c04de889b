"""What a job's command is started with, whoever starts it (`spotring launch`, `spotring
sbatch`, `spotring sweep`), and how the words after `--` are told apart.

After `--` come either the built-in trainer's overrides or a command of the user's own:

    spotring launch nodes=2 -- train.epochs=3 dataset=cifar10     the trainer's overrides
    spotring launch nodes=2 -- python train.py --epochs 3         a command

The first word decides: KEY=VALUE (or +KEY=VALUE, ~KEY) makes them all the trainer's
overrides; anything else is a command, passed on word for word. A command that starts by
setting a variable is written `env KEY=VALUE python train.py`.

Every process of a command gets, besides its launcher's own variables (RANK, LOCAL_RANK,
WORLD_SIZE, MASTER_ADDR under torchrun; HOROVOD_RANK... under horovodrun;
OMPI_COMM_WORLD_RANK... under mpirun; SLURM_PROCID... under srun), the four below.
spotring.init reads the first two; a script without the library may read them all.
"""

from __future__ import annotations

import re

RUN_DIR = "SPOTRING_RUN_DIR"  # where rank 0 writes; what comes back to the launcher
CHECKPOINT_URI = "SPOTRING_CHECKPOINT_URI"  # s3://... every checkpoint also goes to
RUN_ID = "SPOTRING_RUN_ID"  # the same across every restart of the job
RESTART = "SPOTRING_RESTART"  # 0 on the first try, then 1, 2, ... on each restart

# Hydra's override grammar, as far as its first word goes: key=, +key=, ++key=, ~key.
_OVERRIDE = re.compile(r"^((\+{1,2})?[A-Za-z_][\w.\-/@]*=|~[A-Za-z_][\w.\-/@]*(=|$))")


def environment(run_id: str, run_dir: str, restart: int | str,
                checkpoint_uri: str | None = None) -> dict[str, str]:
    """The contract's variables for one try of a job (``restart`` may be a shell
    expansion such as $SLURM_RESTART_COUNT, for a script to expand)."""
    env = {RUN_ID: run_id, RUN_DIR: run_dir, RESTART: str(restart)}
    if checkpoint_uri:
        env[CHECKPOINT_URI] = checkpoint_uri
    return env


def split_command(words: list[str]) -> tuple[list[str], list[str]]:
    """The words after `--` as (the trainer's overrides, a command): one of them empty."""
    if not words or _OVERRIDE.match(words[0]):
        return list(words), []
    return [], list(words)
