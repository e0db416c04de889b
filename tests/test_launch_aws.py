"""cluster=aws_spot against a moto server: what `up` creates, that `down` (and every
failure) leaves nothing with the run's tag, capacity fallback, bad input, cost.

The command-line tests run the launcher's main (`spotring up|status|cost|down|launch`) in
this process (harness/commands.py), against moto through AWS_ENDPOINT_URL; as users type
it, in a process of their own, run `make launch DRY_RUN=1`, a launch stopped by Ctrl-C and
a command that exits 2. The provider tests call the provider in this process, where
MotoGaps (botocore's Stubber) answers what moto lacks: placement groups, running out of
capacity, failing a call (harness/aws.py)."""

from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import sys

import pytest
import urllib3
from botocore.awsrequest import AWSResponse
from botocore.exceptions import ClientError
from omegaconf import OmegaConf

from harness.aws import (
    AMI,
    MOTO_CLUSTER,
    MotoGaps,
    aws_env,
    ec2,
    no_capacity,
    reset,
    stand_in_ssh,
    start_moto,
    state,
    tagged,
    without_aws,
)
from harness.commands import Done, call
from harness.launcher import launcher
from spotring.exits import EXIT_CONFIG
from spotring.launch import config
from spotring.launch.__main__ import main
from spotring.launch.aws.provider import AwsSpot
from spotring.launch.cost import usd
from spotring.launch.provider import NoCapacity
from spotring.launch.rundir import RunDir
from spotring.launch.ssh import new_key
from spotring.polling import poll
from tests.conftest import REPO

OWNER = "arn:aws:sts::123456789012:user/moto"  # who moto says the caller is


@pytest.fixture(scope="module")
def moto_server():
    server = start_moto()
    host, port = server.get_host_and_port()
    yield f"http://{host}:{port}"
    server.stop()


@pytest.fixture
def aws(moto_server, monkeypatch, tmp_path):
    """An empty moto account, and this process's (and its children's) AWS settings aimed
    at it: boto3 honours AWS_ENDPOINT_URL; fake credentials; nothing from ~/.aws."""
    reset(moto_server)
    env = aws_env(moto_server, tmp_path)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    return env


def moto_env(aws: dict, tmp_path, **extra) -> dict[str, str]:
    """This environment aimed at moto, with the stand-in ssh first on PATH; an extra
    variable set to None is removed."""
    env = {**os.environ, **aws, **extra,
           "PATH": f"{stand_in_ssh(tmp_path / 'bin')}:{os.environ['PATH']}"}
    return {k: v for k, v in env.items() if v is not None}


@pytest.fixture
def cli(aws, tmp_path, monkeypatch):
    """`spotring COMMAND ...` against moto, its main in this process (harness/commands.py),
    with the stand-in ssh first on PATH, ``extra_env`` set for the call, and its runs
    under tmp_path/runs."""
    monkeypatch.setenv("PATH", f"{stand_in_ssh(tmp_path / 'bin')}:{os.environ['PATH']}")

    def _cli(command: str, *overrides: str, expect: int | None = 0, **extra_env: str) -> Done:
        with pytest.MonkeyPatch.context() as env:
            for key, value in extra_env.items():
                env.setenv(key, value)
            # The test's overrides last: of two values for one key, Hydra takes the last.
            done = call(main, command, f"runs_dir={tmp_path / 'runs'}", *MOTO_CLUSTER,
                        *overrides)
        if expect is not None:
            assert done.code == expect, done.out + done.err
        return done
    return _cli


def only_run(tmp_path) -> RunDir:
    (run,) = [RunDir(p) for p in (tmp_path / "runs").iterdir()]
    return run


# --------------------------------------------------------------------- the command line


