"""A user's own command on the local cluster, launched as a pip user does: spotring from
an installed wheel, run in a directory that holds only the user's project (train.py,
requirements.txt), never the spotring checkout. Three runs of the cluster, each run once
and read by several tests:

    recovered    `spotring launch cluster=local nodes=2 -- python train.py ...` with
                 one node to spare in the pool: a spot notice on node 1 has the launcher
                 replace it (node 0's environment copied to the replacement); then the
                 replacement vanishes, none is left to replace it, and the job goes on
                 on node 0 alone with the same global batch. It ends with the weights of
                 one worker uninterrupted, and its ledger bills each node.
    in_place     the same launch with job.launcher=in_place: node 1's notice, then its
                 replacement vanishing, each cost node 0 a second or so and no restart;
                 each lost node is replaced and its replacement joins the running job.
    brought_up   `spotring up cluster=local nodes=2`, then on its nodes `spotring run`
                 under torchrun, with no launcher, a command that fails, a sweep of two
                 trials at once, and under mpirun; then `spotring down`.
"""

from __future__ import annotations

import ipaddress
import json
import math
import re
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from harness import user_script
from harness.commands import call
from harness.cores import cores
from harness.installed import spotring_venv
from harness.launcher import (
    checkpoints_on_node_0,
    leftovers,
    netns_unavailable,
    notice_node_1,
    processes,
    steps_on_node_0,
)
from harness.local_launch import STEPS, installed, launch, project
from harness.schedule import Schedule
from harness.stores import environment
from harness.sweeps import side_by_side, trial_dir
from spotring.checkpoint.layout import Checkpoints
from spotring.exits import EXIT_CONFIG
from spotring.launch.__main__ import main
from spotring.launch.local import netns
from spotring.launch.rundir import RunDir

WHY_NOT = netns_unavailable()


@pytest.fixture(scope="module")
def venv(tmp_path_factory) -> Path:
    return spotring_venv(tmp_path_factory.mktemp("pip") / "venv")


@pytest.fixture(scope="module")
def alone(tmp_path_factory) -> dict:
    """summary.json of the script run alone, uninterrupted, on one worker."""
    return user_script.reference(tmp_path_factory.mktemp("alone"), *STEPS)


def spotring(venv: Path, cwd: Path, *args: str) -> tuple[int, str]:
    """The installed `spotring` command run to its end as a user types it in ``cwd``: its
    exit code and its output (stdout and stderr together)."""
    proc = subprocess.run([str(venv / "bin" / "spotring"), *args], cwd=cwd, env=installed(venv),
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          timeout=400)
    return proc.returncode, proc.stdout


def test_bad_input_exits_2_before_any_node(tmp_path, monkeypatch):
    """Checked in-process: the same code path, no cluster needed (not even root)."""
    monkeypatch.chdir(user_script.write_project(tmp_path / "p"))
    runs = tmp_path / "runs"
    cases = {
        "job.max_project_mb=0.001": ("train.py", "MB", ".spotringignore"),
        "-- python missing.py": ("missing.py", "no such file"),
    }
    for words, said in cases.items():
        before = set(tmp_path.iterdir())
        command = [] if "--" in words else ["--", "python", "train.py"]
        done = call(main, "launch", "cluster=local", "nodes=2", f"runs_dir={runs}",
                    *words.split(), *command)
        assert done.code == EXIT_CONFIG, done
        assert all(s in done.out + done.err for s in said), done
        assert set(tmp_path.iterdir()) == before  # no run directory: nothing was made
    Path("requirements.txt").write_text("torch>>=2\n")
    done = call(main, "up", "cluster=local", f"runs_dir={runs}", "--", "python", "train.py")
    assert done.code == EXIT_CONFIG and "requirements.txt" in done.err and "line 1" in done.err, \
        done


PRICE, ON_DEMAND = 0.25, 1.006  # $/hour of a node, and on demand: the ledger's rehearsal


@dataclass
class Launched:
    """What the schedule of a launch with a notice and a vanished node saw."""

    code: int
    out: str
    run: RunDir
    names: netns.Names
    noticed_at: float  # when node 1's notice came
    vanished_at: float  # when its replacement vanished


@dataclass
class Recovered(Launched):
    """What the schedule of ``recovered`` saw."""

    reached: int  # the last step node 0 logged before the job stopped for it


