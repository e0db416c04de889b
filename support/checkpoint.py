"""The ``checkpoint`` node of the launchers' root configs: `spotring launch` (and up,
run), `spotring sbatch` and `spotring sweep` all take ``checkpoint.uri``, the key the
trainer and spotring.CheckpointOptions take, so that a user writes one key to every
command. (spotring.init's keyword is its form of the same, checkpoint_uri=, and the
launched job gets it as $SPOTRING_CHECKPOINT_URI: spotring/contract.py.)

The one check is spotring.stores.uri_problem: a URI without a scheme (bucket/prefix,
its s3:// forgotten) is refused, naming the value and the valid forms.
"""

from __future__ import annotations

from dataclasses import dataclass

from omegaconf import DictConfig

from spotring.stores import uri_problem

KEY = "checkpoint.uri"


@dataclass
class CheckpointNode:
    # s3://, gs:// or az://bucket/prefix where the job's checkpoints also go (its
    # $SPOTRING_CHECKPOINT_URI); file:///path for a directory every node mounts. None:
    # each rank's part stays on its node.
    uri: str | None = None


def checkpoint_problems(cfg: DictConfig) -> list[str]:
    """uri_problem's line for ``cfg.checkpoint.uri`` where it is given and not a store's
    URI; else none."""
    uri = cfg.checkpoint.uri
    problem = uri_problem(uri, KEY) if uri is not None else None
    return [problem] if problem else []
