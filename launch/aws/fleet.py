"""Getting N instances at once: create_fleet attempts, in order, all or nothing.

Each attempt is one instance type in one zone (its subnet), as an `instant` fleet with
MinTargetCapacity = N and SingleAvailabilityZone: AWS starts N instances or none. The
order: every zone for the first type, then every zone for the next; spot first
(price-capacity-optimized: capacity that is least likely to be reclaimed, among the
cheaper pools), then the same on-demand if cluster.on_demand_fallback. A capacity error
moves on to the next attempt; anything else is a real error and stops.
"""

from __future__ import annotations

from dataclasses import dataclass

from botocore.exceptions import ClientError

from spotring.launch.aws.tags import Tags

# What AWS answers when it has no room for the request right now. "Unsupported": the
# type is not offered in that zone, which another zone may still be.
CAPACITY_ERRORS = frozenset({
    "InsufficientInstanceCapacity", "UnfulfillableCapacity", "MaxSpotInstanceCountExceeded",
    "SpotMaxPriceTooLow", "Unsupported",
})


@dataclass(frozen=True)
class Attempt:
    lifecycle: str  # spot | on-demand
    instance_type: str
    zone: str
    subnet: str

    def __str__(self) -> str:
        return f"{self.instance_type} {self.lifecycle} in {self.zone}"


def attempts(types: list[str], subnets: dict[str, str], on_demand: bool) -> list[Attempt]:
    lifecycles = ["spot", "on-demand"] if on_demand else ["spot"]
    return [Attempt(lc, t, zone, subnet) for lc in lifecycles for t in types
            for zone, subnet in subnets.items()]


@dataclass(frozen=True)
class Launched:
    fleet_id: str | None
    instance_ids: list[str]
    errors: list[str]  # "Code: message", as AWS said them


def launch(ec2, attempt: Attempt, count: int, template_id: str, tags: Tags,
           max_price: float | None) -> Launched:
    override = {"InstanceType": attempt.instance_type, "SubnetId": attempt.subnet}
    if max_price is not None and attempt.lifecycle == "spot":
        override["MaxPrice"] = f"{max_price:.4f}"  # else up to the on-demand price
    one_zone = {"SingleAvailabilityZone": True, "MinTargetCapacity": count}
    request = {
        "Type": "instant",
        "LaunchTemplateConfigs": [{"LaunchTemplateSpecification": {
            "LaunchTemplateId": template_id, "Version": "$Latest"}, "Overrides": [override]}],
        "TargetCapacitySpecification": {"TotalTargetCapacity": count,
                                        "DefaultTargetCapacityType": attempt.lifecycle},
        "TagSpecifications": tags.spec("fleet", "instance"),
    }
    if attempt.lifecycle == "spot":
        request["SpotOptions"] = {"AllocationStrategy": "price-capacity-optimized",
                                  "InstanceInterruptionBehavior": "terminate", **one_zone}
    else:
        request["OnDemandOptions"] = {"AllocationStrategy": "lowest-price", **one_zone}
    try:
        reply = ec2.create_fleet(**request)
    except ClientError as e:
        if e.response["Error"]["Code"] not in CAPACITY_ERRORS:
            raise
        error = e.response["Error"]
        return Launched(None, [], [f"{error['Code']}: {error['Message']}"])
    errors = reply.get("Errors", [])
    real = [e for e in errors if e.get("ErrorCode") not in CAPACITY_ERRORS]
    ids = [i for group in reply.get("Instances", []) for i in group.get("InstanceIds", [])]
    launched = Launched(reply.get("FleetId"), ids,
                        [f"{e.get('ErrorCode')}: {e.get('ErrorMessage')}" for e in errors])
    if real:
        undo(ec2, launched)
        raise FleetError(f"create_fleet for {attempt}: " + "; ".join(launched.errors))
    return launched


def undo(ec2, launched: Launched) -> None:
    """All or nothing: the instances of a short or broken attempt go at once."""
    if launched.fleet_id:
        ec2.delete_fleets(FleetIds=[launched.fleet_id], TerminateInstances=True)
    if launched.instance_ids:
        ec2.terminate_instances(InstanceIds=launched.instance_ids)


class FleetError(RuntimeError):
    """AWS refused the fleet for a reason other than capacity (the message says which)."""
