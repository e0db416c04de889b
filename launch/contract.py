"""What a job's command is, whoever starts it (`spotring launch`, `spotring sbatch`,
`spotring sweep`), from the words after `--`:

    spotring launch nodes=2 -- python train.py --epochs 3     a command, word for word
    spotring launch nodes=2 -- train.epochs=3 dataset=cifar10 the built-in trainer's
                                                              overrides: the command is
                                                              `spotring train OVERRIDES`

The first word decides: KEY=VALUE (or +KEY=VALUE, ~KEY) makes them all the trainer's
overrides; anything else is a command. A command that starts by setting a variable is
written `env KEY=VALUE python train.py`. From there on the trainer is a command like any
other: it gets the launch contract's variables (spotring/contract.py) and reads its run
directory and checkpoint URI from them, as a user's script does.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

# The trainer, as every node runs it: the console script of the node's .venv, not
# `python -m`, which a project holding a spotring/ folder (spotring's own checkout)
# would shadow from the working directory.
TRAIN = ("spotring", "train")

# Hydra's override grammar, as far as its first word goes: key=, +key=, ++key=, ~key.
_OVERRIDE = re.compile(r"^((\+{1,2})?[A-Za-z_][\w.\-/@]*=|~[A-Za-z_][\w.\-/@]*(=|$))")


def split_command(words: Sequence[str]) -> tuple[list[str], list[str]]:
    """The words after `--` as (the trainer's overrides, a command): one of them empty."""
    if not words or _OVERRIDE.match(words[0]):
        return list(words), []
    return [], list(words)


def command_of(overrides: Sequence[str], command: Sequence[str] = ()) -> list[str]:
    """The job's command: ``command`` where there is one, else the trainer with
    ``overrides``."""
    return list(command) or [*TRAIN, *overrides]
