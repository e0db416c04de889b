"""The launcher's command line and config: every subcommand's --help, what is bad input
without asking AWS, and the message it gets."""

from __future__ import annotations

import subprocess
import sys

import pytest

from harness.commands import python_m
from spotring.exits import ConfigError
from spotring.launch import config
from spotring.launch.__main__ import main
from spotring.launch.rundir import RunDir
from tests.conftest import REPO


def problems(*overrides: str) -> str:
    cfg = config.compose(list(overrides))
    with pytest.raises(ConfigError) as error:
        config.validate(cfg)
    return str(error.value)


@pytest.mark.parametrize("overrides, message", [
    (["nodes=0"], "nodes=0: must be from 1 to cluster.max_nodes=16"),
    (["nodes=17"], "nodes=17: must be from 1 to cluster.max_nodes=16"),
    (["cluster.region=us-eats-1"], "cluster.region=us-eats-1: unknown (did you mean us-east-1?); "
                                   "valid: af-south-1, "),
    (["cluster.instance_types=[g5.xlarge,p5.48xlarg]"],
     "cluster.instance_types: p5.48xlarg: unknown (did you mean p5.48xlarge?); valid: any EC2 "
     "instance type"),
    (["cluster.instance_types=[]"], "cluster.instance_types=[]: name at least one"),
    (["cluster.zones=[eu-west-1a]"], "cluster.zones: eu-west-1a is not a zone of "
                                     "cluster.region=us-east-1"),
    (["cluster.ssh_cidr=0.0.0.0/0"], "cluster.ssh_cidr=0.0.0.0/0: would open SSH to the whole "
                                     "internet"),
    (["cluster.ssh_cidr=my-laptop"], "cluster.ssh_cidr=my-laptop: not an address range"),
    (["cluster.ami=my-image"], "cluster.ami=my-image: expected an AMI id"),
    (["cluster.max_price=0"], "cluster.max_price=0.0: must be positive"),
    (["nodes=4", "cluster.min_nodes=5"], "cluster.min_nodes=5: must be from 1 to nodes=4"),
    (["cluster.max_restarts=-1"], "cluster.max_restarts=-1: must be 0 or more"),
    (["cluster.max_preemptions=-1"], "cluster.max_preemptions=-1: must be 0 or more"),
    (["cluster.on_demand_prices={g5.xlarge: -1}"], "cluster.on_demand_prices: g5.xlarge=-1.0: "
                                                   "$/hour per instance type, 0 or more"),
    (["cluster.volume_usd_per_gb_month=-0.08"], "cluster.volume_usd_per_gb_month=-0.08: $ per "
                                                "GB-month, 0 or more"),
    (["cluster=local", "cluster.price=-1"], "cluster.price=-1.0: $/hour per node, 0 or more"),
    (["job.launcher=srun"], "job.launcher=srun: unknown (did you mean mpirun?); valid: "
                            "horovodrun, mpirun, torchrun, none"),
    (["job.command=[python,t.py]", "job.args=['train.epochs=1']"], "job.args=['train.epochs=1'] "
     "with job.command=['python', 't.py']: the trainer's overrides or a command, not both"),
    (["job.command=[python,t.py]", "job.results=../out"], "job.results=../out: a directory "
                                                          "relative to the project, inside it"),
    (["cluster=local", "cluster.subnet=10.0.0.0/28"], "cluster.subnet=10.0.0.0/28: must be an "
                                                      "IPv4 network of /24 or larger"),
    (["cluster=local", "cluster.slots=0"], "cluster.slots=0: must be 1 or more"),
    (["cluster.ssh_cidr='2001:db8::/32'"], "cluster.ssh_cidr=2001:db8::/32: the security group "
                                           "takes an IPv4 range"),
    (["cluster.ssh_cidr=0.0.0.0/1"], "cluster.ssh_cidr=0.0.0.0/1: would open SSH to a"),
    (["checkpoint.uri=my-bucket/runs"], "checkpoint.uri=my-bucket/runs: expected "
                                        "s3://bucket/prefix, gs://bucket/prefix"),
    (["+job.env.MY-TOKEN=x"], "job.env: MY-TOKEN: not a variable's name"),
])
def test_bad_input_is_named_with_what_is_valid(overrides, message):
    text = problems(*overrides)
    assert message in text and "Nothing was created" in text


