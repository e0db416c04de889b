"""cluster=aws_spot: EC2 spot instances in one zone, all or nothing.

    check     credentials, types, subnets, AMI, SSH CIDR (checks.py; read-only)
    create    key pair, security group, placement group, launch template (resources.py),
              then fleet attempts (fleet.py) until one gives all N and they all come up
              (instances.py); on any failure everything of the run is deleted again
    destroy   everything tagged with the run id (or, all_mine, with this owner), each
              resource tried even when others fail; Leftovers names what is still there
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence
from functools import cached_property

from omegaconf import DictConfig

from spotring.launch.aws import checks, clients, fleet, instances, resources, tags, user_data
from spotring.launch.aws.prices import spot_prices
from spotring.launch.down import down_after
from spotring.launch.provider import NoCapacity, Node, Provider
from spotring.launch.rundir import RunDir

log = logging.getLogger("launch")


class AwsSpot(Provider):
    name = "aws_spot"

    def __init__(self, cfg: DictConfig, run: RunDir, project: str):
        self.cfg = cfg
        self.run = run
        self.project = project
        self.resource_name = f"spotring-{run.id}"
        self._preflight: checks.Preflight | None = None
        self.template: str | None = None  # the launch template's id, once made

    # Made on first use, so that a dry run never builds a client, let alone calls AWS.
    @cached_property
    def session(self):
        return clients.session(self.cfg.region)

    @cached_property
    def ec2(self):
        return clients.client(self.session, "ec2")

    @property
    def workdir(self) -> str:
        return self.cfg.workdir

    @property
    def preflight(self) -> checks.Preflight:
        if self._preflight is None:
            self._preflight = checks.preflight(self.cfg, self.session, self.ec2)
        return self._preflight

    def check(self) -> None:
        _ = self.preflight

    def plan(self, count: int) -> list[str]:
        c, name = self.cfg, self.resource_name
        zones = ", ".join(c.zones) if c.zones else f"each zone of {c.region} with a default subnet"
        lifecycles = "spot, then on-demand" if c.on_demand_fallback else "spot only"
        price = f"at most ${c.max_price}/hour" if c.max_price else "up to the on-demand price"
        return [
            f"key pair {name}: ed25519, made here; the private key stays in {self.run.path}",
            f"security group {name}: all traffic from itself, tcp/22 from "
            + (c.ssh_cidr or f"this machine's public address/32 ({checks.CHECKIP_URL})"),
            f"cluster placement group {name}, if every type supports it"
            if c.placement_group else "no placement group (cluster.placement_group=false)",
            f"launch template {name}: AMI {c.ami or 'from SSM ' + c.ami_ssm_parameter}, "
            "IMDSv2 required, "
            f"{c.volume_gb} GB gp3, user data makes {c.workdir} for {c.ssh_user}",
            f"create_fleet type=instant, {count} nodes or none (MinTargetCapacity={count}, "
            f"one zone), price-capacity-optimized, {price}; tries {', '.join(c.instance_types)} "
            f"in {zones} in that order, {lifecycles}",
            f"waits up to {c.wait_timeout_s:.0f} s for running + status checks ok; slots per "
            "node = GPUs (describe_instance_types)",
            f"tags everything: project={self.project}, {tags.RUN_TAG}={self.run.id}, "
            "owner=<your ARN>",
        ]

    # -------------------------------------------------------------------- create

    def create(self, count: int) -> list[Node]:
        pf, name = self.preflight, self.resource_name
        run_tags = tags.Tags(self.project, self.run.id, pf.owner)
        try:
            resources.create_key_pair(self.ec2, name, self.run.key.with_suffix(".pub").read_text(),
                                      run_tags)
            group = resources.create_security_group(self.ec2, name, pf.vpc, pf.ssh_cidr, run_tags)
            log.info("up: key pair and security group %s (ssh from %s)", name, pf.ssh_cidr)
            placement = name if self.cfg.placement_group and pf.cluster_placement else None
            if placement:
                resources.create_placement_group(self.ec2, name, run_tags)
            self.template = resources.create_launch_template(
                self.ec2, name, ami=pf.ami, root_device=pf.root_device,
                volume_gb=self.cfg.volume_gb, key=name, security_group=group,
                placement_group=placement, instance_profile=self.cfg.instance_profile,
                tags=run_tags,
                user_data=user_data.render(self.cfg.ssh_user, self.cfg.workdir))
            log.info("up: launch template %s (%s)%s", name, pf.ami,
                     f", placement group {name}" if placement else "")
            return self._fleet(count, run_tags, self.preflight.subnets,
                               list(self.cfg.instance_types))
        except BaseException as e:
            log.info("up: failed; deleting what was made")
            down_after(self.run, self, e)
            raise

    def _fleet(self, count: int, run_tags: tags.Tags, subnets: dict[str, str],
               types: list[str]) -> list[Node]:
        failures = []
        for attempt in fleet.attempts(types, subnets,
                                      self.cfg.on_demand_fallback):
            launched = fleet.launch(self.ec2, attempt, count, self.template, run_tags,
                                    self.cfg.max_price)
            ids = launched.instance_ids
            if len(ids) == count:
                log.info("up: %s: %d instances, waiting for them to be ready", attempt, count)
                try:
                    instances.wait_ready(self.ec2, ids, self.cfg.wait_timeout_s, self.cfg.poll_s)
                    return self._nodes([{"Name": "instance-id", "Values": ids}])
                except instances.Lost as e:
                    failures.append(f"{attempt}: {e}")
            else:
                failures.append(f"{attempt}: {len(ids)} of {count} instances"
                                + (f" ({'; '.join(launched.errors)})" if launched.errors else ""))
            fleet.undo(self.ec2, launched)
            log.info("up: %s", failures[-1])
        raise NoCapacity(f"no attempt got {count} nodes at once:\n  - " + "\n  - ".join(failures)
                         + "\nTry other cluster.instance_types or cluster.zones, fewer nodes, "
                         "or cluster.on_demand_fallback=true.")

    def _nodes(self, filters: list[dict]) -> list[Node]:
        found = instances.describe(self.ec2, filters)
        if not found:
            return []
        types = sorted({n.type for n in found})
        infos = self.ec2.describe_instance_types(InstanceTypes=types)["InstanceTypes"]
        slots = {i["InstanceType"]: checks.slots(i) for i in infos}
        prices = spot_prices(self.ec2, types, sorted({n.zone for n in found}))
        return [dataclasses.replace(n, slots=slots[n.type], price=prices.get((n.type, n.zone))
                                    if n.lifecycle == "spot" else None) for n in found]

    # ----------------------------------------------------------- the run's nodes

    def describe(self) -> list[Node]:
        return self._nodes([*tags.run_filter(self.run.id),
                            {"Name": "instance-state-name", "Values": resources.LIVE}])

    def replace(self, lost: Sequence[Node]) -> list[Node]:
        """As many new instances from the run's launch template: the lost nodes' type
        first, then cluster.instance_types in order, in the lost nodes' zone only (the
        cluster placement group and the other nodes are there, and a ring across zones
        is slower and billed per GB). The caller records the new list."""
        self.ec2.terminate_instances(InstanceIds=[n.id for n in lost])
        templates = self.ec2.describe_launch_templates(
            Filters=tags.run_filter(self.run.id))["LaunchTemplates"]
        self.template = templates[0]["LaunchTemplateId"]
        run_tags = tags.Tags(self.project, self.run.id, self.preflight.owner)
        zones = {n.zone for n in lost}
        subnets = {z: s for z, s in self.preflight.subnets.items() if z in zones}
        types = list(dict.fromkeys([*(n.type for n in lost), *self.cfg.instance_types]))
        return self._fleet(len(lost), run_tags, subnets, types)

    def destroy(self, all_mine: bool = False) -> list[str]:
        filters = (tags.owner_filter(self.project, checks.caller_arn(self.session))
                   if all_mine else tags.run_filter(self.run.id))
        return resources.delete_all(self.ec2, filters, self.cfg.placement_group,
                                    self.cfg.poll_s).outcome(self.run.id, all_mine)

    def prices(self) -> list[tuple[str, str, float]]:
        zones = list(self.cfg.zones) or None
        found = spot_prices(self.ec2, list(self.cfg.instance_types), zones)
        return sorted((t, z, p) for (t, z), p in found.items())
