"""What a job's command is started with, whoever starts it (`spotring launch`, `spotring
sbatch`, `spotring sweep`), and how the words after `--` are told apart.

After `--` come either the built-in trainer's overrides or a command of the user's own:

    spotring launch nodes=2 -- train.epochs=3 dataset=cifar10     the trainer's overrides
    spotring launch nodes=2 -- python train.py --epochs 3         a command

The first word decides: KEY=VALUE (or +KEY=VALUE, ~KEY) makes them all the trainer's
overrides; anything else is a command, passed on word for word. A command that starts by
setting a variable is written `env KEY=VALUE python train.py`.

Every process of a command gets the launch contract's variables (spotring/contract.py).
"""

from __future__ import annotations

import re

# Hydra's override grammar, as far as its first word goes: key=, +key=, ++key=, ~key.
_OVERRIDE = re.compile(r"^((\+{1,2})?[A-Za-z_][\w.\-/@]*=|~[A-Za-z_][\w.\-/@]*(=|$))")


def split_command(words: list[str]) -> tuple[list[str], list[str]]:
    """The words after `--` as (the trainer's overrides, a command): one of them empty."""
    if not words or _OVERRIDE.match(words[0]):
        return list(words), []
    return [], list(words)