@pytest.mark.parametrize("words, named", [
    (["--", "model=nosuch"], "Could not find 'model/nosuch'"),
    (["job.args=['train.batch_size=0']"], "train.batch_size=0: must be positive"),
    (["--", "spotring", "train", "optim.lr=abc"], "optim.lr=abc"),
])
def test_the_trainers_bad_overrides_stop_the_launch_before_anything(tmp_path, capsys, words,
                                                                    named):
    """The trainer is one more command, whose own check (spotring.cli.check_command) runs
    before any node is paid for, however it is written."""
    code = main(["launch", "cluster=local", f"runs_dir={tmp_path}", *words])
    err = capsys.readouterr().err
    assert code == 2 and named in err and err.startswith("spotring launch: error:"), err
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("command", ["launch", "up", "run"])
@pytest.mark.parametrize("words, named", [
    # The s3:// forgotten: each rank's checkpoints would go to ./my-bucket/runs on its node.
    (["checkpoint.uri=my-bucket/runs"],
     "checkpoint.uri=my-bucket/runs: expected s3://bucket/prefix, gs://bucket/prefix, "
     "az://container/prefix or file:///path"),
    # The keys of before: unknown, as any other (no alias takes them silently).
    (["job.checkpoint_uri=s3://my-bucket/runs"], "Could not override 'job.checkpoint_uri'"),
])
def test_a_checkpoint_uri_without_a_scheme_exits_2_before_anything(tmp_path, capsys, command,
                                                                   words, named):
    """checkpoint.uri, the key of every spotring command, checked as the library checks
    it (spotring.stores.uri_problem) before any node or run directory exists."""
    runs = tmp_path / "runs"
    runs.mkdir()
    if command == "run":  # on the nodes of a run `up` brought up: its config, no node
        RunDir(runs / "up").create(config.compose(["cluster=local"]))
    before = sorted(runs.rglob("*"))
    code = main([command, "cluster=local", f"runs_dir={runs}", *words, "--", "python", "t.py"])
    err = capsys.readouterr().err
    assert code == 2 and named in err and err.startswith(f"spotring {command}: error:"), err
    assert sorted(runs.rglob("*")) == before


def test_every_problem_at_once():
    text = problems("nodes=0", "cluster.region=mars", "job.launcher=srun")
    assert text.count("\n  - ") == 3


@pytest.mark.parametrize("override, message", [
    ("nodes=eight", "Value 'eight' of type 'str' could not be converted to Integer"),
    ("cluster.instance_type=[g5.xlarge]", "Could not override 'cluster.instance_type'"),
    ("cluster=gcp", "Could not find 'cluster/gcp'"),
])
def test_a_bad_override_is_bad_input(override, message):
    with pytest.raises(ConfigError, match=message):
        config.compose([override])


def test_min_nodes_follows_nodes_and_the_defaults_are_valid():
    for cluster in config.CLUSTERS:
        cfg = config.compose([f"cluster={cluster}", "nodes=8"])
        config.validate(cfg)
        assert cfg.cluster.min_nodes == 8
    cfg = config.compose(["cluster.ssh_user=ec2-user"])
    assert cfg.cluster.workdir == "/home/ec2-user/spotring"


def test_down_all_mine_takes_only_the_local_clusters_own_links():
    from spotring.launch.local import netns

    names = netns.Names("20261122-114501-3f2a")
    ours = [names.bridge, names.veth(0), names.peer(12)]
    others = ["sprite0", "spr123456", "spring-br0", names.bridge + "x"]
    assert [n for n in ours + others if netns.ANY_RUNS_LINK.fullmatch(n)] == ours


def test_the_launcher_starts_without_importing_torch():
    # torch takes seconds to import; `python -m spotring.launch status` should not wait for it.
    code = ("import sys, spotring.launch.__main__, spotring.launch.aws.provider, "
            "spotring.launch.local.provider; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'horovod')))")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True,
                         text=True, check=True).stdout
    assert out.strip() == "[]"


# What `spotring X --help` must name: the overrides X reads (on top of --help itself).
@pytest.mark.parametrize("command, names", [
    ("launch", ["nodes=N", "cluster=aws_spot|local", "instance_types", "max_restarts",
                "slots", "-- COMMAND | OVERRIDES"]),
    ("up", ["nodes=N", "cluster.KEY=VALUE", "instance_types", "ssh_cidr", "--dry-run"]),
    ("run", ["run_id=ID", "job.launcher=", "-- COMMAND | OVERRIDES"]),
    ("status", ["run_id=ID", "runs_dir=DIR"]),
    ("down", ["run_id=ID", "--all-mine"]),
    ("cost", ["nodes=N", "cluster.instance_types=", "cluster.zones=", "run_id=ID"]),
])
def test_every_subcommand_answers_help(capsys, command, names):
    assert main([command, "--help"]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"usage: spotring {command} ")
    assert [n for n in names if n not in out] == []


def test_the_subcommands_are_listed_one_line_each(capsys):
    assert main(["--help"], prog="spotring") == 0
    out = capsys.readouterr().out
    listed = out[out.index("subcommands"):].splitlines()[1:]
    assert [line.split()[0] for line in listed] == ["launch", "up", "run", "status", "down",
                                                    "cost"]


@pytest.mark.parametrize("argv, message", [
    (["uo", "nodes=2"], "spotring: error: argument command: invalid choice: 'uo' (choose from "
                        "'launch', 'up', 'run', 'status', 'down', 'cost')"),
    ([], "spotring: error: the following arguments are required: command"),
    (["status", "--", "train.epochs=1"], "spotring status: error: takes nothing after -- "
                                         "(there: train.epochs=1)"),
    (["up", "--all-mine"], "spotring up: error: unrecognized arguments: --all-mine"),
])
def test_a_bad_command_line_exits_2_naming_it(capsys, argv, message):
    assert main(argv) == 2
    assert message in capsys.readouterr().err


def test_python_dash_m_launch_names_itself():
    done = python_m("spotring.launch", "down", "--help")
    assert done.code == 0 and done.out.startswith("usage: python -m spotring.launch down ")
    done = python_m("spotring.launch", "up", "nodes=0", "--dry-run")
    assert done.code == 2
    assert done.err.startswith("python -m spotring.launch up: error: bad launch configuration:\n"
                               "  - nodes=0: must be from 1 to cluster.max_nodes=16")
