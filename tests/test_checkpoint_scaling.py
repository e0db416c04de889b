"""benchmarks/checkpoint_scaling.py and its report: the bytes of each rank read from a
manifest, the stall of each kind of save, and its --quick mode end to end (torchrun, a moto
S3 server, SIGTERM to every rank); and the notice budget, one worker of the same run."""

from __future__ import annotations

import json

import pytest

from spotring.benchmarks import checkpoint_scaling as bench
from spotring.benchmarks import notice_budget
from spotring.benchmarks.checkpoint_ranks import blocks_for, state_bytes
from spotring.benchmarks.checkpoint_scaling_report import stalls
from spotring.preemption import NOTICE_SECONDS


def test_each_part_counts_for_the_rank_that_wrote_it():
    manifest = {"parts": {"__0_0.distcp": {"bytes": 10}, "__1_0.distcp": {"bytes": 7},
                          ".metadata": {"bytes": 2}, "spotring.pt": {"bytes": 1}}}
    assert bench.bytes_per_rank(manifest, 3) == [13, 7, 0]


def test_the_state_is_the_size_asked_for_within_a_block():
    for gigabytes in (0.2, 1.0, 2.0):
        size = state_bytes(blocks_for(gigabytes))
        assert abs(size - gigabytes * 1e9) <= state_bytes(1) / 2


@pytest.mark.slow
def test_the_quick_benchmark_runs_end_to_end(tmp_path):
    pytest.importorskip("moto.server")
    folder = tmp_path / "run"
    assert bench.main(["--quick", "--name", str(folder)]) == 0
    section = json.loads((folder / "results.json").read_text())["checkpoint_scaling"]
    cells = {cell["mode"]: cell for cell in section["cells"]}
    assert set(cells) == {"rank0", "sharded"} and not section["skipped"]
    for cell in cells.values():
        assert cell["workers"] == 2 and cell["s3"] and cell["peak_reset"]
        assert 0 < cell["save_to_local"] <= cell["notice_to_local"] <= cell["notice_to_s3"]
        assert sum(cell["rank_bytes"]) == cell["checkpoint_bytes"]
    assert cells["rank0"]["rank_bytes"][1] == 0  # rank 0 alone wrote it all
    # Every rank wrote its part: one count per worker, none of them 0.
    assert len(cells["sharded"]["rank_bytes"]) == 2 and all(cells["sharded"]["rank_bytes"])
    assert "of_rank0" in cells["sharded"]
    assert set(section["stall"]) == {"background", "blocking"}
    assert section["stall_ratio"]["stall"] == pytest.approx(
        section["stall"]["background"]["stall"] / section["stall"]["blocking"]["stall"])
    report = (folder / "report.md").read_text()
    assert "## (d) Periodic saves" in report
    assert f"stall over a blocking one's: {section['stall_ratio']['stall']:.3f}x" in report


@pytest.mark.slow(cores=1)
def test_the_notice_budget_is_the_margin_left_of_ec2_s_notice(tmp_path):
    pytest.importorskip("moto.server")
    folder = tmp_path / "run"
    assert notice_budget.main(["--gb", "0.01", "--repeats", "1", "--steps", "1",
                               "--name", str(folder)]) == 0
    section = json.loads((folder / "results.json").read_text())["notice_budget"]
    (run,) = section["runs"]
    assert run["workers"] == 1 and run["s3"]
    assert run["margin"] == pytest.approx(NOTICE_SECONDS - run["notice_to_s3"])
    assert 0 < run["notice_to_local"] <= run["notice_to_s3"] < NOTICE_SECONDS
    assert section["summary"]["margin"]["mean"] == run["margin"]
    assert f"| margin of EC2's {NOTICE_SECONDS} s (s) | {run['margin']:.2f} ± 0.00 |" in (
        folder / "report.md").read_text()


def test_a_save_that_waited_for_a_write_in_flight_is_left_out_of_its_stall():
    def step(n, seconds, save=None, in_flight=False):
        return {"step": n, "seconds": seconds, "save": save, "in_flight": in_flight}

    run = {"steps": [step(1, 9.0), step(2, 9.0), step(3, 1.0), step(4, 1.5, "background", True),
                     step(5, 1.0), step(6, 5.0, "blocking"), step(7, 1.0), step(8, 1.0),
                     step(9, 1.5, "background", True), step(10, 7.0, "blocking"),
                     step(11, 1.0)]}
    found = stalls(run)
    # Step 10 began with step 9's write in flight: its 6 s are that write's too.
    assert found["blocking"]["stall"] == 4.0 and found["blocking"]["waited"] == 1
    assert found["background"]["stall"] == 0.5 and found["background"]["waited"] == 0
