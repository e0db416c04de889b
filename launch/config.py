"""The launcher's structured configs (Hydra schemas) and the checks that need no network.

conf/launch.yaml picks a cluster (conf/cluster/aws_spot.yaml or local.yaml); the
dataclasses here fix the keys and their types, so `cluster.instance_type=g5.xlarge`
(a typo of instance_types) fails in Hydra before anything runs. ``validate`` then
checks what types cannot, offline: the region and instance types against botocore's
own lists, the SSH CIDR, the counts (the job's command is checked with the project:
launch/project.py). The checks that need AWS (credentials, the subnet's zone, the AMI)
are the provider's ``check``; all run before any resource exists. The launcher's config
is its own root: `spotring train` never sees it.
"""

from __future__ import annotations

import difflib
import ipaddress
import re
from dataclasses import dataclass, field, fields
from pathlib import Path

from hydra.core.config_store import ConfigStore
from omegaconf import II, MISSING, DictConfig, OmegaConf

from spotring.exits import ConfigError
from spotring.launch.contract import command_of, split_command
from spotring.options import one_of
from spotring.support.checkpoint import CheckpointNode, checkpoint_problems
from spotring.support.compose import compose_checked

CLUSTERS = ("aws_spot", "local")
LAUNCHERS = ("horovodrun", "mpirun", "torchrun", "none", "in_place")

# ----------------------------------------------------------------------------- schemas


@dataclass
class ClusterConfig:
    name: str = MISSING
    ssh_user: str = MISSING
    # Shell command run in the workdir of every node before its environment is built
    # (system packages the image lacks); empty: nothing to do.
    setup: str = ""
    # The image's Python, under every node's .venv (launch/node_env.py): what it has
    # installed (torch, say) is not installed again. None: the launcher's own (local).
    python: str | None = None
    # A node that comes later (a replacement) gets a copy of a built node's .venv instead
    # of building its own.
    copy_env: bool = True
    ssh_timeout_s: float = 300.0  # for sshd to answer on new nodes
    max_nodes: int = 16  # a guard against NODES=80 meant as 8
    # Recovery (launch/recover.py; the policy: docs/exit-codes.md), two budgets counted
    # apart: restarts after a preemption (a spot notice or SIGTERM reached the job: exit
    # 75), which spot nodes are for, and after any other stop (a lost rank, exit 69; a
    # crash; a node gone without notice), which may be a bug: by default a run rides out
    # three preemptions and stops at the first failure. Restarts go on no fewer than
    # min_nodes nodes. A node that announces a spot notice is taken down and replaced at
    # once; after a preemption with no such node, the launcher waits up to notice_wait_s
    # for one, or for a node to leave `running` (EC2 gives two minutes).
    max_preemptions: int = 3
    max_restarts: int = 0
    min_nodes: int = II("nodes")
    notice_wait_s: float = 150.0
    notice_poll_s: float = 5.0
    # The ledger's comparison (launch/ledger.py): $/hour on demand per instance type.
    # Empty: the ledger says the on-demand cost is unknown.
    on_demand_prices: dict[str, float] = field(default_factory=dict)


@dataclass
class AwsSpotConfig(ClusterConfig):
    region: str = "us-east-1"
    zones: list[str] = field(default_factory=list)  # empty: every zone of the region
    instance_types: list[str] = field(default_factory=lambda: ["g5.xlarge"])  # preferred first
    ami: str | None = None  # an AMI id; else the one the SSM parameter names
    ami_ssm_parameter: str = MISSING
    subnet: str | None = None  # a subnet id; default: the default VPC's subnet of each zone
    max_price: float | None = None  # $/hour per instance; None: up to the on-demand price
    on_demand_fallback: bool = False  # when no spot capacity is found anywhere
    # Who may SSH to the nodes; None: this machine's public address /32, asked of
    # checkip.amazonaws.com. Never 0.0.0.0/0.
    ssh_cidr: str | None = None
    placement_group: bool = True  # a cluster placement group where the types support it
    # An existing IAM instance profile for the nodes: what they may do in AWS, e.g.
    # write checkpoints to the S3 of checkpoint.uri. None: the nodes get no credentials.
    instance_profile: str | None = None
    volume_gb: int = 100
    volume_usd_per_gb_month: float = 0.08  # gp3 in us-east-1; billed per second, 60 s minimum
    workdir: str = MISSING  # where the code goes, the same path on every node
    wait_timeout_s: float = 900.0  # for running + status checks ok
    poll_s: float = 10.0


