"""The resources around a run's instances, created tagged and deleted by tag.

    created in this order         deleted in this order (what depends on what goes first)
    1. key pair (public key only) 1. fleets, with their instances; wait until terminated
    2. security group             2. launch templates
    3. cluster placement group    3. placement groups (empty once instances are gone)
    4. launch template            4. security groups (free once the instances' network
                                     interfaces are released: retried until then)
                                  5. key pairs

A teardown tries every resource even when calls fail (each call retried by botocore
first, on throttling, 5xx and dropped connections), keeps each failure, and looks every
kind up again at the end: what is still there is what `down` names.
"""

from __future__ import annotations

import base64
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

from botocore.exceptions import BotoCoreError, ClientError
from botocore.parsers import ResponseParserError

from spotring.launch.aws import tags as tagging
from spotring.launch.aws.tags import Tags
from spotring.launch.provider import Teardown
from spotring.polling import poll


def create_key_pair(ec2, name: str, public_key: str, tags: Tags) -> None:
    # Imported, not created by AWS: the private key is made here and never sent anywhere.
    ec2.import_key_pair(KeyName=name, PublicKeyMaterial=public_key.encode(),
                        TagSpecifications=tags.spec("key-pair"))


def create_security_group(ec2, name: str, vpc: str, ssh_cidr: str, tags: Tags) -> str:
    group = ec2.create_security_group(
        GroupName=name, VpcId=vpc, TagSpecifications=tags.spec("security-group"),
        Description="spotring run: all traffic between its nodes, SSH from the launcher")
    group_id = group["GroupId"]
    ec2.authorize_security_group_ingress(GroupId=group_id, IpPermissions=[
        {"IpProtocol": "-1",
         "UserIdGroupPairs": [{"GroupId": group_id, "Description": "the run's nodes"}]},
        {"IpProtocol": "tcp", "FromPort": 22, "ToPort": 22,
         "IpRanges": [{"CidrIp": ssh_cidr, "Description": "the launcher"}]},
    ])
    return group_id


def create_placement_group(ec2, name: str, tags: Tags) -> None:
    # cluster: the nodes close together in one zone, for allreduce bandwidth.
    ec2.create_placement_group(GroupName=name, Strategy="cluster",
                               TagSpecifications=tags.spec("placement-group"))


def create_launch_template(ec2, name: str, *, ami: str, root_device: str, volume_gb: int,
                           key: str, security_group: str, placement_group: str | None,
                           instance_profile: str | None, user_data: str, tags: Tags) -> str:
    data = {
        "ImageId": ami,
        "KeyName": key,
        "SecurityGroupIds": [security_group],
        # IMDSv2 only; hop limit 2 so containers on the node reach it too (the trainer
        # polls it for spot interruption notices).
        "MetadataOptions": {"HttpTokens": "required", "HttpEndpoint": "enabled",
                            "HttpPutResponseHopLimit": 2},
        "UserData": base64.b64encode(user_data.encode()).decode(),
        "BlockDeviceMappings": [{"DeviceName": root_device, "Ebs": {
            "VolumeSize": volume_gb, "VolumeType": "gp3", "DeleteOnTermination": True}}],
        "InstanceInitiatedShutdownBehavior": "terminate",
        "TagSpecifications": tags.spec("instance", "volume", "network-interface"),
    }
    if placement_group:
        data["Placement"] = {"GroupName": placement_group}
    if instance_profile:
        data["IamInstanceProfile"] = {"Name": instance_profile}
    template = ec2.create_launch_template(LaunchTemplateName=name, LaunchTemplateData=data,
                                          TagSpecifications=tags.spec("launch-template"))
    return template["LaunchTemplate"]["LaunchTemplateId"]


LIVE = ["pending", "running", "stopping", "stopped", "shutting-down"]
# What still costs money, or still holds its security group: shutting-down is on its way.
LEFT = ["pending", "running", "stopping", "stopped"]
# Errors of a deletion or a look-up once botocore's retries are spent (throttling, 5xx,
# dropped connections; an answer that is not AWS's XML, as a proxy's error page, is a
# ResponseParserError), or of a wait that ran out: noted, and the teardown goes on.
CALL_ERRORS = (ClientError, BotoCoreError, ResponseParserError, TimeoutError)


@dataclass(frozen=True)
class Kind:
    name: str
    # (id, how a line names it) of each resource of this kind that ``filters`` find
    find: Callable[[object, list[dict]], list[tuple[str, str]]]


def _instances(ec2, filters: list[dict], states: list[str]) -> list[tuple[str, str]]:
    pages = ec2.get_paginator("describe_instances").paginate(
        Filters=[*filters, {"Name": "instance-state-name", "Values": states}])
    return [(i["InstanceId"], i["InstanceId"]) for page in pages
            for r in page["Reservations"] for i in r["Instances"]]


def _fleets(ec2, filters: list[dict]) -> list[tuple[str, str]]:
    # describe_fleets takes no tag filters: match the tags here.
    return [(f["FleetId"], f["FleetId"]) for page in ec2.get_paginator("describe_fleets").paginate()
            for f in page["Fleets"] if tagging.matches(f.get("Tags"), filters)
            and not f["FleetState"].startswith("deleted")]


