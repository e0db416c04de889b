"""The built-in trainer: `spotring train`, configured by Hydra (__main__.py is the
runbook). A spotring user like any script: it starts its job through spotring's API."""

from spotring.cli import Command

# What this package adds to the `spotring` command (spotring/cli.py).
COMMANDS = {
    "train": Command("spotring.trainer.__main__:main",
                     "train here: alone, or as the program torchrun, horovodrun, mpirun or "
                     "srun starts (Hydra overrides)",
                     check="spotring.trainer.__main__:check",
                     pin="spotring.trainer.__main__:pin"),
}