@dataclass
class LocalClusterConfig(ClusterConfig):
    """Nodes are network namespaces on this machine, each with its own sshd (root only)."""

    slots: int = 1  # ranks per node
    # $/hour per node, to rehearse a run's bill (ledger.json, `spotring cost`) with
    # prices of your own; this machine itself bills nothing, hence 0.
    price: float = 0.0
    subnet: str = "10.213.0.0/16"  # each run takes a free /24 of it


@dataclass
class JobConfig:
    # horovodrun | mpirun | torchrun | none (once per node) | in_place (once per slot, and
    # the job trains on through lost nodes, their replacements joining it: launch/in_place.py)
    launcher: str = "horovodrun"
    # The job's command (also: after `--`, launch/contract.py); none: the built-in
    # trainer, `spotring train ARGS`, with the trainer's overrides ``args``.
    command: list[str] = field(default_factory=list)
    args: list[str] = field(default_factory=list)
    # Where rank 0 of the command writes, relative to the project (default: runs/<run id>,
    # which $SPOTRING_RUN_DIR names and spotring.init writes to): brought back as job/.
    results: str | None = None
    # Variables set for the job's every process on every node (as mpirun -x passes them),
    # +job.env.NAME=VALUE: an emulator's endpoint, a store's credentials where the nodes
    # have none of their own.
    # They travel on the job's command line: prefer the nodes' own credential chain (an
    # instance profile, a service account, a managed identity) for secrets.
    env: dict[str, str] = field(default_factory=dict)
    # The project directory (where the launcher runs) goes to every node, up to this size.
    max_project_mb: float = 200.0


@dataclass
class LaunchConfig:
    cluster: ClusterConfig = MISSING
    job: JobConfig = field(default_factory=JobConfig)
    # checkpoint.uri: where the job's checkpoints also go (its $SPOTRING_CHECKPOINT_URI);
    # each node reaches it by its cloud's credential chain.
    checkpoint: CheckpointNode = field(default_factory=CheckpointNode)
    nodes: int = 1
    run_id: str | None = None  # run, status, down, cost: default the newest run
    runs_dir: str = "runs/launch"
    project: str = "spotring"  # the value of every resource's `project` tag


_SCHEMAS = {"aws_spot": AwsSpotConfig, "local": LocalClusterConfig}


def register() -> None:
    """Schemas where conf/launch.yaml and conf/cluster/*.yaml extend them."""
    cs = ConfigStore.instance()
    cs.store(name="launch_schema", node=LaunchConfig)
    for name, node in _SCHEMAS.items():
        cs.store(group="schema/cluster", name=name, node=node)


def cluster_keys() -> dict[str, list[str]]:
    """The cluster.* keys, from the schemas (for --help): those of every cluster under
    "any", then each cluster's own."""
    common = [f.name for f in fields(ClusterConfig) if f.name != "name"]
    return {"any": common} | {name: [f.name for f in fields(schema) if f.name not in common
                                     and f.name != "name"] for name, schema in _SCHEMAS.items()}


def compose(overrides: list[str]) -> DictConfig:
    """conf/launch.yaml with Hydra overrides; a bad override is a ConfigError."""
    register()
    return compose_checked("launch", overrides,
                           "See conf/launch.yaml and conf/cluster/, or the plan of a command "
                           "line with `spotring up --dry-run`.")


