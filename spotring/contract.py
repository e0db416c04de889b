"""The launch contract: what every process of a job gets from spotring's launchers
(`spotring launch`, `spotring sbatch`, `spotring sweep`), besides its launcher's own
variables (RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR under torchrun; HOROVOD_RANK...
under horovodrun; OMPI_COMM_WORLD_RANK... under mpirun; SLURM_PROCID... under srun).

    SPOTRING_RUN_DIR         where rank 0 writes: what comes back to the launcher
    SPOTRING_CHECKPOINT_URI  s3://... that every checkpoint also goes to
    SPOTRING_RUN_ID          the same across every restart of the job
    SPOTRING_RESTART         0 on the first try, then 1, 2, ... on each restart
    SPOTRING_IN_PLACE        off, auto or on: whether the job goes on in place when
                             workers leave and join (spotring.ElasticOptions.in_place)
    SPOTRING_RENDEZVOUS      host:port of the store a job in place meets in (outlives
                             every training node)
    SPOTRING_MEMBER          this process's name among the job's workers in place
                             (default host:pid)

spotring.init (and so the built-in trainer, which is a spotring user like any script)
reads the first two and the last three; a script without the library may read them all.
"""

from __future__ import annotations

import os

RUN_DIR = "SPOTRING_RUN_DIR"
CHECKPOINT_URI = "SPOTRING_CHECKPOINT_URI"
RUN_ID = "SPOTRING_RUN_ID"
RESTART = "SPOTRING_RESTART"
IN_PLACE = "SPOTRING_IN_PLACE"
RENDEZVOUS = "SPOTRING_RENDEZVOUS"
MEMBER = "SPOTRING_MEMBER"


def environment(run_id: str, run_dir: str, restart: int | str,
                checkpoint_uri: str | None = None) -> dict[str, str]:
    """The contract's variables for one try of a job (``restart`` may be a shell
    expansion such as $SLURM_RESTART_COUNT, for a script to expand)."""
    env = {RUN_ID: run_id, RUN_DIR: run_dir, RESTART: str(restart)}
    if checkpoint_uri:
        env[CHECKPOINT_URI] = checkpoint_uri
    return env


def run_dir() -> str | None:
    """This job's run directory, where a launcher gave one."""
    return os.environ.get(RUN_DIR) or None


def checkpoint_uri() -> str | None:
    """Where this job's checkpoints also go, where a launcher gave it."""
    return os.environ.get(CHECKPOINT_URI) or None


def in_place() -> str | None:
    """Whether this job goes on in place (off, auto, on), where a launcher said so."""
    return os.environ.get(IN_PLACE) or None


def rendezvous() -> str | None:
    """host:port of the store this job's workers meet in, where a launcher gave one."""
    return os.environ.get(RENDEZVOUS) or None


def member() -> str | None:
    """This process's name among the job's workers, where a launcher gave one."""
    return os.environ.get(MEMBER) or None

