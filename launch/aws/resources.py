"""The resources around a run's instances, created tagged and deleted by tag.

    created in this order         deleted in this order (what depends on what goes first)
    1. key pair (public key only) 1. fleets, with their instances; wait until terminated
    2. security group             2. launch templates
    3. cluster placement group    3. placement groups (empty once instances are gone)
    4. launch template            4. security groups (free once the instances' network
                                     interfaces are released: retried until then)
                                  5. key pairs
"""

from __future__ import annotations

import base64

from botocore.exceptions import ClientError

from launch.aws import tags as tagging
from launch.aws.tags import Tags
from trainer.polling import poll


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


def delete_all(ec2, filters: list[dict], placement_groups: bool, poll_s: float) -> list[str]:
    """Delete what ``filters`` find, in dependency order; one line per deletion."""
    instances = [i["InstanceId"] for page in ec2.get_paginator("describe_instances").paginate(
        Filters=[*filters, {"Name": "instance-state-name", "Values": LIVE}])
        for r in page["Reservations"] for i in r["Instances"]]
    # describe_fleets takes no tag filters: match the tags here.
    fleets = [f["FleetId"] for page in ec2.get_paginator("describe_fleets").paginate()
              for f in page["Fleets"] if tagging.matches(f.get("Tags"), filters)
              and not f["FleetState"].startswith("deleted")]
    for chunk in range(0, len(fleets), 25):  # DeleteFleets takes 25 instant fleets at a time
        ec2.delete_fleets(FleetIds=fleets[chunk:chunk + 25], TerminateInstances=True)
    done = [f"deleted fleet {f}" for f in fleets]
    if instances:
        ec2.terminate_instances(InstanceIds=instances)  # those of no fleet, too
        ec2.get_waiter("instance_terminated").wait(
            InstanceIds=instances, WaiterConfig={"Delay": poll_s, "MaxAttempts": 120})
        done += [f"terminated instance {i}" for i in instances]

    for t in ec2.describe_launch_templates(Filters=filters)["LaunchTemplates"]:
        ec2.delete_launch_template(LaunchTemplateId=t["LaunchTemplateId"])
        done.append(f"deleted launch template {t['LaunchTemplateName']}")
    if placement_groups:
        for g in ec2.describe_placement_groups(Filters=filters)["PlacementGroups"]:
            ec2.delete_placement_group(GroupName=g["GroupName"])
            done.append(f"deleted placement group {g['GroupName']}")
    for g in ec2.describe_security_groups(Filters=filters)["SecurityGroups"]:
        _delete_security_group(ec2, g["GroupId"], poll_s)
        done.append(f"deleted security group {g['GroupId']} ({g['GroupName']})")
    for k in ec2.describe_key_pairs(Filters=filters)["KeyPairs"]:
        ec2.delete_key_pair(KeyName=k["KeyName"])
        done.append(f"deleted key pair {k['KeyName']}")
    return done


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
