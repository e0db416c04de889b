"""A run's instances: waiting until they are ready, and describing them as Nodes.

The wait polls describe_instance_status itself rather than use boto3's waiters: a spot
instance can be reclaimed while it boots, and a waiter would wait out its whole timeout
for an instance that is gone. The poll notices at its next look, and `up` moves on to the
next attempt.
"""

from __future__ import annotations

import ipaddress

from botocore.exceptions import ClientError

from spotring.launch.provider import Node
from spotring.polling import poll

GONE = {"shutting-down", "terminated", "stopping", "stopped"}


class Lost(RuntimeError):
    """Instances left `running` (or never reached it) while we waited."""


def wait_ready(ec2, ids: list[str], timeout_s: float, poll_s: float) -> None:
    """Until every instance is running with both status checks ok; Lost if one goes."""
    ready: list[str] = []

    def all_ready() -> bool | None:
        nonlocal ready
        try:
            statuses = ec2.describe_instance_status(InstanceIds=ids, IncludeAllInstances=True)
        except ClientError as e:
            # New instance ids take a moment to be known everywhere (eventual consistency).
            if e.response["Error"]["Code"] != "InvalidInstanceID.NotFound":
                raise
            statuses = {"InstanceStatuses": []}
        by_id = {s["InstanceId"]: s for s in statuses["InstanceStatuses"]}
        lost = {i: s["InstanceState"]["Name"] for i, s in by_id.items()
                if s["InstanceState"]["Name"] in GONE}
        if lost:
            raise Lost("lost while starting: " + ", ".join(f"{i} ({s})" for i, s in lost.items()))
        ready = [i for i, s in by_id.items() if s["InstanceState"]["Name"] == "running"
                 and s["InstanceStatus"]["Status"] == "ok" and s["SystemStatus"]["Status"] == "ok"]
        return len(ready) == len(ids) or None

    try:
        poll(all_ready, timeout_s=timeout_s, interval_s=poll_s,
             what=f"{len(ids)} instances running with status checks ok "
                  "(cluster.wait_timeout_s)")
    except TimeoutError as e:
        waiting = ", ".join(i for i in ids if i not in ready)
        raise TimeoutError(f"{e}; {len(ready)} ready, still waiting for {waiting}") from None


def describe(ec2, filters: list[dict]) -> list[Node]:
    """The instances ``filters`` find, ordered by private address (node 0 first), with 1
    slot and no price: the provider knows those (describe_instance_types, spot prices)."""
    nodes = []
    for page in ec2.get_paginator("describe_instances").paginate(Filters=filters):
        for i in (i for r in page["Reservations"] for i in r["Instances"]):
            private = i.get("PrivateIpAddress", "")
            nodes.append(Node(
                id=i["InstanceId"],
                # No public address (a private subnet): this machine must be in the VPC.
                address=i.get("PublicIpAddress") or private,
                private_address=private,
                slots=1,
                type=i["InstanceType"],
                zone=i["Placement"]["AvailabilityZone"],
                lifecycle="spot" if i.get("InstanceLifecycle") == "spot" else "on-demand",
                state=i["State"]["Name"],
                launched_at=i["LaunchTime"].timestamp()))
    return sorted(nodes, key=lambda n: ipaddress.ip_address(n.private_address or "0.0.0.0"))
