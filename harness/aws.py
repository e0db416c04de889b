"""AWS for the tests, offline: a moto server on 127.0.0.1 and a Stubber for moto's gaps.

moto (5.2) implements what the launcher calls on EC2, STS and SSM, except placement
groups, and it cannot be told to run out of capacity or to fail a call. For those, and
only those, MotoGaps answers from botocore's Stubber queue; every other call of the same
client goes on to the moto server, so a test sees real resources come and go.
"""

from __future__ import annotations

import json
import logging
import os
import shlex
import sys
import urllib.request
from pathlib import Path

import boto3
from botocore.stub import Stubber
from moto.server import ThreadedMotoServer

from spotring.launch.aws.tags import run_filter

REGION = "us-east-1"
# A machine image moto knows in every region (its AMI list comes from AWS's).
AMI = "ami-12c6146b"
# What a launcher test needs on top of the defaults: moto, no internet, no placement
# groups (moto has none; the Stubber tests cover them), a short poll.
MOTO_CLUSTER = [f"cluster.region={REGION}", f"cluster.ami={AMI}", "cluster.ssh_cidr=192.0.2.10/32",
                "cluster.placement_group=false", "cluster.poll_s=0.05", "cluster.ssh_timeout_s=5"]


def start_moto() -> ThreadedMotoServer:
    logging.getLogger("werkzeug").setLevel(logging.WARNING)  # a line per request otherwise
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    return server


def reset(endpoint: str) -> None:
    """An empty moto account again."""
    urllib.request.urlopen(urllib.request.Request(f"{endpoint}/moto-api/reset", method="POST"))


def aws_env(endpoint: str, home: Path) -> dict[str, str]:
    return {"AWS_ENDPOINT_URL": endpoint, "AWS_ACCESS_KEY_ID": "testing",
            "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": REGION,
            "AWS_CONFIG_FILE": str(home / "no-aws-config"),
            "AWS_SHARED_CREDENTIALS_FILE": str(home / "no-aws-credentials"),
            "AWS_EC2_METADATA_DISABLED": "true"}


def ec2():
    return boto3.client("ec2", region_name=REGION)


def tagged(run_id: str) -> dict[str, list[str]]:
    """What moto still has with the run's tag, per kind (terminated instances excluded)."""
    client, filters = ec2(), run_filter(run_id)
    live = [*filters, {"Name": "instance-state-name",
                       "Values": ["pending", "running", "stopping", "stopped"]}]
    fleets = [f["FleetId"] for f in client.describe_fleets()["Fleets"]
              if {"Key": "spotring:run-id", "Value": run_id} in f.get("Tags", [])
              and not f["FleetState"].startswith("deleted")]
    found = {
        "instances": [i["InstanceId"] for r in client.describe_instances(Filters=live)
                      ["Reservations"] for i in r["Instances"]],
        "fleets": fleets,
        "launch templates": [t["LaunchTemplateId"] for t in
                             client.describe_launch_templates(Filters=filters)["LaunchTemplates"]],
        "security groups": [g["GroupId"] for g in
                            client.describe_security_groups(Filters=filters)["SecurityGroups"]],
        "key pairs": [k["KeyName"] for k in client.describe_key_pairs(Filters=filters)["KeyPairs"]],
    }
    return {kind: ids for kind, ids in found.items() if ids}


class MotoGaps(Stubber):
    """botocore's Stubber for the queued operations only; the rest reach moto.

    Queue a response (add_response, add_client_error) for an operation moto lacks or
    cannot fail; calls of other operations pass through untouched. Queued operations
    must come in the queued order, as with the Stubber."""

    def _next_is(self, model) -> bool:
        return any(r["operation_name"] == model.name for r in self._queue)

    def _assert_expected_params(self, model, params, context, **kwargs):
        if self._next_is(model):
            super()._assert_expected_params(model, params, context, **kwargs)

    def _get_response_handler(self, model, params, context, **kwargs):
        if self._next_is(model):
            return super()._get_response_handler(model, params, context, **kwargs)
        return None


STUB_FLEET = "fleet-00000000-0000-0000-0000-000000000000"


def no_capacity(gaps: MotoGaps, code: str, instance_ids: list[str] = ()) -> None:
    """The next create_fleet finds no room (moto always has): AWS's answer is a fleet with
    the reason in Errors and fewer instances than asked (``instance_ids``, real moto
    instances, or none). Its deletion is stubbed too: moto never made that fleet."""
    instances = [{"InstanceIds": list(instance_ids), "InstanceType": "g5.xlarge",
                  "Lifecycle": "spot"}] if instance_ids else []
    gaps.add_response("create_fleet", {
        "FleetId": STUB_FLEET, "Instances": instances,
        "Errors": [{"ErrorCode": code, "ErrorMessage": f"stubbed {code}", "Lifecycle": "spot"}]})
    gaps.add_response("delete_fleets", {"SuccessfulFleetDeletions": [{
        "FleetId": STUB_FLEET, "CurrentFleetState": "deleted_terminating",
        "PreviousFleetState": "active"}]}, {"FleetIds": [STUB_FLEET], "TerminateInstances": True})


_HANG = ("import sys, time; time.sleep(float(sys.argv[1])); "
         "print('stand-in ssh: no machine behind this moto instance', file=sys.stderr); "
         "sys.exit(255)")


def stand_in_ssh(directory: Path) -> Path:
    """ssh-keyscan and ssh for moto's instances, which are records, not machines: nothing
    listens on their addresses. ssh-keyscan answers for any address with a fixed key;
    ssh does nothing but the login check `up` makes (`true`). Returns the directory to
    put first on PATH. The real ssh path is the local cluster's test."""
    directory.mkdir(parents=True, exist_ok=True)
    key = "AAAAC3NzaC1lZDI1NTE5AAAAIHsY2b0Wq0y0rW8Xb8b7mRkN3X6K4VYQ0k3QvN1GZm3N"
    scripts = {
        "ssh-keyscan": f'for host; do :; done\necho "$host ssh-ed25519 {key}"\n',
        # Anything else fails, after $STAND_IN_SSH_DELAY seconds (a job that hangs); it
        # adds its command to the file $STAND_IN_SSH_CALLED first, where given.
        "ssh": 'for command; do :; done\n[ "$command" = true ] && exit 0\n'
               '[ -z "$STAND_IN_SSH_CALLED" ] || echo "$command" >> "$STAND_IN_SSH_CALLED"\n'
               # One process, which a kill ends whole: a sleep would outlive a killed sh,
               # holding its pipes open.
               f'exec {shlex.quote(sys.executable)} -c {shlex.quote(_HANG)} '
               '"${STAND_IN_SSH_DELAY:-0}"\n',
    }
    for name, body in scripts.items():
        (directory / name).write_text(f"#!/bin/sh\n# a stand-in: see harness/aws.py\n{body}")
        (directory / name).chmod(0o755)
    return directory


def state(run_dir: Path) -> dict:
    return json.loads((run_dir / "state.json").read_text())


def without_aws(home: Path) -> dict[str, str]:
    """This environment with no AWS credentials, endpoint or config anywhere."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    return env | {"HOME": str(home), "AWS_CONFIG_FILE": str(home / "none"),
                  "AWS_SHARED_CREDENTIALS_FILE": str(home / "none"),
                  "AWS_EC2_METADATA_DISABLED": "true"}