@pytest.mark.slow(cores=1)
def test_up_status_cost_down(cli, tmp_path):
    up = cli("up", "nodes=2", "cluster.instance_types=[g5.12xlarge]",
             "cluster.instance_profile=spotring-nodes")
    run = only_run(tmp_path)
    assert up.out.splitlines()[0] == f"spotring: run {run.id} in {run.path}"

    # The nodes, and the files `up` writes from them (g5.12xlarge: 4 GPUs each).
    nodes = state(run.path)["nodes"]
    assert len(nodes) == 2 and {n["type"] for n in nodes} == {"g5.12xlarge"}
    addresses = [n["private_address"] for n in nodes]
    assert run.hosts.read_text() == "".join(f"{a} slots=4\n" for a in addresses)
    assert run.hosts_mpich.read_text() == "".join(f"{a}:4\n" for a in addresses)
    assert [line.split()[0] for line in run.known_hosts.read_text().splitlines()] == addresses
    assert run.key.stat().st_mode & 0o777 == 0o600
    assert up.out.rstrip().endswith("exec horovodrun --gloo -np 8 --hostfile hosts "
                                       "--start-timeout 120 spotring train'")

    # What moto holds: every kind tagged, the fleet as asked, SSH only from the caller.
    client = ec2()
    assert set(tagged(run.id)) == {"instances", "fleets", "launch templates",
                                   "security groups", "key pairs"}
    (fleet,) = [f for f in client.describe_fleets()["Fleets"] if f["FleetId"]
                in tagged(run.id)["fleets"]]
    spot = fleet["SpotOptions"]
    assert fleet["Type"] == "instant" and spot["AllocationStrategy"] == "price-capacity-optimized"
    assert spot["SingleAvailabilityZone"] is True and spot["MinTargetCapacity"] == 2
    assert fleet["TargetCapacitySpecification"] == {"TotalTargetCapacity": 2,
                                                    "DefaultTargetCapacityType": "spot"}
    instance = client.describe_instances(InstanceIds=[nodes[0]["id"]])["Reservations"][0][
        "Instances"][0]
    tags = {t["Key"]: t["Value"] for t in instance["Tags"]}
    assert tags["project"] == "spotring" and tags["spotring:run-id"] == run.id
    assert tags["owner"] == OWNER and instance["InstanceLifecycle"] == "spot"
    (group,) = client.describe_security_groups(GroupIds=tagged(run.id)["security groups"])[
        "SecurityGroups"]
    rules = {(r["IpProtocol"], r.get("FromPort")): r for r in group["IpPermissions"]}
    assert [p["GroupId"] for p in rules[("-1", None)]["UserIdGroupPairs"]] == [group["GroupId"]]
    assert [r["CidrIp"] for r in rules[("tcp", 22)]["IpRanges"]] == ["192.0.2.10/32"]
    assert not any(r["CidrIp"] == "0.0.0.0/0" for p in group["IpPermissions"]
                   for r in p["IpRanges"])
    (template,) = client.describe_launch_template_versions(
        LaunchTemplateId=tagged(run.id)["launch templates"][0])["LaunchTemplateVersions"]
    data = template["LaunchTemplateData"]
    assert data["MetadataOptions"]["HttpTokens"] == "required" and data["ImageId"] == AMI
    assert data["IamInstanceProfile"] == {"Name": "spotring-nodes"}  # S3 for checkpoints
    assert {s["ResourceType"] for s in data["TagSpecifications"]} >= {"instance", "volume"}
    volumes = client.describe_volumes(Filters=[{"Name": "tag:spotring:run-id",
                                                "Values": [run.id]}])["Volumes"]
    assert len(volumes) == 2

    status = cli("status")
    assert status.out.count("running") == 2 and all(n["id"] in status.out for n in nodes)

    cost = cli("cost")
    assert "g5.12xlarge" in cost.out and f"cost: run {run.id}: 2 nodes" in cost.out
    other = cli("cost", "nodes=4", "cluster.instance_types=[g4dn.xlarge]")  # another cluster
    assert "cost: 4 nodes" in other.out and "g4dn.xlarge" in other.out
    now, _, bill = other.out.partition(f"cost: run {run.id}: 2 nodes")
    assert "g5.12xlarge" not in now and bill

    down = cli("down")
    assert f"deleted fleet {fleet['FleetId']}" in down.out
    assert all(f"terminated instance {n['id']}" in down.out for n in nodes)
    for kind in ("launch template", "security group", "key pair"):
        assert f"deleted {kind} " in down.out
    assert tagged(run.id) == {}
    again = cli("down")
    assert f"nothing of run {run.id} was left to delete" in again.out
    assert "destroyed_at" in state(run.path)


