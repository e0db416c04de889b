"""A user's own command on the local cluster, launched as a pip user does: spotring from
an installed wheel, run in a directory that holds only the user's project (train.py,
requirements.txt), never the spotring checkout.

    spotring launch cluster=local nodes=2 -- python train.py ...     a spot notice on node
        1 has the launcher replace it; the job resumes with the same samples and ends
        with the weights of an uninterrupted run; the replacement's environment is node
        0's, copied
    spotring up, then `spotring run` under torchrun, mpirun and none, and a failing
        command, on the same two nodes; then `spotring down`
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import zipfile
from pathlib import Path

import pytest

from spotring.exits import EXIT_CONFIG
from spotring.launch.local import netns
from spotring.launch.rundir import RunDir
from tests import user_script
from tests.installed import spotring_venv
from tests.launcher import Followed, leftovers, netns_unavailable, notice_node_1, processes

WHY_NOT = netns_unavailable()
STEPS = ["--steps", "48", "--batch", "8", "--save-every", "8"]
# A dependency of the project's own, installed on the nodes from requirements.txt.
TINYDEP = "tinydep-1.0-py3-none-any.whl"


@pytest.fixture(scope="module")
def venv(tmp_path_factory) -> Path:
    return spotring_venv(tmp_path_factory.mktemp("pip") / "venv")


def project(root: Path) -> Path:
    """train.py, and requirements.txt naming a wheel of the project's own."""
    user_script.write_project(root, **{"requirements.txt": f"./wheels/{TINYDEP}\n"})
    (root / "wheels").mkdir()
    with zipfile.ZipFile(root / "wheels" / TINYDEP, "w") as whl:
        whl.writestr("tinydep.py", "ANSWER = 42\n")
        whl.writestr("tinydep-1.0.dist-info/METADATA",
                     "Metadata-Version: 2.1\nName: tinydep\nVersion: 1.0\n")
        whl.writestr("tinydep-1.0.dist-info/WHEEL",
                     "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\n"
                     "Tag: py3-none-any\n")
        whl.writestr("tinydep-1.0.dist-info/RECORD", "")
    return root


def spotring(venv: Path, cwd: Path, *args: str, **kwargs) -> subprocess.Popen:
    """The installed `spotring` command, as a user types it in ``cwd``; nothing of the
    checkout on its path."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env["PATH"] = f"{venv / 'bin'}:{env['PATH']}"
    return subprocess.Popen([str(venv / "bin" / "spotring"), *args], cwd=cwd, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            **kwargs)


def test_bad_input_exits_2_before_any_node(tmp_path):
    """Checked in-process: the same code path, no cluster needed (not even root)."""
    from spotring.launch.__main__ import main

    root = user_script.write_project(tmp_path / "p")
    cases = {
        "job.max_project_mb=0.001": ("train.py", "MB", ".spotringignore"),
        "-- python missing.py": ("missing.py", "no such file"),
    }
    for words, said in cases.items():
        before = set(tmp_path.iterdir())
        out = _main_in(root, main, ["launch", "cluster=local", "nodes=2",
                                    f"runs_dir={tmp_path / 'runs'}",
                                    *words.split(), *(["--", "python", "train.py"]
                                                      if "--" not in words else [])])
        code, text = out
        assert code == EXIT_CONFIG, text
        assert all(s in text for s in said), text
        assert set(tmp_path.iterdir()) == before  # no run directory: nothing was made
    (root / "requirements.txt").write_text("torch>>=2\n")
    code, text = _main_in(root, main, ["up", "cluster=local", f"runs_dir={tmp_path / 'runs'}",
                                       "--", "python", "train.py"])
    assert code == EXIT_CONFIG and "requirements.txt" in text and "line 1" in text, text


def _main_in(cwd: Path, main, argv: list[str]) -> tuple[int, str]:
    """launch's main in ``cwd``, with what it printed."""
    import contextlib
    import io

    here, out = Path.cwd(), io.StringIO()
    os.chdir(cwd)
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
            code = main(argv)
    finally:
        os.chdir(here)
    return code, out.getvalue()


def launch_with_a_notice(venv: Path, root: Path, runs: Path, *overrides: str
                         ) -> tuple[int, str, RunDir, float]:
    """`spotring launch cluster=local nodes=2 -- python train.py ...` from ``root``, with a
    spot notice for node 1 once training runs, which stays up (as EC2's does until it
    takes the node): the launcher takes node 1 down and replaces it. Returns the exit
    code, the output, the run and when the notice came (also for
    benchmarks/results/recovery-local/measure.py)."""
    proc = spotring(venv, root, "launch", "cluster=local", "nodes=2",
                    "cluster.max_preemptions=1", "cluster.notice_poll_s=1", f"runs_dir={runs}",
                    *overrides, "--", "python", "train.py", *STEPS, "--sleep", "0.25")
    followed = Followed(proc)
    run, _, noticed, metadata = notice_node_1(followed, trained=1)
    try:
        code, out = followed.end()
    finally:
        metadata.close()
    return code, out, run, noticed


