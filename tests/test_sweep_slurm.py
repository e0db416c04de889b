"""A sweep whose trials are SLURM jobs, on the real SLURM of tests/slurm.py."""

from __future__ import annotations

import json

import pytest

from tests import slurm
from tests.test_sweep import load, run_sweep, table_row

WHY_NOT = slurm.unavailable()
pytestmark = pytest.mark.skipif(WHY_NOT is not None, reason=WHY_NOT or "")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    with slurm.running(tmp_path_factory.mktemp("slurm") / "cluster") as started:
        yield started


@pytest.mark.slow
def test_a_sweep_runs_each_trial_as_a_slurm_job(cluster, tmp_path):
    sweep_dir = tmp_path / "sweep"
    output = run_sweep(sweep_dir, "sweep=custom", "sweep.name=queued", "sweep.slurm=true",
                       "sweep.parallel=2", "sweep.trials=2", "sweep.sampler=grid",
                       trainer=("optim.lr=choice(0.05,0.1)", "train.epochs=0.02"),
                       env=cluster.env)
    study = load(sweep_dir, "queued")
    assert [t.state.name for t in study.trials] == ["COMPLETE", "COMPLETE"], output
    report = (sweep_dir / "sweep_report.md").read_text()
    for t in study.trials:
        # Started by srun, in a job of its own, and in the report.
        summary = json.loads((sweep_dir / "trials" / f"{t.number:03d}" / "summary.json")
                             .read_text())
        assert summary["launcher"] == "slurm"
        assert table_row(report, t.number)[1] == "complete"
        assert f"{100 * summary['test_accuracy']:.2f}" in table_row(report, t.number)