def test_cost_of_a_run(cli, tmp_path):
    cli("up", "nodes=2", "cluster.instance_types=[c5.large]")  # no GPUs: 1 slot per node
    run = only_run(tmp_path)
    assert run.hosts.read_text().count("slots=1") == 2
    cli("down")
    run.job.mkdir()
    (run.job / "summary.json").write_text(json.dumps(
        {"train_seconds": 1800.0, "epochs": 3.0, "steps": 300, "steps_this_run": 300,
         "world_size": 2}))
    nodes, destroyed = state(run.path)["nodes"], state(run.path)["destroyed_at"]
    price = nodes[0]["price"]  # moto's spot price, the same everywhere
    assert price > 0 and all(n["price"] == price for n in nodes)
    # EC2 bills per second with a minimum of 60 s, and each node's gp3 volume likewise.
    node_hours = sum(max(60, destroyed - n["launched_at"]) for n in nodes) / 3600
    cluster = OmegaConf.load(run.config).cluster
    volumes = node_hours * cluster.volume_gb * cluster.volume_usd_per_gb_month / 730
    total = node_hours * price + volumes
    training = 0.5 * 2 * price  # half an hour on two nodes

    out = cli("cost").out
    assert f"2 nodes, {node_hours:.4f} node-hours, {usd(total)}" in out
    assert f"training: 1800.0 s for 3.000 epochs on 2 workers: ${training:.3g}, " \
           f"${training / 3:.3g}/epoch; the whole run (start-up, restarts, idle): " \
           f"{usd(total / 3)}/epoch over 3.000 epochs" in out
    ledger = json.loads(run.ledger.read_text())
    assert ledger["totals"]["usd"] == pytest.approx(total, rel=1e-9)


def test_launch_takes_everything_down_after_an_error(cli, tmp_path):
    # moto's instances cannot be reached, so `run` fails at its first ssh.
    done = cli("launch", "nodes=1", "cluster.instance_types=[c5.large]", expect=1)
    run = only_run(tmp_path)
    assert "launch: failed: " in done.err
    assert "no machine behind this moto instance" in done.err
    assert f"down: done; nothing of run {run.id} is left" in done.out
    assert tagged(run.id) == {}


