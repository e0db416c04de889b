"""Launch-environment detection: each launcher's variables, and none."""

from __future__ import annotations

import pytest

from trainer.runtime import Launch, detect

CASES = {
    "torchrun": ({"RANK": "3", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "4",
                  "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500"},
                 Launch("torchrun", 3, 8, 1, 4)),
    "horovodrun": ({"HOROVOD_RANK": "5", "HOROVOD_SIZE": "16", "HOROVOD_LOCAL_RANK": "1",
                    "HOROVOD_LOCAL_SIZE": "8"}, Launch("horovodrun", 5, 16, 1, 8)),
    "open mpi": ({"OMPI_COMM_WORLD_RANK": "2", "OMPI_COMM_WORLD_SIZE": "4",
                  "OMPI_COMM_WORLD_LOCAL_RANK": "0", "OMPI_COMM_WORLD_LOCAL_SIZE": "2"},
                 Launch("mpi", 2, 4, 0, 2)),
    "mpich": ({"PMI_RANK": "1", "PMI_SIZE": "2", "MPI_LOCALRANKID": "1",
               "MPI_LOCALNRANKS": "2"}, Launch("mpi", 1, 2, 1, 2)),
    "slurm srun": ({"SLURM_STEP_ID": "0", "SLURM_PROCID": "6", "SLURM_NTASKS": "8",
                    "SLURM_LOCALID": "2", "SLURM_NTASKS_PER_NODE": "4(x2)"},
                   Launch("slurm", 6, 8, 2, 4)),
    # The batch script of an allocation is not a rank of an srun step.
    "slurm batch script": ({"SLURM_PROCID": "0", "SLURM_NTASKS": "8", "SLURM_LOCALID": "0"},
                           Launch("single", 0, 1, 0, 1)),
    "nothing": ({}, Launch("single", 0, 1, 0, 1)),
}


@pytest.mark.parametrize("name", CASES)
def test_detects_the_launcher_from_its_variables(name):
    env, expected = CASES[name]
    assert detect(env) == expected