def with_saved_cluster(cfg: DictConfig, saved: Path, keep: list[str]) -> DictConfig:
    """``cfg`` with the cluster and node count a run was brought up with: a run's
    nodes, region and tags do not change after `up`, whatever later commands say; but
    the keys in ``keep`` (dotted) stay as ``cfg`` has them."""
    old = OmegaConf.load(saved)
    kept = {key: OmegaConf.select(cfg, key) for key in keep}
    cfg.cluster = OmegaConf.merge(OmegaConf.structured(_SCHEMAS[old.cluster.name]), old.cluster)
    cfg.nodes = old.nodes
    for key, value in kept.items():
        OmegaConf.update(cfg, key, value, merge=False)
    return cfg


def add_words(cfg: DictConfig, words: list[str]) -> None:
    """The words after `--` into cfg.job: a command, or more of the trainer's overrides
    (launch/contract.py)."""
    overrides, command = split_command(words)
    cfg.job.args = [*cfg.job.args, *overrides]
    cfg.job.command = command or list(cfg.job.command)


def job_command(job: DictConfig) -> list[str]:
    """The job's command: job.command, or the trainer with job.args."""
    return command_of(job.args, job.command)


def saved_command(saved: Path) -> list[str]:
    """The job's command a run was brought up with."""
    job = OmegaConf.load(saved).job
    return command_of(job.get("args", []), job.get("command", []))


# -------------------------------------------------------------------------- validation


def validate(cfg: DictConfig) -> None:
    """Raise ConfigError listing every problem that needs no network, or return."""
    c = cfg.cluster
    problems = list(filter(None, [
        one_of("cluster", c.name, CLUSTERS),
        one_of("job.launcher", cfg.job.launcher, LAUNCHERS),
    ]))

    def need(ok: bool, line: str) -> None:
        if not ok:
            problems.append(line)

    need(1 <= cfg.nodes <= c.max_nodes,
         f"nodes={cfg.nodes}: must be from 1 to cluster.max_nodes={c.max_nodes}")
    need(cfg.nodes < 1 or 1 <= c.min_nodes <= cfg.nodes,
         f"cluster.min_nodes={c.min_nodes}: must be from 1 to nodes={cfg.nodes}")
    for key in ("max_preemptions", "max_restarts"):
        need(c[key] >= 0, f"cluster.{key}={c[key]}: must be 0 or more")
    problems += [f"cluster.on_demand_prices: {t}={p}: $/hour per instance type, 0 or more, "
                 "e.g. {g5.xlarge: 1.006}"
                 for t, p in c.on_demand_prices.items() if p is None or p < 0]
    need(c.ssh_timeout_s > 0, f"cluster.ssh_timeout_s={c.ssh_timeout_s}: must be positive")
    need(not (cfg.job.command and cfg.job.args),
         f"job.args={list(cfg.job.args)} with job.command={list(cfg.job.command)}: the "
         "trainer's overrides or a command, not both")
    results = cfg.job.results
    need(results is None or not (Path(results).is_absolute() or ".." in Path(results).parts),
         f"job.results={results}: a directory relative to the project, inside it")
    need(cfg.job.max_project_mb > 0,
         f"job.max_project_mb={cfg.job.max_project_mb}: must be positive")
    problems += checkpoint_problems(cfg)
    problems += [f"job.env: {name}: not a variable's name (letters, digits and _, not first a "
                 "digit), e.g. +job.env.STORAGE_EMULATOR_HOST=http://10.0.0.1:9023"
                 for name in cfg.job.env if not re.fullmatch(r"[A-Za-z_]\w*", name)]
    if c.name == "aws_spot":
        problems += _aws_problems(c)
    elif c.name == "local":
        need(c.slots >= 1, f"cluster.slots={c.slots}: must be 1 or more")
        need(c.price >= 0, f"cluster.price={c.price}: $/hour per node, 0 or more")
        problems += filter(None, [_subnet_problem(c.subnet, cfg.nodes)])
    if problems:
        raise ConfigError("bad launch configuration:\n  - " + "\n  - ".join(problems)
                          + "\nNothing was created. See conf/launch.yaml and conf/cluster/.")