@pytest.mark.slow(cores=1)
def test_launch_takes_everything_down_on_ctrl_c(aws, tmp_path):
    # The job "hangs" until Ctrl-C, in the stand-in ssh, which says when it is there.
    called = tmp_path / "ssh-called"
    env = moto_env(aws, tmp_path, STAND_IN_SSH_DELAY="60", STAND_IN_SSH_CALLED=str(called))
    # A session of its own, as a shell gives a job: Ctrl-C goes to its process group.
    # And SIGINT's default action, as an interactive shell gives a foreground job, even
    # when pytest itself runs in the background (`&` ignores SIGINT, for its children too).
    proc = subprocess.Popen([sys.executable, "-m", "spotring.launch", "launch", "nodes=2",
                             f"runs_dir={tmp_path / 'runs'}", *MOTO_CLUSTER], cwd=REPO, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    # up is done, and run is copying the project to the nodes.
    poll(lambda: called.exists() or proc.poll(), timeout_s=120, interval_s=0.05,
         what="the stand-in ssh to be called")
    assert proc.poll() is None, proc.communicate()
    os.killpg(proc.pid, signal.SIGINT)
    out, err = proc.communicate(timeout=60)
    run = only_run(tmp_path)
    assert proc.returncode == 130 and "launch: interrupted" in err
    assert f"down: done; nothing of run {run.id} is left" in out
    assert tagged(run.id) == {}


@pytest.mark.slow(cores=1)
def test_dry_run_calls_no_api(tmp_path):
    # No credentials and no endpoint: any AWS call would fail.
    home, runs = tmp_path / "home", tmp_path / "runs"
    home.mkdir()
    proc = subprocess.run(["make", "--no-print-directory", "launch", "NODES=8", "DRY_RUN=1",
                           f"LAUNCH_ARGS=runs_dir={runs}", "ARGS=train.epochs=30"],
                          cwd=REPO, env=without_aws(home), capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = proc.stdout
    assert "dry run of `launch`: nothing is created, no cloud API is called" in out
    assert "create_fleet type=instant, 8 nodes or none (MinTargetCapacity=8" in out
    assert "IMDSv2 required" in out and "tcp/22 from this machine's public address" in out
    assert ("horovodrun --gloo -np 8 --hostfile hosts --start-timeout 120 spotring "
            "train train.epochs=30") in out
    assert "down      delete everything" in out
    assert not runs.exists()  # no run dir either


# ----------------------------------------------------------------------------- bad input


def _default_subnet(zone: str) -> str:
    subnets = ec2().describe_subnets(Filters=[{"Name": "default-for-az", "Values": ["true"]},
                                              {"Name": "availability-zone", "Values": [zone]}])
    return subnets["Subnets"][0]["SubnetId"]


# What needs no AWS to be found bad is in test_launch_config.py.
@pytest.mark.parametrize("overrides, message", [
    (["cluster.subnet=subnet-0123456789abcdef0"],
     "cluster.subnet=subnet-0123456789abcdef0: not found in us-east-1"),
    (["cluster.subnet=<us-east-1a>", "cluster.zones=[us-east-1b]"],
     "is in us-east-1a, not in cluster.zones=['us-east-1b']"),
    (["cluster.ami=ami-00000000000000000"], "cluster.ami=ami-00000000000000000: no such image"),
])
def test_bad_input_fails_before_any_resource_exists(aws, tmp_path, overrides, message):
    overrides = [o.replace("<us-east-1a>", _default_subnet("us-east-1a")) for o in overrides]
    done = call(main, "up", f"runs_dir={tmp_path / 'runs'}", *MOTO_CLUSTER, "nodes=2",
                *overrides)
    assert done.code == EXIT_CONFIG, done
    assert message in done.err and "Nothing was created" in done.err, done.err
    assert_nothing_in_moto(tmp_path)


@pytest.mark.slow(cores=1)
def test_no_credentials_fail_before_any_resource_exists(aws, tmp_path):
    """The command as users type it, in a process of its own."""
    proc = launcher("up", f"runs_dir={tmp_path / 'runs'}", *MOTO_CLUSTER, "nodes=2",
                    env=moto_env(aws, tmp_path, AWS_ACCESS_KEY_ID=None,
                                 AWS_SECRET_ACCESS_KEY=None))
    assert proc.returncode == EXIT_CONFIG, proc.stdout + proc.stderr
    assert "no AWS credentials: set AWS_PROFILE" in proc.stderr
    assert_nothing_in_moto(tmp_path)


def assert_nothing_in_moto(tmp_path) -> None:
    client = ec2()
    assert client.describe_key_pairs()["KeyPairs"] == []
    assert client.describe_launch_templates()["LaunchTemplates"] == []
    assert client.describe_instances()["Reservations"] == []
    assert {g["GroupName"] for g in client.describe_security_groups()["SecurityGroups"]} == {
        "default"}
    assert not (tmp_path / "runs").exists()


# ------------------------------------------------- the provider, with moto's gaps stubbed


def provider(tmp_path, *overrides: str) -> AwsSpot:
    cfg = config.compose(["nodes=2", f"runs_dir={tmp_path}", *MOTO_CLUSTER, *overrides])
    config.validate(cfg)
    run = RunDir.planned(tmp_path)
    run.create(cfg)
    new_key(run.key, "test")
    return AwsSpot(cfg.cluster, run, cfg.project)


def attempts_logged(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if " spot in " in r.getMessage()
            or " on-demand in " in r.getMessage()]


def test_a_placement_group_where_the_type_supports_one(aws, tmp_path):
    aws_spot = provider(tmp_path, "cluster.placement_group=true")
    name, run_id = aws_spot.resource_name, aws_spot.run.id
    tags = [{"Key": "project", "Value": "spotring"}, {"Key": "spotring:run-id", "Value": run_id},
            {"Key": "owner", "Value": OWNER}, {"Key": "Name", "Value": name}]
    gaps = MotoGaps(aws_spot.ec2)  # moto has no placement groups
    gaps.add_response("create_placement_group", {}, {
        "GroupName": name, "Strategy": "cluster",
        "TagSpecifications": [{"ResourceType": "placement-group", "Tags": tags}]})
    with gaps:
        nodes = aws_spot.create(2)
    (template,) = ec2().describe_launch_template_versions(
        LaunchTemplateName=name)["LaunchTemplateVersions"]
    assert template["LaunchTemplateData"]["Placement"]["GroupName"] == name
    assert len(nodes) == 2

    gaps.add_response("describe_placement_groups", {"PlacementGroups": [
        {"GroupName": name, "Strategy": "cluster", "State": "available", "Tags": tags}]},
        {"Filters": [{"Name": "tag:spotring:run-id", "Values": [run_id]}]})
    gaps.add_response("delete_placement_group", {}, {"GroupName": name})
    gaps.add_response("describe_placement_groups", {"PlacementGroups": []},  # the look again
                      {"Filters": [{"Name": "tag:spotring:run-id", "Values": [run_id]}]})
    with gaps:
        done = aws_spot.destroy()
    gaps.assert_no_pending_responses()
    assert f"deleted placement group {name}" in done
    # After the instances, before the security group: it is in use until they are gone.
    order = [line.split()[1] for line in done]
    assert order.index("placement") > order.index("instance")
    assert order.index("placement") < order.index("security")
    assert tagged(run_id) == {}


def test_capacity_errors_try_each_zone_then_each_type_then_on_demand(aws, tmp_path, caplog):
    caplog.set_level("INFO", logger="launch")
    aws_spot = provider(tmp_path, "cluster.instance_types=[g5.xlarge,g4dn.xlarge]",
                        "cluster.zones=[us-east-1b,us-east-1c]",
                        "cluster.on_demand_fallback=true")
    gaps = MotoGaps(aws_spot.ec2)  # moto always has capacity: these four find none
    no_capacity(gaps, "InsufficientInstanceCapacity")
    no_capacity(gaps, "UnfulfillableCapacity")
    no_capacity(gaps, "SpotMaxPriceTooLow")
    gaps.add_client_error("create_fleet", "MaxSpotInstanceCountExceeded", "stubbed")
    with gaps:
        nodes = aws_spot.create(2)
    gaps.assert_no_pending_responses()
    assert [(n.type, n.zone, n.lifecycle) for n in nodes] == [
        ("g5.xlarge", "us-east-1b", "on-demand")] * 2
    assert attempts_logged(caplog) == [
        "up: g5.xlarge spot in us-east-1b: 0 of 2 instances (InsufficientInstanceCapacity: "
        "stubbed InsufficientInstanceCapacity)",
        "up: g5.xlarge spot in us-east-1c: 0 of 2 instances (UnfulfillableCapacity: "
        "stubbed UnfulfillableCapacity)",
        "up: g4dn.xlarge spot in us-east-1b: 0 of 2 instances (SpotMaxPriceTooLow: "
        "stubbed SpotMaxPriceTooLow)",
        "up: g4dn.xlarge spot in us-east-1c: 0 of 2 instances (MaxSpotInstanceCountExceeded: "
        "stubbed)",
        "up: g5.xlarge on-demand in us-east-1b: 2 instances, waiting for them to be ready",
    ]
    aws_spot.destroy()
    assert tagged(aws_spot.run.id) == {}


def test_no_capacity_anywhere_leaves_nothing(aws, tmp_path):
    aws_spot = provider(tmp_path, "cluster.zones=[us-east-1a,us-east-1b]",
                        "cluster.instance_types=[g5.xlarge]")
    gaps = MotoGaps(aws_spot.ec2)
    for _ in range(2):  # every attempt: one type, two zones
        no_capacity(gaps, "InsufficientInstanceCapacity")
    with gaps, pytest.raises(NoCapacity) as error:
        aws_spot.create(2)
    assert str(error.value).splitlines()[1:3] == [
        f"  - g5.xlarge spot in {zone}: 0 of 2 instances (InsufficientInstanceCapacity: "
        "stubbed InsufficientInstanceCapacity)" for zone in ("us-east-1a", "us-east-1b")]
    assert tagged(aws_spot.run.id) == {}


def test_a_short_fleet_is_terminated_before_the_next_attempt(aws, tmp_path, caplog):
    caplog.set_level("INFO", logger="launch")
    aws_spot = provider(tmp_path, "cluster.zones=[us-east-1a,us-east-1b]")
    # The one instance AWS managed to start (moto starts it; the stub reports it).
    (partial,) = [i["InstanceId"] for i in ec2().run_instances(
        ImageId=AMI, InstanceType="g5.xlarge", MinCount=1, MaxCount=1, TagSpecifications=[
            {"ResourceType": "instance", "Tags": [
                {"Key": "spotring:run-id", "Value": aws_spot.run.id}]}])["Instances"]]
    gaps = MotoGaps(aws_spot.ec2)
    no_capacity(gaps, "InsufficientInstanceCapacity", [partial])
    with gaps:
        nodes = aws_spot.create(2)
    assert attempts_logged(caplog)[0].startswith("up: g5.xlarge spot in us-east-1a: 1 of 2")
    assert partial not in [n.id for n in nodes] and {n.zone for n in nodes} == {"us-east-1b"}
    state_of = ec2().describe_instances(InstanceIds=[partial])["Reservations"][0]["Instances"][0]
    assert state_of["State"]["Name"] == "terminated"
    aws_spot.destroy()
    assert tagged(aws_spot.run.id) == {}


def test_an_instance_lost_while_starting_means_the_next_attempt(aws, tmp_path, caplog):
    caplog.set_level("INFO", logger="launch")
    aws_spot = provider(tmp_path, "cluster.zones=[us-east-1a,us-east-1b]")
    first_fleet: list[str] = []

    def reclaim_one(parsed, **_):
        # AWS takes a spot instance back while it boots (moto would never).
        if not first_fleet:
            first_fleet.extend(i for g in parsed["Instances"] for i in g["InstanceIds"])
            ec2().terminate_instances(InstanceIds=first_fleet[:1])

    aws_spot.ec2.meta.events.register("after-call.ec2.CreateFleet", reclaim_one)
    nodes = aws_spot.create(2)
    lost = [m for m in attempts_logged(caplog) if "lost while starting" in m]
    assert lost == [f"up: g5.xlarge spot in us-east-1a: lost while starting: {first_fleet[0]} "
                    "(terminated)"]
    assert not set(first_fleet) & {n.id for n in nodes}
    assert {n.zone for n in nodes} == {"us-east-1b"}
    states = {i["InstanceId"]: i["State"]["Name"] for r in ec2().describe_instances(
        InstanceIds=first_fleet)["Reservations"] for i in r["Instances"]}
    assert set(states.values()) == {"terminated"}
    aws_spot.destroy()
    assert tagged(aws_spot.run.id) == {}


THROTTLED = (b"<Response><Errors><Error><Code>RequestLimitExceeded</Code><Message>Request "
             b"limit exceeded.</Message></Error></Errors><RequestID>1</RequestID></Response>")


def test_throttled_calls_are_retried(aws, tmp_path, monkeypatch):
    """AWS throttles an account's API calls (RequestLimitExceeded); moto never does. So
    the first call of each service is answered here with AWS's throttling error, in the
    HTTP layer (botocore's before-send), where botocore's retries see it as they would
    AWS's: the launcher's own retry config, with no AWS_MAX_ATTEMPTS to say otherwise."""
    monkeypatch.delenv("AWS_MAX_ATTEMPTS", raising=False)
    monkeypatch.delenv("AWS_RETRY_MODE", raising=False)
    aws_spot = provider(tmp_path)
    throttled = []

    def throttle(request, event_name, **_):
        operation = event_name.split(".", 2)[1:]
        if operation[0] in [service for service, _ in throttled]:
            return None  # the retry, and the calls after it, go through to moto
        throttled.append(operation)
        raw = urllib3.HTTPResponse(body=io.BytesIO(THROTTLED), status=503,
                                   preload_content=False)
        return AWSResponse(request.url, 503, {}, raw)

    aws_spot.session.events.register("before-send", throttle)  # every client made after
    aws_spot.check()  # STS, then EC2: the credentials, the types, the subnets, the AMI
    assert throttled == [["sts", "GetCallerIdentity"], ["ec2", "DescribeInstanceTypes"]]
    assert aws_spot.preflight.ami == AMI


def test_up_failing_at_the_placement_group_deletes_the_rest(cli, tmp_path):
    """moto has no placement groups: it answers their calls with HTTP 500, the creation
    and the look-up alike. `up` fails there, and the teardown after it must still delete
    the key pair and the security group made before, and then name what it could not
    look up, with the command that tries again, after why `up` failed."""
    done = cli("up", "nodes=1", "cluster.placement_group=true", expect=1,
               AWS_MAX_ATTEMPTS="2")
    run = only_run(tmp_path)
    # From the launcher's first line on: moto's server, in this process, logs the 500s.
    err = done.err[done.err.index("spotring up: failed: "):]
    why, left = err.split(f"\nspotring up: run {run.id}: ")
    assert why.startswith("spotring up: failed: ") and "500 Internal Server" in why
    lines = left.splitlines()
    assert lines[:3] == ["still there after every deletion was tried:",
                         "  - placement groups: unknown (their look-up failed)", "  because:"]
    assert lines[3].startswith("  - describe placement groups: ") and "500 Internal" in lines[3]
    assert lines[4].startswith("  - describe placement groups again: ")
    assert lines[5:] == [f"  `spotring down run_id={run.id}` tries again"]
    assert "deleted security group" in done.out and "deleted key pair" in done.out
    assert tagged(run.id) == {}
    # `down` cannot look them up either: it says so, and exits 1, every time.
    again = cli("down", expect=1, AWS_MAX_ATTEMPTS="1")
    assert f"spotring down: failed: run {run.id}: still there after every deletion was " \
        "tried:\n  - placement groups: " in again.err
    assert "destroyed_at" not in state(run.path)


@pytest.mark.parametrize("operation", [
    "import_key_pair", "create_security_group", "authorize_security_group_ingress",
    "create_launch_template", "create_fleet", "describe_instance_status",
])
def test_a_failure_at_any_stage_leaves_nothing(aws, tmp_path, operation):
    aws_spot = provider(tmp_path)
    gaps = MotoGaps(aws_spot.ec2)  # moto cannot be told to fail a call
    gaps.add_client_error(operation, "InternalError", f"stubbed failure of {operation}")
    with gaps, pytest.raises(ClientError, match=f"stubbed failure of {operation}"):
        aws_spot.create(2)
    gaps.assert_no_pending_responses()
    assert tagged(aws_spot.run.id) == {}


def test_replace_a_lost_node_in_the_same_zone(aws, tmp_path):
    aws_spot = provider(tmp_path)
    nodes = aws_spot.create(2)
    (new,) = aws_spot.replace(nodes[1:])
    assert new.id not in [n.id for n in nodes] and new.zone == nodes[0].zone
    assert sorted(n.id for n in aws_spot.describe()) == sorted([nodes[0].id, new.id])
    aws_spot.destroy()
    assert tagged(aws_spot.run.id) == {}


def test_down_all_mine_finds_every_run_of_this_owner_only(aws, tmp_path):
    runs = [provider(tmp_path / str(i), "nodes=1") for i in range(2)]
    for aws_spot in runs:
        aws_spot.create(1)
    stranger = ec2().create_security_group(
        GroupName="not-mine", Description="another owner's", TagSpecifications=[{
            "ResourceType": "security-group", "Tags": [
                {"Key": "project", "Value": "spotring"}, {"Key": "owner", "Value": "someone"},
                {"Key": "spotring:run-id", "Value": "theirs"}]}])["GroupId"]
    done = provider(tmp_path / "sweeper", "nodes=1").destroy(all_mine=True)
    assert sum(line.startswith("terminated instance") for line in done) == 2
    assert all(tagged(r.run.id) == {} for r in runs)
    assert tagged("theirs") == {"security groups": [stranger]}