@pytest.fixture(scope="module")
def recovered(venv, tmp_path_factory) -> Recovered:
    """2 nodes of 1 slot; a notice on node 1 once the job trains; its replacement
    (node 2, the one spare) killed whole once a periodic checkpoint followed the resume;
    then no node left to replace it, and cluster.min_nodes=1."""
    tmp = tmp_path_factory.mktemp("recovered")
    # Its processes keep about one core busy (tools/suite-profile: 42% of 2).
    with cores(1), launch(venv, project(tmp / "project"), tmp / "runs",
                          "cluster.min_nodes=1", "cluster.max_preemptions=1",
                          "cluster.max_restarts=1", f"cluster.price={PRICE}",
                          f"+cluster.on_demand_prices={{netns: {ON_DEMAND}}}", spares=1,
                          script=("--poll-seconds", "1")) as followed:  # notices within 1 s
        schedule = Schedule("the launch of train.py on 2 nodes", lambda: followed.text)
        with schedule.step("a spot notice on node 1, which stays up"):
            run, names, noticed_at, metadata = notice_node_1(followed, trained=1)
        try:
            with schedule.step("node 1 replaced, and the job back at work"):
                followed.wait_for(lambda: names.ns(2) in netns.namespaces(names.ns_prefix))
                followed.wait_for(lambda: resumes(followed.text) != [])
                back = resumes(followed.text)[0]
                followed.wait_for(lambda: any(s > back for s in checkpoints_on_node_0(run)))
        finally:
            metadata.close()
        with schedule.step("the replacement vanishes: every process of it killed at once"):
            vanished_at = time.time()
            netns.delete_namespace(names.ns(2), stops=((signal.SIGKILL, 5.0),))
            followed.wait_for(lambda: followed.text.count("run: the job exited with code") == 2)
            reached = steps_on_node_0(run)  # rank 0 took no step without its peers
        with schedule.step("the job on node 0 alone, to its end"):
            code, out = followed.end()
    return Recovered(code, out, run, names, noticed_at, vanished_at, reached)


def resumes(out: str) -> list[int]:
    return [int(s) for s in re.findall(r"resumed from \S+ at step (\d+)", out)]


@pytest.mark.slow
@pytest.mark.skipif(WHY_NOT is not None, reason=WHY_NOT or "")
def test_a_notice_and_a_lost_node_each_restart_the_job_which_ends_as_one_worker_would(
        recovered, alone):
    r = recovered
    assert r.code == 0, r.out[-6000:]
    summary = json.loads((r.run.job / "summary.json").read_text())
    assert (summary["world_size"], summary["global_batch"], summary["steps"]) == (1, 2, 30)
    assert summary["weights"] == pytest.approx(alone["weights"], rel=1e-10)
    assert ("recover: the run spent 1 of 1 preemptions (cluster.max_preemptions), 1 of 1 "
            "failures (cluster.max_restarts)") in r.out
    assert leftovers(r.run.id) == [] and processes(r.run.id) == []


@pytest.mark.slow
@pytest.mark.skipif(WHY_NOT is not None, reason=WHY_NOT or "")
def test_a_node_under_notice_is_replaced_and_the_job_resumes_at_the_notices_step(recovered):
    r, names = recovered, recovered.names
    # Node 1's rank saw the notice, every rank stopped at its step; the launcher saw the
    # notice still up and took the node down rather than resume on it.
    noticed = re.search(r"\[1\]<stderr>:spotring: preempted \(EC2 spot terminate notice for "
                        r"\S+\) at step (\d+)", r.out)
    assert noticed, r.out[-6000:]
    assert f"recover: node {names.ns(1)} announces a spot interruption notice" in r.out
    assert resumes(r.out)[0] == int(noticed[1])  # the notice's checkpoint: no step lost


