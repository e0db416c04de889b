"""spotring sweep on a cluster for real: a 2-node local cluster (`spotring up
cluster=local nodes=2`), a study of 2 short MNIST trials, one on each node at the same
time (torchrun over ssh), the results back in the sweep directory, then nothing left on
this machine."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from datetime import datetime

import optuna
import pytest
from optuna.storages import JournalStorage
from optuna.storages.journal import JournalFileBackend
from optuna.trial import TrialState

from spotring.launch.rundir import RunDir
from tests.conftest import REPO
from tests.launcher import launcher, leftovers, netns_unavailable, processes

WHY_NOT = netns_unavailable()
pytestmark = pytest.mark.skipif(WHY_NOT is not None, reason=WHY_NOT or "")
NAME = "on_cluster"


def running_interval(trial_dir) -> tuple[float, float]:
    """When the sweep started the trial's processes on its node and when they ended
    (trial.log's attempt lines, by this machine's clock). The trainers' own records span
    about a second of training, less than the jitter of their start-ups."""
    stamps = re.findall(r"^spotring sweep: (\S+ \S+) attempt (?:\d+ starts|ended)",
                        (trial_dir / "trial.log").read_text(), re.M)
    times = [datetime.fromisoformat(stamp).timestamp() for stamp in stamps]
    return min(times), max(times)


@pytest.mark.slow
def test_a_sweep_runs_one_trial_on_each_node_of_a_cluster_at_the_same_time(tmp_path):
    runs_dir, sweep_dir = tmp_path / "launch", tmp_path / "sweep"
    up = launcher("up", "cluster=local", "nodes=2", f"runs_dir={runs_dir}")
    assert up.returncode == 0, up.stdout + up.stderr  # a failed `up` leaves nothing
    run = RunDir.find(runs_dir, None)
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "spotring", "sweep", f"sweep.name={NAME}",
             f"sweep.cluster={run.id}", f"sweep.runs_dir={runs_dir}", "sweep.parallel=2",
             "sweep.trials=2", f"sweep.dir={sweep_dir}", "--", "train.epochs=0.03",
             "train.eval_samples=500", "telemetry.log_every=1", "telemetry.progress=false"],
            cwd=REPO, capture_output=True, text=True, timeout=300)
        out = proc.stdout + proc.stderr
        assert proc.returncode == 0, out[-6000:]

        storage = JournalStorage(JournalFileBackend(str(sweep_dir / "study.journal")))
        study = optuna.load_study(study_name=NAME, storage=storage)
        assert [t.state for t in study.trials] == [TrialState.COMPLETE] * 2, out[-6000:]

        # Each trial on a node of its own: named so by the sweep, its run directory in
        # that node's workdir alone, written by a trainer whose hostname is that node's.
        addresses = [n.address for n in run.nodes()]
        started = dict(re.findall(r"^sweep: trial (\d) starts on nodes (\S+):", out, re.M))
        assert sorted(started) == ["0", "1"] and sorted(started.values()) == addresses, out
        for number, address in started.items():
            trial_dir = sweep_dir / "trials" / f"00{number}"
            summary = json.loads((trial_dir / "summary.json").read_text())
            assert summary["world_size"] == 1, summary  # the node's one slot
            node = addresses.index(address)
            assert [i for i in range(2) if (run.path / f"nodes/node-{i}/work/runs/sweeps/"
                                            f"{NAME}/00{number}/summary.json").is_file()] == [node]
            assert list((trial_dir / "tensorboard").glob(f"*.node-{node}.*"))
            # What its processes printed, kept here (not replaced by the node's copy).
            assert "spotring: fast_convnet on mnist: test accuracy" in (
                trial_dir / "trial.log").read_text()

        # At the same time: each trial's processes still ran after the other's had started.
        (first_a, last_a), (first_b, last_b) = (
            running_interval(sweep_dir / "trials" / f"00{n}") for n in range(2))
        assert max(first_a, first_b) < min(last_a, last_b), [first_a, last_a, first_b, last_b]
    finally:
        down = launcher("down", f"runs_dir={runs_dir}")
        assert down.returncode == 0, down.stdout + down.stderr
    assert leftovers(run.id) == [] and processes(run.id) == []