def _aws_problems(c: DictConfig) -> list[str]:
    import botocore.session  # boto3's own lists of regions and instance types, offline

    botocore = botocore.session.get_session()
    regions = botocore.get_available_regions("ec2")
    types = botocore.get_service_model("ec2").shape_for("InstanceType").enum
    problems = list(filter(None, [one_of("cluster.region", c.region, regions)]))
    problems += [_unknown("cluster.instance_types", t, types,
                          "any EC2 instance type, e.g. g5.xlarge, g4dn.12xlarge, p4d.24xlarge")
                 for t in c.instance_types if t not in types]
    if not c.instance_types:
        problems.append("cluster.instance_types=[]: name at least one, e.g. [g5.xlarge]")
    problems += [f"cluster.zones: {z} is not a zone of cluster.region={c.region}"
                 for z in c.zones if not (z.startswith(c.region) and len(z) == len(c.region) + 1)]
    if c.ssh_cidr is not None:
        problems += filter(None, [ssh_cidr_problem(c.ssh_cidr)])
    if c.max_price is not None and c.max_price <= 0:
        problems.append(f"cluster.max_price={c.max_price}: must be positive (or null)")
    if c.ami is not None and not str(c.ami).startswith("ami-"):
        problems.append(f"cluster.ami={c.ami}: expected an AMI id (ami-...) or null")
    if c.volume_gb < 8:
        problems.append(f"cluster.volume_gb={c.volume_gb}: at least 8 GB")
    if c.volume_usd_per_gb_month < 0:
        problems.append(f"cluster.volume_usd_per_gb_month={c.volume_usd_per_gb_month}: "
                        "$ per GB-month, 0 or more (gp3 in us-east-1: 0.08)")
    if c.wait_timeout_s <= 0 or c.poll_s <= 0:
        problems.append(f"cluster.wait_timeout_s={c.wait_timeout_s}, cluster.poll_s="
                        f"{c.poll_s}: must be positive")
    return problems


def ssh_cidr_problem(cidr: str) -> str | None:
    try:
        net = ipaddress.ip_network(cidr, strict=False)
    except ValueError:
        return f"cluster.ssh_cidr={cidr}: not an address range; expected e.g. 203.0.113.7/32"
    if net.version != 4:
        return (f"cluster.ssh_cidr={cidr}: the security group takes an IPv4 range, e.g. "
                "203.0.113.7/32")
    if net.prefixlen == 0:
        return (f"cluster.ssh_cidr={cidr}: would open SSH to the whole internet; give your "
                "own address, e.g. 203.0.113.7/32")
    if net.prefixlen < 8:
        return (f"cluster.ssh_cidr={cidr}: would open SSH to a {net.num_addresses:,}-address "
                "part of the internet; give your own address, e.g. 203.0.113.7/32")
    return None


def _subnet_problem(subnet: str, nodes: int) -> str | None:
    try:
        net = ipaddress.ip_network(subnet)
    except ValueError:
        return f"cluster.subnet={subnet}: not an IPv4 network; expected e.g. 10.213.0.0/16"
    if net.version != 4 or net.prefixlen > 24:
        return f"cluster.subnet={subnet}: must be an IPv4 network of /24 or larger"
    if nodes > 240:  # node i is .10+i of the run's /24
        return f"nodes={nodes}: a local cluster holds at most 240 nodes"
    return None


def _unknown(key: str, value: str, valid: list[str], what: str) -> str:
    close = difflib.get_close_matches(value, valid, n=1)
    hint = f" (did you mean {close[0]}?)" if close else ""
    return f"{key}: {value}: unknown{hint}; valid: {what}"