@pytest.mark.slow
@pytest.mark.skipif(WHY_NOT is not None, reason=WHY_NOT or "")
def test_the_replacement_gets_a_copy_of_node_0s_environment(recovered):
    """Built on every node at first (tinydep from the project's requirements), then
    node 0's kept and copied to the replacement, which runs no pip."""
    r, names = recovered, recovered.names
    env = re.findall(r"run: node (\d) \((\S+)\): environment (\w+) (.*)", r.out)
    assert [how.split(" in ")[0] for _, _, _, how in env[:2]] == ["built"] * 2, env
    assert [(i, ns) for i, ns, _, _ in env[2:4]] == [("0", names.ns(0)), ("1", names.ns(2))]
    assert env[2][3] == "ready" and env[3][3].startswith(f"copied from {names.ns(0)} in "), env
    assert len({key for _, _, key, _ in env}) == 1
    assert "Successfully installed tinydep-1.0" in (
        r.run.path / f"setup-{names.ns(0)}.log").read_text()
    copied = (r.run.path / f"setup-{names.ns(2)}.log").read_text()
    assert not re.search(r"Collecting|Downloading|Building|Installing", copied), copied


@pytest.mark.slow
@pytest.mark.skipif(WHY_NOT is not None, reason=WHY_NOT or "")
def test_with_no_replacement_to_be_had_the_survivors_go_on_from_a_periodic_checkpoint(
        recovered):
    r, names = recovered, recovered.names
    assert ("recover: the job runs on 2 nodes, 2 workers; with no replacement to be had it "
            "can go on with 1 nodes (cluster.min_nodes=1)") in r.out
    assert "going on with 1 node(s), 1 workers (cluster.min_nodes=1)" in r.out, r.out[-6000:]
    assert [n.id for n in r.run.nodes()] == [names.ns(0)]
    first, second = resumes(r.out)
    assert first < second <= r.reached < 30  # the steps since that checkpoint, lost


@pytest.mark.slow
@pytest.mark.skipif(WHY_NOT is not None, reason=WHY_NOT or "")
def test_the_ledger_bills_each_node_for_its_own_seconds_and_names_each_restart(recovered):
    """Each node's times as the provider gave them and as it left the run, billed by the
    second (60 s at least) at the price it was launched at."""
    r, names = recovered, recovered.names
    ledger = json.loads(r.run.ledger.read_text())
    state = r.run.state()
    provided = {n["id"]: n for n in state["retired"] + state["nodes"]}
    assert [n["id"] for n in ledger["nodes"]] == [names.ns(i) for i in (1, 2, 0)]
    launched = {n["id"]: n["launched_at"] for n in ledger["nodes"]}
    assert launched[names.ns(0)] < launched[names.ns(1)] < r.noticed_at \
        < launched[names.ns(2)] < r.vanished_at
    ends = {names.ns(0): state["destroyed_at"]}
    for lost, after, before in ((names.ns(1), r.noticed_at, launched[names.ns(2)]),
                                (names.ns(2), r.vanished_at, state["destroyed_at"])):
        ends[lost] = next(n["left_at"] for n in state["retired"] if n["id"] == lost)
        assert after < ends[lost] < before  # found lost, before it was replaced or the end
    for n in ledger["nodes"]:
        assert n["launched_at"] == provided[n["id"]]["launched_at"]
        assert n["terminated_at"] == ends[n["id"]]
        seconds = max(60, math.ceil(ends[n["id"]] - n["launched_at"]))  # whole seconds
        assert n["usd"] == pytest.approx(PRICE * seconds / 3600, rel=1e-9)
    total = sum(PRICE * max(60, math.ceil(ends[i] - launched[i])) / 3600 for i in ends)
    assert ledger["totals"]["usd"] == pytest.approx(total, rel=1e-9)
    assert ledger["totals"]["on_demand_usd"] == pytest.approx(total * ON_DEMAND / PRICE)
    assert ledger["totals"]["usd_per_1000_steps"] == pytest.approx(total / 30 * 1000)

    preemption, failure = ledger["restarts"]
    first, second = resumes(r.out)
    assert (preemption["cause"], preemption["exit"], preemption["lost_nodes"]) == (
        "preemption", 75, [names.ns(1)])
    assert (preemption["step"], preemption["resumed_from"], preemption["steps_redone"]) == (
        first, first, 0)
    assert r.noticed_at <= preemption["noticed_at"] <= preemption["saved_at"]
    # No wait for the node to leave `running` (cluster.notice_wait_s, 150 s): its notice
    # was enough; the wait is the replacement's making.
    assert preemption["waited_s"] < 60
    assert (failure["cause"], failure["lost_nodes"]) == ("failure", [names.ns(2)])
    assert failure["exit"] not in (0, 75) and failure["noticed_at"] is None
    assert (failure["step"], failure["steps_redone"]) == (r.reached, r.reached - second)
    assert f"cost: ledger ({r.run.ledger}, times UTC):" in r.out


