"""The ledger's arithmetic on a run dir written by hand: EC2's per-second billing with
its 60 s minimum, the prices of spot and on-demand nodes, volumes, and what a restart
lost. (A real launch's ledger, with a preemption, is in tests/test_launch_local.py.)"""

from __future__ import annotations

import json
import time

import pytest
from omegaconf import OmegaConf

from spotring.launch import ledger, tries
from spotring.launch.cost import after_run
from spotring.launch.provider import Node
from spotring.launch.rundir import RunDir

T0 = 1_800_000_000.0  # when the run's first nodes came: 08:00:00 UTC


def node(i: int, lifecycle: str, launched_at: float, price: float | None) -> Node:
    return Node(id=f"i-{i}", address=f"10.0.0.{i}", private_address=f"10.0.0.{i}", slots=1,
                type="g5.xlarge", zone="us-east-1a", lifecycle=lifecycle,
                launched_at=launched_at, price=price)


def attempt(started: float, ended: float, nodes: list[str], code: int, step: int,
            resumed: int, last: tuple[int, float], restart: str | None = None,
            lost: tuple[str, ...] = (), back_at: float | None = None, **note) -> dict:
    """One try as launch/tries.py records it."""
    return {"started_at": started, "ended_at": ended, "nodes": nodes, "exit": code,
            "step": step, "resumed_from": resumed, "reason": note.get("reason"),
            "noticed_at": note.get("noticed_at"), "saved_at": note.get("saved_at"),
            "checkpoint": note.get("checkpoint"), "last_record": list(last),
            "back_at": back_at, "restart": restart, "lost": list(lost)}


@pytest.fixture
def run(tmp_path) -> RunDir:
    """Two spot nodes at $0.40/hour, one reclaimed after 30 s (a notice at step 500)
    and replaced 45 s later by an on-demand node; `down` an hour after the start."""
    run = RunDir(tmp_path / "run")
    run.path.mkdir()
    OmegaConf.save({"cluster": {"name": "aws_spot", "volume_gb": 100,
                                "volume_usd_per_gb_month": 0.08,
                                "on_demand_prices": {"g5.xlarge": 1.006}}}, run.config)
    first, second = node(0, "spot", T0, 0.40), node(1, "spot", T0, 0.40)
    new = node(2, "on-demand", T0 + 75.4, None)  # up 3524.6 s: 3525 whole seconds billed
    run.save_nodes([first, second])
    run.retire([second], at=T0 + 30)
    run.save_nodes([first, new])
    run.save(destroyed_at=T0 + 3600, tries=[
        attempt(T0 + 5, T0 + 32, ["i-0", "i-1"], 75, 500, 0, (490, T0 + 29),
                restart="preemption", lost=("i-1",), back_at=T0 + 100, reason="spot notice",
                noticed_at=T0 + 28, saved_at=T0 + 30.5, checkpoint="ckpt-000000500.pt"),
        attempt(T0 + 80, T0 + 3590, ["i-0", "i-2"], 0, 10_000, 500, (10_000, T0 + 3589))])
    run.job.mkdir()
    (run.job / "summary.json").write_text(json.dumps({
        "steps": 10_000, "epochs": 2.0, "steps_this_run": 9_500, "train_seconds": 3500.0,
        "world_size": 2}))
    return run


def test_nodes_are_billed_by_the_second_with_a_minute_at_least(run):
    bill = ledger.build(run)
    lost, kept, new = bill["nodes"]
    assert (lost["id"], lost["terminated_at"], lost["billed_s"]) == ("i-1", T0 + 30, 60.0)
    assert lost["usd"] == pytest.approx(0.40 * 60 / 3600)  # 30 s run, a minute billed
    assert (kept["billed_s"], kept["usd"]) == (3600.0, pytest.approx(0.40))
    # On demand: the list price of cluster.on_demand_prices, for 3525 s.
    assert (new["usd_per_hour"], new["price_from"]) == (1.006, "cluster.on_demand_prices")
    assert (new["billed_s"], new["usd"]) == (3525, pytest.approx(1.006 * 3525 / 3600))
    # 100 GB of gp3 at $0.08 per GB-month of 730 hours, per node-second.
    volumes = 100 * 0.08 / 730 * (60 + 3600 + 3525) / 3600
    totals = bill["totals"]
    assert totals["volumes_usd"] == pytest.approx(volumes)
    usd = 0.40 * 60 / 3600 + 0.40 + 1.006 * 3525 / 3600 + volumes
    assert totals["usd"] == pytest.approx(usd)
    assert totals["usd_per_epoch"] == pytest.approx(usd / 2)
    assert totals["usd_per_1000_steps"] == pytest.approx(usd / 10)
    assert totals["on_demand_usd"] == pytest.approx(1.006 * (60 + 3600 + 3525) / 3600 + volumes)


