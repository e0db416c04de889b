"""The provider a launch config names (conf/cluster/NAME.yaml): each is imported only
when chosen, so that the local cluster needs no boto3 and EC2 no netns tools."""

from __future__ import annotations

from omegaconf import DictConfig

from spotring.launch.provider import Provider
from spotring.launch.rundir import RunDir


def provider_for(cfg: DictConfig, run: RunDir) -> Provider:
    """The provider conf/cluster/NAME.yaml names; each is imported only when chosen."""
    if cfg.cluster.name == "local":
        from spotring.launch.local.provider import LocalCluster

        return LocalCluster(cfg.cluster, run)
    from spotring.launch.aws.provider import AwsSpot

    return AwsSpot(cfg.cluster, run, cfg.project)