@pytest.fixture(scope="module")
def in_place(venv, tmp_path_factory) -> Launched:
    """`spotring launch ... job.launcher=in_place`, 2 nodes of 1 slot and 2 to spare: a
    notice on node 1 once the job trains; once its replacement (node 2) has joined, node 2
    killed whole; its replacement (node 3) joins, or finds the job done. Node 0, alone
    after node 1 left, pauses between two steps until node 2 asks to join: however long
    node 2 takes to start, the job has most of its steps left when node 2 is killed."""
    tmp = tmp_path_factory.mktemp("in_place")
    pause = tmp / "pause"
    # Its processes keep about one core busy (tools/suite-profile: 37% of 2).
    with cores(1), launch(venv, project(tmp / "project"), tmp / "runs",
                          "job.launcher=in_place", "cluster.min_nodes=1",
                          "cluster.max_preemptions=1", "cluster.max_restarts=1",
                          f"cluster.price={PRICE}", spares=2,
                          script=("--poll-seconds", "1", "--sleep", "1",
                                  "--pause-file", str(pause))) as followed:
        schedule = Schedule("the launch of train.py in place on 2 nodes", lambda: followed.text)
        with schedule.step("a spot notice on node 1, which leaves; node 0 trains on alone"):
            run, names, noticed_at, metadata = notice_node_1(
                followed, trained=1,
                answer=lambda names: f"[{names.ns(0)}/0] spotring: in place: 2 -> 1 workers")
            pause.touch()
        with schedule.step("node 1's replacement asks to join the running job, which takes "
                           "it in"):
            followed.wait_for(lambda: f"[{names.ns(2)}/0] spotring: asked to join" in followed.text)
            pause.unlink()
            metadata.close()  # up until the launcher has seen it and replaced node 1
            followed.wait_for(
                lambda: f"[{names.ns(2)}/0] spotring: in place: 1 -> 2 workers" in followed.text)
        with schedule.step("the replacement vanishes: every process of it killed at once"):
            vanished_at = time.time()
            netns.delete_namespace(names.ns(2), stops=((signal.SIGKILL, 5.0),))
        with schedule.step("the job to its end"):
            code, out = followed.end()
    return Launched(code, out, run, names, noticed_at, vanished_at)


@pytest.mark.slow
@pytest.mark.skipif(WHY_NOT is not None, reason=WHY_NOT or "")
def test_in_place_a_noticed_and_a_vanished_node_are_replaced_while_node_0_trains_on(
        in_place, alone):
    """No process of node 0 restarted, and the job ends as one worker alone would."""
    r, names = in_place, in_place.names
    assert r.code == 0, r.out[-6000:]
    assert r.out.count(f"in place: started {names.ns(0)}/0") == 1, r.out[-6000:]
    assert len(r.run.tries()) == 1  # one try: the job was never started again
    summary = json.loads((r.run.job / "summary.json").read_text())
    assert (summary["global_batch"], summary["steps"]) == (2, 30)
    assert summary["weights"] == pytest.approx(alone["weights"], rel=1e-10)
    # Node 1 left on its notice, node 2 joined, node 2 was lost; node 3 joined where the
    # job had steps left then.
    whys = [c["why"] for c in summary["in_place"]]
    assert whys[:3] == ["leave", "join", "lost"] and whys[3:] in ([], ["join"]), summary
    assert leftovers(r.run.id) == [] and processes(r.run.id) == []


@pytest.mark.slow
@pytest.mark.skipif(WHY_NOT is not None, reason=WHY_NOT or "")
def test_in_place_the_ledger_shows_each_lost_node_its_replacement_and_the_seconds_lost(
        in_place):
    r, names = in_place, in_place.names
    ledger = json.loads(r.run.ledger.read_text())
    events = ledger["in_place"]["nodes"]
    assert [(e["node"], e["replacement"]) for e in events] == [
        (names.ns(1), names.ns(2)), (names.ns(2), names.ns(3))], events
    assert events[0]["why"].startswith("a spot notice (EC2 spot terminate notice")
    assert events[1]["why"] in ("gone", "unreachable by ssh")
    assert r.noticed_at < events[0]["at"] < r.vanished_at < events[1]["at"]
    changes = ledger["in_place"]["changes"]
    assert ledger["in_place"]["seconds_lost"] == pytest.approx(sum(c["seconds"] for c in changes))
    assert all(c["seconds"] > 0 for c in changes) and changes
    billed = {n["id"]: n for n in ledger["nodes"]}
    assert set(billed) == {names.ns(i) for i in range(4)}
    # Each lost node leaves the bill when it was found lost, not at the run's end.
    for event in events:
        assert billed[event["node"]]["terminated_at"] <= event["at"] + 1
    assert ledger["restarts"] == []