def test_a_restart_is_billed_for_the_time_until_the_run_was_back_at_its_step(run):
    (restart,) = ledger.build(run)["restarts"]
    assert restart["cause"] == "preemption" and restart["lost_nodes"] == ["i-1"]
    assert (restart["noticed_at"], restart["saved_at"]) == (T0 + 28, T0 + 30.5)
    assert (restart["step"], restart["resumed_from"], restart["steps_redone"]) == (500, 500, 0)
    assert restart["waited_s"] == 48.0  # from the try's end to the next one's start
    # Step 490 at T0+29, again at T0+100: 71 s of two spot nodes at $0.40.
    assert restart["lost_s"] == 71.0
    assert restart["usd_lost"] == pytest.approx(2 * 0.40 * 71 / 3600)
    totals = ledger.build(run)["totals"]
    assert (totals["preemptions"], totals["failures"]) == (1, 0)
    assert totals["usd_lost_to_preemptions"] == pytest.approx(2 * 0.40 * 71 / 3600)


def test_cost_writes_the_ledger_and_shows_it(run):
    shown = after_run(run)
    written = json.loads(run.ledger.read_text())
    assert written["nodes"] == ledger.build(run, now=written["as_of"])["nodes"]
    assert shown[2] == f"cost: ledger ({run.ledger}, times UTC):"
    assert shown[3].startswith("  node i-1 g5.xlarge us-east-1a spot: 08:00:00-08:00:30, 60 s "
                               "at $0.4000/hour (the spot price at launch) = $0.0067")
    assert shown[6] == ("  preemption after try 1: exit 75 (spot notice) at step 500, noticed "
                        "08:00:28, checkpoint 08:00:30; resumed at step 500 (0 steps redone) "
                        "after 48.0 s waiting for nodes; 71.0 s lost, $0.0158")


def test_an_unknown_on_demand_price_is_said_so(run):
    OmegaConf.save({"cluster": {"name": "aws_spot"}}, run.config)  # an older launch.yaml
    bill = ledger.build(run)
    assert bill["nodes"][2]["usd"] is None and bill["totals"]["unpriced_nodes"] == 1
    assert bill["totals"]["on_demand_usd"] is None
    assert after_run(run)[-1].endswith("on demand unknown (cluster.on_demand_prices lacks a "
                                       "type)")


def test_a_node_still_up_is_billed_until_now(run):
    state = run.state()
    del state["destroyed_at"]
    (run.path / "state.json").write_text(json.dumps(state))
    bill = ledger.build(run, now=T0 + 120)
    assert not bill["complete"]
    assert [(n["terminated_at"], n["billed_s"]) for n in bill["nodes"]] == [
        (T0 + 30, 60.0), (None, 120.0), (None, 60.0)]


def test_a_command_that_keeps_no_checkpoint_has_all_its_steps_redone(tmp_path):
    """Read back as `launch` records a command's tries: its train records in
    metrics.jsonl, and no "resumed ... at step N" line in job.log (nothing to resume)."""
    run = RunDir(tmp_path / "run")
    run.job.mkdir(parents=True)
    OmegaConf.save({"cluster": {"name": "local"}}, run.config)
    run.save_nodes([node(0, "local", T0, 0.0)])

    def a_try(started: float, steps: range, code: int, restart: str | None) -> None:
        with open(run.job / "metrics.jsonl", "a") as f:
            f.writelines(json.dumps({"kind": "train", "step": s, "time": started + s}) + "\n"
                         for s in steps)
        run.job_log.write_text("step after step, and no checkpoint\n")
        tries.record(run, tries.outcome(run, started, ["i-0"], code), restart, [])

    start = time.time() - 1000  # before job.log is written: its lines count as the try's
    a_try(start, range(1, 31), 75, "preemption")
    a_try(start + 100, range(1, 41), 0, None)
    (restart,) = ledger.build(run)["restarts"]
    assert (restart["step"], restart["resumed_from"], restart["steps_redone"]) == (30, 0, 30)
    assert restart["back_at_step"] == 30  # at start+130, 100 s after the first try's step 30
    assert restart["lost_s"] == pytest.approx(100.0)