FLEETS = Kind("fleet", _fleets)
INSTANCES = Kind("instance", lambda ec2, filters: _instances(ec2, filters, LIVE))
LEFT_INSTANCES = Kind("instance", lambda ec2, filters: _instances(ec2, filters, LEFT))
TEMPLATES = Kind("launch template", lambda ec2, filters: [
    (t["LaunchTemplateId"], f"{t['LaunchTemplateId']} ({t['LaunchTemplateName']})")
    for t in ec2.describe_launch_templates(Filters=filters)["LaunchTemplates"]])
PLACEMENT_GROUPS = Kind("placement group", lambda ec2, filters: [
    (g["GroupName"], g["GroupName"])
    for g in ec2.describe_placement_groups(Filters=filters)["PlacementGroups"]])
SECURITY_GROUPS = Kind("security group", lambda ec2, filters: [
    (g["GroupId"], f"{g['GroupId']} ({g['GroupName']})")
    for g in ec2.describe_security_groups(Filters=filters)["SecurityGroups"]])
KEY_PAIRS = Kind("key pair", lambda ec2, filters: [
    (k["KeyName"], k["KeyName"]) for k in ec2.describe_key_pairs(Filters=filters)["KeyPairs"]])


def _find(teardown: Teardown, kind: Kind, ec2, filters: list[dict], again: bool = False
          ) -> list[tuple[str, str]] | None:
    """What ``kind.find`` finds; None if the look-up failed (noted)."""
    found: list[tuple[str, str]] = []
    if teardown.attempt(f"describe {kind.name}s{' again' if again else ''}",
                        lambda: found.extend(kind.find(ec2, filters))):
        return found
    return None


def delete_all(ec2, filters: list[dict], placement_groups: bool, poll_s: float) -> Teardown:
    """Delete what ``filters`` find, in dependency order, instances first: they cost
    money. Every resource is tried even when calls fail (each call is retried by botocore
    first); then every kind is looked up again, and what is still there is ``left``."""
    teardown = Teardown(CALL_ERRORS)
    fleets = [fleet for fleet, _ in _find(teardown, FLEETS, ec2, filters) or []]
    instances = _find(teardown, INSTANCES, ec2, filters)
    for chunk in range(0, len(fleets), 25):  # DeleteFleets takes 25 instant fleets at a time
        _delete_fleets(ec2, fleets[chunk:chunk + 25], teardown)
    ids = [i for i, _ in instances or []]
    terminated = not ids or teardown.attempt(f"terminate instances {', '.join(ids)}",
                                             partial(_terminate, ec2, ids, poll_s))
    if ids and terminated:
        teardown.done += [f"terminated instance {i}" for i in ids]
    # The instances' network interfaces hold the security group until AWS releases them,
    # a little after the instances went: worth waiting for only if they are known to.
    freed = instances is not None and terminated

    deletions = [
        (TEMPLATES, lambda t: ec2.delete_launch_template(LaunchTemplateId=t)),
        (PLACEMENT_GROUPS, lambda g: ec2.delete_placement_group(GroupName=g)),
        (SECURITY_GROUPS, lambda g: (_delete_security_group(ec2, g, poll_s) if freed
                                     else ec2.delete_security_group(GroupId=g))),
        (KEY_PAIRS, lambda k: ec2.delete_key_pair(KeyName=k)),
    ]
    kinds = [FLEETS, LEFT_INSTANCES]
    for kind, delete in deletions:
        if kind is PLACEMENT_GROUPS and not placement_groups:
            continue
        kinds.append(kind)
        for resource, label in _find(teardown, kind, ec2, filters) or []:
            if teardown.attempt(f"delete {kind.name} {label}", partial(delete, resource)):
                teardown.done.append(f"deleted {kind.name} {label}")

    for kind in kinds:
        found = _find(teardown, kind, ec2, filters, again=True)
        teardown.left += ([f"{kind.name}s: unknown (their look-up failed)"] if found is None
                          else [f"{kind.name} {label}" for _, label in found])
    return teardown


def _delete_fleets(ec2, fleets: list[str], teardown: Teardown) -> None:
    """With their instances. AWS answers a fleet it could not delete in the reply."""
    reply = {}

    def delete() -> None:
        reply.update(ec2.delete_fleets(FleetIds=fleets, TerminateInstances=True))

    if not teardown.attempt(f"delete fleets {', '.join(fleets)}", delete):
        return
    for f in reply.get("UnsuccessfulFleetDeletions", []):
        error = f.get("Error", {})
        teardown.failed.append(f"delete fleet {f.get('FleetId')}: {error.get('Code')}: "
                               f"{error.get('Message')}")
    teardown.done += [f"deleted fleet {f['FleetId']}"
                      for f in reply.get("SuccessfulFleetDeletions", [])]


def _terminate(ec2, ids: list[str], poll_s: float) -> None:
    """Those of no fleet too; until they are terminated."""
    ec2.terminate_instances(InstanceIds=ids)
    ec2.get_waiter("instance_terminated").wait(
        InstanceIds=ids, WaiterConfig={"Delay": poll_s, "MaxAttempts": 120})


def _delete_security_group(ec2, group_id: str, poll_s: float, timeout_s: float = 300) -> None:
    def delete() -> bool | None:
        try:
            ec2.delete_security_group(GroupId=group_id)
            return True
        except ClientError as e:
            # Terminated instances release their network interfaces a little later.
            if e.response["Error"]["Code"] != "DependencyViolation":
                raise
            return None

    poll(delete, timeout_s=timeout_s, interval_s=poll_s,
         what=f"security group {group_id}: deleted once the network interfaces of its "
              "instances are released")