@pytest.mark.slow
@pytest.mark.skipif(WHY_NOT is not None, reason=WHY_NOT or "")
def test_a_users_script_survives_a_spot_notice_from_a_pip_install(venv, tmp_path):
    reference = user_script.reference(tmp_path / "ref", *STEPS)
    code, out, run, _ = launch_with_a_notice(venv, project(tmp_path / "project"),
                                             tmp_path / "runs")
    assert code == 0, out[-6000:]
    names = netns.Names(run.id)

    # The project went over and the job's results came back; the same weights as one
    # worker uninterrupted, in float64.
    summary = json.loads((run.job / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["steps"] == 48
    assert summary["weights"] == pytest.approx(reference["weights"], rel=1e-10)
    resumed = [int(s) for s in re.findall(r"resumed from \S+ at step (\d+)", out)]
    assert len(resumed) == 1 and 0 < resumed[0] < 48

    # The environment: built on both nodes at first (tinydep from the project's
    # requirements), then node 0's kept and copied to the replacement, which ran no pip.
    env = re.findall(r"run: node (\d) \((\S+)\): environment (\w+) (.*)", out)
    first, second = env[:2], env[2:]
    assert [how.split(" in ")[0] for _, _, _, how in first] == ["built", "built"]
    assert [(i, ns) for i, ns, _, _ in second] == [("0", names.ns(0)), ("1", names.ns(2))]
    assert second[0][3] == "ready" and second[1][3].startswith(f"copied from {names.ns(0)} in ")
    assert len({key for _, _, key, _ in env}) == 1
    built = (run.path / f"setup-{names.ns(0)}.log").read_text()
    assert "Successfully installed tinydep-1.0" in built
    copied = (run.path / f"setup-{names.ns(2)}.log").read_text()
    assert not re.search(r"Collecting|Downloading|Building|Installing", copied), copied

    # The ledger names the preemption and the node it took; nothing is left.
    ledger = json.loads(run.ledger.read_text())
    (restart,) = ledger["restarts"]
    assert (restart["cause"], restart["exit"], restart["lost_nodes"]) == (
        "preemption", 75, [names.ns(1)])
    assert restart["resumed_from"] == resumed[0] and restart["steps_redone"] == 0
    assert leftovers(run.id) == [] and processes(run.id) == []


@pytest.mark.slow
@pytest.mark.skipif(WHY_NOT is not None, reason=WHY_NOT or "")
def test_every_launcher_runs_the_command_on_the_nodes_up_brought_up(venv, tmp_path):
    reference = user_script.reference(tmp_path / "ref", *STEPS)
    root = project(tmp_path / "project")
    (root / "plain.py").write_text(user_script.PLAIN)
    runs = tmp_path / "runs"

    def spot(subcommand: str, *args: str) -> tuple[int, str]:
        proc = spotring(venv, root, subcommand, f"runs_dir={runs}", *args)
        out, _ = proc.communicate(timeout=400)
        return proc.returncode, out

    code, out = spot("up", "cluster=local", "nodes=2")
    assert code == 0, out
    run = RunDir.find(runs, None)
    try:
        # What each launcher looks like from the inside (spotring.runtime).
        for launcher, seen in {"torchrun": "torchrun", "mpirun": "mpi"}.items():
            code, out = spot("run", f"job.launcher={launcher}", f"job.results=runs/{launcher}",
                             "--", "python", "train.py", *STEPS)
            assert code == 0, out
            summary = json.loads((run.job / "summary.json").read_text())
            assert (summary["world_size"], summary["launcher"]) == (2, seen)
            assert summary["weights"] == pytest.approx(reference["weights"], rel=1e-10)
        # No launcher: once per node, with its rank; the node's results come back.
        code, out = spot("run", "job.launcher=none", "job.results=out", "--", "python",
                         "plain.py", "hi")
        assert code == 0, out
        assert "hello from node-0: hi" in out
        assert "hello from node-1: hi" in (run.path / "job-node-1.log").read_text()
        assert (run.job / "result.txt").read_text() == "made on the node\n"
        # A failing command: its exit code, and its last lines in the launcher's words.
        code, out = spot("run", "job.launcher=none", "--", "python", "-c",
                         "import sys; print('the last words'); sys.exit(3)")
        assert code == 3, out
        assert re.search(r"the job exited with code 3 \(failed\); its last lines on node 0:"
                         r"\n(  .*\n)*  the last words", out), out
    finally:
        code, out = spot("down")
    assert code == 0 and leftovers(run.id) == [] and processes(run.id) == [], out