@dataclass
class BroughtUp:
    """What the schedule of ``brought_up`` saw: each step's exit code and output, and
    what each run left in the run's job/ (it brings its results back there, over the
    last run's)."""

    run: RunDir
    said: dict[str, tuple[int, str]] = field(default_factory=dict)
    summaries: dict[str, dict] = field(default_factory=dict)
    node_1_log: str = ""  # the run with no launcher: node 1's output
    result: str = ""  # and the file its command made on node 0
    sweep_dir: Path | None = None


LAUNCHERS = {"torchrun": "torchrun", "mpirun": "mpi"}  # and what the job sees (runtime)
GS_URI = "gs://spotring-tests/brought-up"


@pytest.fixture(scope="module")
def brought_up(venv, tmp_path_factory, gcs_emulator) -> BroughtUp:
    """The runs with no launcher and the sweep's (torchrun) need the environment the
    first run built; mpirun's (with Horovod's extras) another: it runs last. The run under
    torchrun checkpoints to GCS too (its emulator, which the nodes reach at the bridge's
    address, given them by job.env)."""
    tmp = tmp_path_factory.mktemp("up")
    root = project(tmp / "project")
    (root / "plain.py").write_text(user_script.PLAIN)
    runs = tmp / "runs"

    def spot(step: str, *args: str) -> None:
        code, out = spotring(venv, root, *args)
        up.said[step] = (code, out)
        assert step in ("fails", "down") or code == 0, out

    with cores():
        code, out = spotring(venv, root, "up", f"runs_dir={runs}", "cluster=local", "nodes=2")
        assert code == 0, out
        up = BroughtUp(RunDir.find(runs, None))
        schedule = Schedule(f"the nodes of run {up.run.id}",
                            lambda: "\n".join(out for _, out in up.said.values()))
        try:
            with schedule.step("run under torchrun, its checkpoints in GCS"):
                bridge = ipaddress.ip_interface(f"{up.run.nodes()[0].address}/24").network[1]
                endpoint = gcs_emulator.env((str(bridge), gcs_emulator.address[1]))
                spot("torchrun", "run", f"runs_dir={runs}", "job.launcher=torchrun",
                     "job.results=runs/torchrun", f"checkpoint.uri={GS_URI}",
                     *(f"+job.env.{k}={v}" for k, v in endpoint.items()),
                     "--", "python", "train.py", *STEPS)
                up.summaries["torchrun"] = json.loads((up.run.job / "summary.json").read_text())
            with schedule.step("run with no launcher: once per node"):
                spot("none", "run", f"runs_dir={runs}", "job.launcher=none", "job.results=out",
                     "--", "python", "plain.py", "hi")
                up.node_1_log = (up.run.path / "job-node-1.log").read_text()
                up.result = (up.run.job / "result.txt").read_text()
            with schedule.step("run a command that fails"):
                spot("fails", "run", f"runs_dir={runs}", "job.launcher=none", "--", "python",
                     "-c", "import sys; print('the last words'); sys.exit(3)")
            with schedule.step("a sweep of 2 trials, one on each node"):
                up.sweep_dir = tmp / "sweep"
                spot("sweep", "sweep", f"sweep.dir={up.sweep_dir}", "sweep=custom",
                     "sweep.name=on_cluster", f"sweep.cluster={up.run.id}",
                     f"sweep.runs_dir={runs}", "sweep.parallel=2", "sweep.trials=2",
                     "sweep.params.lr=choice(0.05,0.1)", "sweep.objectives=[test_loss]", "--",
                     "python", "train.py", "--steps", "8", "--lr", "{lr}")
            with schedule.step("run under mpirun"):
                spot("mpirun", "run", f"runs_dir={runs}", "job.launcher=mpirun",
                     "job.results=runs/mpirun", "--", "python", "train.py", *STEPS)
                up.summaries["mpirun"] = json.loads((up.run.job / "summary.json").read_text())
        finally:
            spot("down", "down", f"runs_dir={runs}")
    return up


