"""What `up` learns from AWS before it creates anything (read-only calls only), and the
bad input it catches there: no credentials, an instance type the region does not offer,
a subnet that does not exist or lies outside cluster.zones, an AMI that cannot be found,
no default VPC and no subnet given, no way to find this machine's address for SSH.
AWS failing to answer (5xx, throttling, a dropped connection, once botocore's retries are
spent) says nothing of the input: that error goes on as it is, a failure (exit 1), not
bad input (exit 2).
"""

from __future__ import annotations

import urllib.request
from dataclasses import dataclass

from botocore.exceptions import (
    BotoCoreError,
    ClientError,
    NoCredentialsError,
    PartialCredentialsError,
)
from omegaconf import DictConfig

from spotring.exits import ConfigError
from spotring.launch.aws.clients import client
from spotring.launch.config import ssh_cidr_problem

# Error codes of a throttled call (AWS's services name it differently).
THROTTLING = {"Throttling", "ThrottlingException", "RequestLimitExceeded",
              "TooManyRequestsException", "RequestThrottled", "SlowDown"}

# AWS's own what-is-my-address service: the caller's public IPv4, one line.
CHECKIP_URL = "https://checkip.amazonaws.com"


@dataclass(frozen=True)
class Preflight:
    owner: str  # the caller's ARN
    gpus: dict[str, int]  # instance type -> slots per node: its GPUs, 1 without any
    cluster_placement: bool  # every type supports a cluster placement group
    subnets: dict[str, str]  # zone -> subnet, in the order to try them
    vpc: str
    ami: str
    root_device: str  # of the AMI: where the launch template sizes the volume
    ssh_cidr: str


def caller_arn(session) -> str:
    if session.get_credentials() is None:
        raise ConfigError(
            "no AWS credentials: set AWS_PROFILE (after `aws configure` or `aws sso login`) "
            "or AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY. Nothing was created.")
    try:
        return client(session, "sts").get_caller_identity()["Arn"]
    except (ClientError, BotoCoreError) as e:
        if unavailable(e):
            raise
        raise ConfigError(f"the AWS credentials do not work: {e}. Nothing was created.") from e


def preflight(cfg: DictConfig, session, ec2) -> Preflight:
    owner = caller_arn(session)
    try:
        gpus, placement = _instance_types(ec2, list(cfg.instance_types), cfg.region)
        subnets, vpc = _subnets(ec2, cfg)
        ami, root_device = _ami(session, ec2, cfg)
    except ClientError as e:  # anything else AWS refuses to tell us is no better input
        if unavailable(e):
            raise
        raise ConfigError(f"cluster: AWS says {e}. Nothing was created.") from e
    return Preflight(owner, gpus, placement, subnets, vpc, ami, root_device,
                     cfg.ssh_cidr or caller_cidr())


def unavailable(error: ClientError | BotoCoreError) -> bool:
    """Whether ``error`` is AWS not answering rather than refusing: a 5xx, throttling, or
    (any BotoCoreError but bad credentials) a connection that failed."""
    if isinstance(error, ClientError):
        return (error.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0) >= 500
                or error.response.get("Error", {}).get("Code") in THROTTLING)
    return not isinstance(error, NoCredentialsError | PartialCredentialsError)


def slots(info: dict) -> int:
    """Ranks per node: one per GPU, or one on a type without GPUs (CPU types, tests)."""
    return sum(g["Count"] for g in info.get("GpuInfo", {}).get("Gpus", [])) or 1


def _instance_types(ec2, types: list[str], region: str) -> tuple[dict[str, int], bool]:
    try:
        infos = ec2.describe_instance_types(InstanceTypes=types)["InstanceTypes"]
    except ClientError as e:
        if e.response["Error"]["Code"] != "InvalidInstanceType":
            raise
        raise ConfigError(f"cluster.instance_types={types}: {e.response['Error']['Message']} "
                          f"in {region}. Nothing was created.") from e
    by_type = {i["InstanceType"]: i for i in infos}
    placement = all("cluster" in by_type[t].get("PlacementGroupInfo", {})
                    .get("SupportedStrategies", []) for t in types)
    return {t: slots(by_type[t]) for t in types}, placement


def _subnets(ec2, cfg: DictConfig) -> tuple[dict[str, str], str]:
    zones = list(cfg.zones)
    if cfg.subnet:
        try:
            subnet = ec2.describe_subnets(SubnetIds=[cfg.subnet])["Subnets"][0]
        except ClientError as e:
            raise ConfigError(f"cluster.subnet={cfg.subnet}: not found in {cfg.region} "
                              f"({e.response['Error']['Code']}). Nothing was created.") from e
        zone = subnet["AvailabilityZone"]
        if zones and zone not in zones:
            raise ConfigError(f"cluster.subnet={cfg.subnet} is in {zone}, not in cluster.zones="
                              f"{zones}: give a subnet of one of those zones, or leave "
                              "cluster.zones empty. Nothing was created.")
        return {zone: subnet["SubnetId"]}, subnet["VpcId"]
    found = ec2.describe_subnets(Filters=[{"Name": "default-for-az", "Values": ["true"]}])
    by_zone = {s["AvailabilityZone"]: s for s in found["Subnets"]}
    if not by_zone:
        raise ConfigError(f"cluster.region={cfg.region} has no default VPC: give "
                          "cluster.subnet=subnet-... Nothing was created.")
    missing = [z for z in zones if z not in by_zone]
    if missing:
        raise ConfigError(f"cluster.zones: {missing} have no default subnet; valid: "
                          f"{sorted(by_zone)}, or give cluster.subnet. Nothing was created.")
    chosen = [by_zone[z] for z in (zones or sorted(by_zone))]
    return {s["AvailabilityZone"]: s["SubnetId"] for s in chosen}, chosen[0]["VpcId"]


def _ami(session, ec2, cfg: DictConfig) -> tuple[str, str]:
    ami = cfg.ami
    if ami is None:
        try:
            ami = client(session, "ssm").get_parameter(
                Name=cfg.ami_ssm_parameter)["Parameter"]["Value"]
        except ClientError as e:
            if unavailable(e):
                raise
            raise ConfigError(f"cluster.ami_ssm_parameter={cfg.ami_ssm_parameter}: "
                              f"{e.response['Error']['Code']} in {cfg.region}; give "
                              "cluster.ami=ami-... instead. Nothing was created.") from e
    try:
        image = ec2.describe_images(ImageIds=[ami])["Images"]
    except ClientError as e:
        image = []
        if not e.response["Error"]["Code"].startswith("InvalidAMIID"):
            raise
    if not image:
        raise ConfigError(f"cluster.ami={ami}: no such image in {cfg.region}. "
                          "Nothing was created.")
    return ami, image[0].get("RootDeviceName", "/dev/sda1")


def caller_cidr() -> str:
    """This machine's public address as a /32, for the SSH rule."""
    try:
        with urllib.request.urlopen(CHECKIP_URL, timeout=5) as reply:
            address = reply.read().decode().strip()
    except OSError as e:
        raise ConfigError(f"could not learn this machine's public address from {CHECKIP_URL} "
                          f"({e}); give it: cluster.ssh_cidr=A.B.C.D/32. Nothing was "
                          "created.") from e
    cidr = f"{address}/32"
    if ssh_cidr_problem(cidr):
        raise ConfigError(f"{CHECKIP_URL} answered {address!r}, not an address; give "
                          "cluster.ssh_cidr=A.B.C.D/32. Nothing was created.")
    return cidr
