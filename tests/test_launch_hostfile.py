"""The hostfiles as Horovod and Open MPI read them, and the job command of each launcher."""

from __future__ import annotations

import re
import subprocess

import pytest

from harness.launcher import HOROVOD_MISSING, needs_horovod
from spotring.exits import PREEMPTED
from spotring.launch import hostfile, job_command
from spotring.launch.commands import BIN, local_environment
from spotring.launch.provider import Node

# Two nodes of 4 GPUs: public addresses for ssh from here, private ones between them.
NODES = [Node(f"i-{i}", f"203.0.113.{i}", f"10.0.1.{10 + i}", 4, "g5.12xlarge", "us-east-1a",
              "spot") for i in range(2)]


def write(tmp_path):
    hostfile.write(NODES, tmp_path / "hosts", tmp_path / "hosts.mpich")
    return tmp_path / "hosts"


def test_horovod_reads_the_hostfile(tmp_path):
    # Imported here: `make test-fast` runs on a checkout whose Horovod is not built yet.
    horovod_hosts = pytest.importorskip("horovod.runner.common.util.hosts",
                                        reason=HOROVOD_MISSING)
    spec = horovod_hosts.parse_host_files(str(write(tmp_path)))
    assert spec == "10.0.1.10:4,10.0.1.11:4"
    slots = horovod_hosts.get_host_assignments(horovod_hosts.parse_hosts(spec), 8)
    assert [(s.hostname, s.rank, s.local_rank, s.cross_rank) for s in slots] == [
        ("10.0.1.10", r, r, 0) for r in range(4)] + [("10.0.1.11", 4 + r, r, 1) for r in range(4)]


def test_open_mpi_reads_the_hostfile(tmp_path):
    # --do-not-launch: Open MPI reads the hostfile and maps the ranks, and starts nothing.
    out = subprocess.run([str(BIN / "mpirun"), "--hostfile", str(write(tmp_path)), "--display",
                          "map", "--do-not-launch", "--bind-to", "none", "-np", "8", "true"],
                         capture_output=True, text=True, timeout=60, env=local_environment(),
                         check=True).stdout
    procs = re.findall(r"Data for node: (\S+).*?Num procs: (\d+)", out, re.DOTALL)
    assert procs == [("10.0.1.10", "4"), ("10.0.1.11", "4")]
    ranks = [int(r) for r in re.findall(r"App rank: (\d+)", out)]
    assert ranks == list(range(8))


def test_the_mpich_hostfile(tmp_path):
    write(tmp_path)
    assert (tmp_path / "hosts.mpich").read_text() == "10.0.1.10:4\n10.0.1.11:4\n"


LAUNCHER_ENV = 'PATH=/w/.venv/bin:"$PATH" OMPI_ALLOW_RUN_AS_ROOT=1 ' \
               'OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 PYTHONUNBUFFERED=1'
ENV = f"{LAUNCHER_ENV} SPOTRING_RUN_DIR=/w/runs/R"  # rank 0's run directory (launch.contract)


def test_the_job_command_of_each_launcher():
    # The trainer is a command like any other: its engine is its config's, its run
    # directory the contract's SPOTRING_RUN_DIR.
    job = job_command.build("horovodrun", NODES, "/w", "R", ["spotring", "train", "a=3"])
    assert job.commands == {0: f"cd /w && {ENV} exec horovodrun --gloo -np 8 --hostfile hosts "
                               "--start-timeout 120 spotring train a=3"}
    # A command of the user's own, word for word, with the contract's variables.
    job = job_command.build("horovodrun", NODES, "/w", "R", ["python", "t.py", "--lr", "0.1"],
                            {"SPOTRING_RUN_ID": "R"})
    assert job.commands[0].endswith("SPOTRING_RUN_DIR=/w/runs/R SPOTRING_RUN_ID=R exec "
                                    "horovodrun --gloo -np 8 --hostfile hosts --start-timeout 120 "
                                    "python t.py --lr 0.1")
    job = job_command.build("mpirun", NODES, "/w", "R", ["spotring", "train"])
    assert job.commands[0].startswith(
        f"cd /w && {ENV} exec mpirun -np 8 --hostfile hosts --prefix /w/.venv --bind-to none "
        "-x PATH -x OMPI_ALLOW_RUN_AS_ROOT")
    assert job.commands[0].endswith(" spotring train")
    job = job_command.build("torchrun", NODES, "/w", "R", ["spotring", "train", "a=3"])
    assert job.commands == {i: f"cd /w && {ENV} exec torchrun --nnodes 2 --nproc-per-node 4 "
                               f"--node-rank {i} --master-addr 10.0.1.10 --master-port 29400 "
                               "--no-python spotring train a=3"
                            for i in (0, 1)}
    # No launcher: the command once per node, told its node's place.
    job = job_command.build("none", NODES, "/w", "R", ["./run.sh"], results="out")
    assert job.commands == {i: f"cd /w && {LAUNCHER_ENV} SPOTRING_RUN_DIR=/w/out NODE_RANK={i} "
                               "NNODES=2 NPROC_PER_NODE=4 "
                               "MASTER_ADDR=10.0.1.10 MASTER_PORT=29400 exec ./run.sh"
                            for i in (0, 1)}


@pytest.mark.slow(cores=1)
@needs_horovod
def test_the_trainers_exit_code_comes_through_horovodrun(tmp_path):
    # horovodrun itself exits 1 whatever its ranks did; the launcher reads the rank's code
    # from horovodrun's own last words.
    proc = subprocess.run([str(BIN / "horovodrun"), "--gloo", "-np", "1", "-H", "localhost:1",
                           str(BIN / "python"), "-c", "import sys; sys.exit(75)"],
                          capture_output=True, text=True, timeout=120, cwd=tmp_path,
                          env=local_environment())
    job = job_command.build("horovodrun", NODES[:1], "/w", "R", ["python", "x.py"])
    assert proc.returncode == 1
    assert job.exit_code(proc.returncode, proc.stdout + proc.stderr) == 75
    assert job.exit_code(0, "") == 0


@pytest.mark.slow(cores=1)
def test_a_preemption_under_torchrun_is_told_by_rank_0s_note(tmp_path):
    # torchrun exits 1 when a worker exits 75; rank 0's preempted.json (brought back by
    # `run`) is what says the job was preempted rather than failed.
    (tmp_path / "w.py").write_text("import sys; sys.exit(75)")
    proc = subprocess.run([str(BIN / "torchrun"), "--standalone", "--nproc-per-node", "1",
                           "w.py"], capture_output=True, text=True, timeout=120, cwd=tmp_path,
                          env=local_environment())
    job = job_command.build("torchrun", NODES, "/w", "R", ["python", "w.py"])
    assert proc.returncode == 1
    assert job.exit_code(proc.returncode, proc.stdout + proc.stderr, note=PREEMPTED) == 75
    assert job.exit_code(proc.returncode, proc.stdout + proc.stderr) == 1
    assert job.exit_code(0, "", note=PREEMPTED) == 0  # a finished job's stale note