@pytest.mark.slow
@pytest.mark.skipif(WHY_NOT is not None, reason=WHY_NOT or "")
@pytest.mark.parametrize("launcher", LAUNCHERS)
def test_a_launcher_runs_the_command_on_the_nodes_up_brought_up(brought_up, alone, launcher):
    # What the launcher looks like from the inside (spotring.runtime), and one worker's
    # weights from the two.
    summary = brought_up.summaries[launcher]
    assert (summary["world_size"], summary["launcher"]) == (2, LAUNCHERS[launcher])
    assert summary["weights"] == pytest.approx(alone["weights"], rel=1e-10)


@pytest.mark.slow
@pytest.mark.skipif(WHY_NOT is not None, reason=WHY_NOT or "")
def test_checkpoint_uri_takes_every_ranks_part_to_the_store(brought_up, gcs_emulator,
                                                            tmp_path):
    """The run under torchrun checkpointed every 4 of its 30 steps to GCS: the newest
    there is whole (every part checked against its manifest), with each node's rank's
    part."""
    with environment(gcs_emulator.env()):
        newest = Checkpoints(tmp_path / "elsewhere", keep=1, uri=GS_URI).newest_valid()
    ranks_parts = [name for name in newest.parts() if name.endswith(".distcp")]
    assert newest.step == 28 and len(ranks_parts) == 2, newest.parts()


@pytest.mark.slow
@pytest.mark.skipif(WHY_NOT is not None, reason=WHY_NOT or "")
def test_with_no_launcher_the_command_runs_once_per_node_and_node_0s_results_come_back(
        brought_up):
    assert "hello from node-0: hi" in brought_up.said["none"][1]
    assert "hello from node-1: hi" in brought_up.node_1_log
    assert brought_up.result == "made on the node\n"


@pytest.mark.slow
@pytest.mark.skipif(WHY_NOT is not None, reason=WHY_NOT or "")
def test_a_failing_command_exits_with_its_code_and_its_last_lines(brought_up):
    code, out = brought_up.said["fails"]
    assert code == 3, out
    assert re.search(r"the job exited with code 3 \(failed\); its last lines on node 0:"
                     r"\n(  .*\n)*  the last words", out), out


@pytest.mark.slow
@pytest.mark.skipif(WHY_NOT is not None, reason=WHY_NOT or "")
def test_a_sweep_runs_one_trial_on_each_node_at_the_same_time(brought_up):
    """Each trial on a node of its own: named so by the sweep, its run directory in that
    node's workdir alone, written by a process whose hostname is that node's; the
    results back in the sweep directory; the two trials' processes side by side."""
    up, sweep_dir = brought_up, brought_up.sweep_dir
    out = up.said["sweep"][1]
    addresses = [n.address for n in up.run.nodes()]
    started = dict(re.findall(r"^sweep: trial (\d) starts on nodes (\S+):", out, re.M))
    assert sorted(started) == ["0", "1"] and sorted(started.values()) == addresses, out
    for number, address in started.items():
        folder = trial_dir(sweep_dir, int(number))
        summary = json.loads((folder / "summary.json").read_text())
        assert summary["world_size"] == 1, summary  # the node's one slot
        node = addresses.index(address)
        assert [i for i in range(2) if (up.run.path / f"nodes/node-{i}/work/runs/sweeps/"
                                        f"on_cluster/00{number}/summary.json").is_file()] == [node]
        assert list((folder / "tensorboard").glob(f"*.node-{node}.*"))
        # What its processes printed, kept here (not replaced by the node's copy).
        assert "trained 8 steps on 1 workers" in (folder / "trial.log").read_text()
    assert side_by_side(sweep_dir, [0, 1])


@pytest.mark.slow
@pytest.mark.skipif(WHY_NOT is not None, reason=WHY_NOT or "")
def test_down_leaves_nothing_of_the_run(brought_up):
    code, out = brought_up.said["down"]
    assert code == 0, out
    run_id = brought_up.run.id
    assert leftovers(run_id) == [] and processes(run_id) == [], out
