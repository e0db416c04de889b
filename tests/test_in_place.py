"""Elasticity in place (spotring/elastic/): a job whose workers are lost, leave on a
notice, and join, trains on without restarting a surviving process, and ends with one
uninterrupted run's weights; where the others cannot go on, today's path, said so; a bad
setting is refused before anything starts.

The ranks are spawned by the test (harness/ranks.py) and run harness/workloads.py's
``in_place``, ``residual``'s float64 training in a job in place, against a rendezvous store
served by `spotring rendezvous` in a process of its own, as a machine that outlives the
nodes would serve it. A lost worker is a rank SIGKILLed (its connections close, as a
vanished node's process's do when the kernel goes with it), or SIGSTOPped (silent, its
connections open, as a host cut off from the network); a notice is SIGTERM, as the OS
sends it.
"""

from __future__ import annotations

import json
import random
import re
import signal
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

import spotring
from harness import ranks, shard_workload, workloads
from harness.ranks import Ranks
from spotring.elastic.rendezvous import BEAT_S, Rendezvous, connect, serve
from spotring.exits import EXIT_CONFIG, EXIT_PEER_LOST, EXIT_PREEMPTED
from spotring.launch.commands import BIN
from spotring.shards import write
from tests.conftest import QUICK, Run, assert_close, run_trainer

STEPS = 16
AGAIN = "this worker answered the roll call too late: it joins again at the next step's start"


@pytest.fixture
def rendezvous(monkeypatch) -> Iterator[str]:
    """`spotring rendezvous` on a free port, as its user starts it; its host:port, set as
    $SPOTRING_RENDEZVOUS (and so in the ranks)."""
    server = subprocess.Popen([str(BIN / "spotring"), "rendezvous", "--host", "127.0.0.1",
                               "--port", "0"], stdout=subprocess.PIPE, text=True)
    try:
        line = server.stdout.readline()  # the event: the store answers from now on
        address = re.fullmatch(r"spotring: rendezvous at (\S+)\n", line)
        assert address, line
        monkeypatch.setenv("SPOTRING_RENDEZVOUS", address[1])
        yield address[1]
    finally:
        server.kill()
        server.wait()


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """One process alone, uninterrupted: (losses by step, weights)."""
    run_dir = tmp_path_factory.mktemp("reference")
    output = ranks.run(run_dir, 1, workloads.residual, steps=STEPS)
    return ranks.losses(output), workloads.weights(run_dir)


def changes(job: Ranks) -> int:
    """How many changes of workers the job has made (each member logs each)."""
    return len(set(re.findall(r"^spotring: in place: \d+ -> \d+ workers at step \d+ "
                              r"\((?:lost|leave|join)\)", job.output(), re.M)))


def rank_0(job: Ranks) -> int:
    """The process that is rank 0 now: the one that printed the newest step."""
    newest = {index: max(ranks.losses(job.output(index)), default=0)
              for index in job.running()}
    return max(newest, key=newest.get)


@pytest.mark.slow
def test_losses_notices_and_joins_change_the_workers_in_place_and_end_exact(
        tmp_path, rendezvous, reference):
    """A seeded schedule on 4 workers: rank 0's process is killed, one gets a notice,
    two new processes join, and another is stopped (silent: met by its heartbeat): the
    world size changes in place 5 times (4, 3, 2, 3, 4, 3), no surviving process
    restarts, every step stands once with the uninterrupted run's loss, and the weights
    end equal to 1e-10."""
    chance = random.Random(58)
    run_dir = tmp_path / "run"
    with Ranks(run_dir, 4, workloads.in_place, steps=STEPS) as job:
        def after(step: int, change: int) -> None:  # the change made, at least the step
            assert job.until(lambda: changes(job) >= change and job.step() >= step,
                             f"change {change} and step {step}", while_any=True)

        after(2, 0)
        job.signal(rank_0(job), signal.SIGKILL)  # rank 0's node gone: 3 left
        after(4, 1)
        job.signal(chance.choice(job.running()), signal.SIGTERM)  # a notice: 2 left
        after(6, 2)
        joined = [job.start_another()]  # 3
        after(8, 3)
        joined.append(job.start_another())  # 4
        after(10, 4)
        # Every member through the join (a rank stopped inside its state's sending is met
        # only at engine.timeout_s, as inside a checkpoint's collectives).
        assert job.until(lambda: all(re.search(r"-> 4 workers at step \d+ \(join(?:ed)?\)",
                                               job.output(i)) for i in job.running()),
                         "every member through the join", while_any=True), job.output()[-5000:]
        silent = chance.choice(job.running())
        job.signal(silent, signal.SIGSTOP)  # its host cut off: 3 left
        assert job.until(lambda: job.running() == [silent], "the others' end",
                         while_any=True), job.output()[-5000:]
        job.signal(silent, signal.SIGKILL)
        codes = job.wait()
        output = job.output()
    assert sorted(codes) == sorted([-9, -9, EXIT_PREEMPTED, 0, 0, 0]), (codes, output[-6000:])
    assert all(codes[index] == 0 for index in joined), codes
    # Every step's loss as its ranks printed it, where it stood and their sum of the
    # losses got through (a step whose sum met the lost worker stood without one).
    losses = ranks.losses(output)
    assert STEPS in losses and len(losses) >= STEPS - 2, output[-6000:]
    for step, loss in losses.items():
        assert abs(loss - reference[0][step]) <= 1e-10 * max(1.0, abs(reference[0][step])), step
    assert_close(workloads.weights(run_dir), reference[1], 1e-10)
    made = json.loads((run_dir / "summary.json").read_text())["in_place"]
    assert [c["workers"] for c in made] == [[4, 3], [3, 2], [2, 3], [3, 4], [4, 3]], made
    assert [c["why"] for c in made] == ["lost", "leave", "join", "join", "lost"], made
    assert all(0 < c["seconds"] < 30 for c in made), made


@pytest.mark.slow
@pytest.mark.ends  # FSDP's sharding anew and its all-reduce hook, at the oldest torch too
def test_hsdp_groups_leave_are_lost_and_join_whole_in_place_and_end_exact(tmp_path, rendezvous):
    """HSDP (engine.shard_size=2) on 4 workers in place, each group of 2 a whole copy of
    the model's state: a notice on one worker takes its whole group out (4 -> 2), two new
    processes join as a group (4), rank 0's group is killed (2), two join again (4), and
    one worker of a group is killed: its partner leaves too (exit 69, whichever of its
    collectives met the loss), and the whole group goes on (2). No surviving process
    restarts, every step that stood has the uninterrupted run's loss, and the weights end
    equal to 1e-10."""
    steps = 24
    reference = tmp_path / "reference"
    expected = ranks.losses(ranks.run(reference, 1, workloads.residual, steps=steps))
    run_dir = tmp_path / "run"
    with Ranks(run_dir, 4, workloads.in_place, steps=steps, shard_size=2) as job:
        def after(step: int, change: int) -> None:  # the change made, at least the step
            assert job.until(lambda: changes(job) >= change and job.step() >= step,
                             f"change {change} and step {step}", while_any=True), \
                job.output()[-5000:]

        def joined(workers: int) -> None:  # every member through the join
            assert job.until(lambda: all(re.search(
                rf"-> {workers} workers at step \d+ \(join(?:ed)?\)", job.output(i))
                for i in job.running()), "every member through the join", while_any=True), \
                job.output()[-5000:]

        after(2, 0)
        job.signal(3, signal.SIGTERM)  # a notice: its group, 2 and 3, leaves
        after(4, 1)
        job.start_another(), job.start_another()  # a group: 4 and 5
        after(6, 2)
        joined(4)
        job.signal(0, signal.SIGKILL), job.signal(1, signal.SIGKILL)  # rank 0's group
        after(8, 3)
        job.start_another(), job.start_another()  # 6 and 7
        after(10, 4)
        joined(4)
        job.signal(6, signal.SIGKILL)  # its partner, 7, leaves
        codes = job.wait()
        output = job.output()
    assert codes == [-9, -9, EXIT_PREEMPTED, EXIT_PREEMPTED, 0, 0, -9, EXIT_PEER_LOST], (
        codes, output[-6000:])
    losses = ranks.losses(output)
    assert steps in losses and len(losses) >= steps - 3, output[-6000:]
    for step, loss in losses.items():
        assert abs(loss - expected[step]) <= 1e-10 * max(1.0, abs(expected[step])), step
    summary = json.loads((run_dir / "summary.json").read_text())
    assert [c["workers"] for c in summary["in_place"]] == [
        [4, 2], [2, 4], [4, 2], [2, 4], [4, 2]], summary["in_place"]
    assert_close(workloads.weights(run_dir), workloads.weights(reference), 1e-10)


@pytest.mark.slow
def test_a_worker_counted_out_by_the_roll_call_joins_again_and_the_job_ends_exact(
        tmp_path, rendezvous, reference):
    """One of 3 workers is killed while another is stopped (a host too busy to answer):
    the roll call counts both out, and the one left trains on alone. The stopped one,
    let go on, finds itself no member and joins again, taking the state of the one ahead;
    the weights end equal to 1e-10."""
    run_dir = tmp_path / "run"
    with Ranks(run_dir, 3, workloads.in_place, steps=STEPS, hold_at=12) as job:
        assert job.until(lambda: job.step() >= 4, "step 4")
        job.signal(2, signal.SIGSTOP)
        job.signal(1, signal.SIGKILL)
        assert job.until(lambda: changes(job) >= 1, "the roll call's change",
                         while_any=True), job.output()[-5000:]
        job.signal(2, signal.SIGCONT)
        assert job.until(lambda: AGAIN in job.output(2), "the ask to join again",
                         while_any=True), job.output()[-5000:]
        workloads.release(run_dir)
        codes = job.wait()
        output = job.output()
    assert codes == [0, -9, 0], (codes, output[-5000:])
    made = json.loads((run_dir / "summary.json").read_text())["in_place"]
    assert [(c["why"], c["workers"]) for c in made] == [("lost", [3, 1]), ("join", [1, 2])]
    assert_close(workloads.weights(run_dir), reference[1], 1e-10)


def test_the_roll_call_closes_at_the_timeout_without_a_member_that_beats_but_never_answers():
    """A member whose heartbeat goes on while its training thread waits where no failure
    ends the wait (a collective of the checkpoint's that a peer left, say) would hold
    the roll call open for ever: it closes after the rendezvous's timeout without it,
    the same for every member that answered."""
    store = serve("127.0.0.1", 0)
    a, b, c = (Rendezvous(connect(f"127.0.0.1:{store.port}", 5), name, timeout_s=0.5)
               for name in "abc")
    before = a.record(0, ["a", "b", "c"], 0)
    stop = threading.Event()

    def beating() -> None:
        while not stop.wait(BEAT_S):
            c.beat()

    threads = [threading.Thread(target=beating)]
    answers = []
    threads.append(threading.Thread(target=lambda: answers.append(b.survivors(before))))
    for thread in threads:
        thread.start()
    try:
        after = a.survivors(before)
    finally:
        stop.set()
        for thread in threads:
            thread.join()
    assert (after.number, after.members) == (1, ("a", "b")) and answers == [after]


@pytest.mark.slow
def test_a_worker_counted_out_at_the_last_step_writes_nothing_and_exits_0_at_the_jobs_end(
        tmp_path, rendezvous, reference):
    """Rank 0 is stopped after the last step's update, the others waiting for it in the
    step's last collective, and one of them is killed: the roll call counts rank 0 out,
    and the one left ends the job as rank 0. The stopped one, let go on, ends its script
    too, but as no member: the summary and the weights are the new rank 0's, and it exits
    0 without ending the job."""
    run_dir = tmp_path / "run"
    with Ranks(run_dir, 3, workloads.in_place, steps=STEPS, hold_at=STEPS) as job:
        assert job.until(lambda: workloads.held(run_dir), f"rank 0 held at step {STEPS}")
        job.signal(0, signal.SIGSTOP)
        job.signal(1, signal.SIGKILL)
        workloads.release(run_dir)  # rank 0 goes on once let go on
        assert job.until(lambda: job.running() == [0], "the job's end on the one left",
                         while_any=True), job.output()[-5000:]
        job.signal(0, signal.SIGCONT)
        codes = job.wait()
        output = job.output()
    assert codes == [0, -9, 0], (codes, output[-5000:])
    summary = json.loads((run_dir / "summary.json").read_text())
    made = [(c["why"], c["workers"]) for c in summary["in_place"]]
    assert (made, summary["world_size"], summary["steps"]) == ([("lost", [3, 1])], 1, STEPS)
    assert_close(workloads.weights(run_dir), reference[1], 1e-10)
    assert "counted out at the job's last step" in job.output(0), job.output(0)[-3000:]
    assert "nothing is left to do; exit 0" in job.output(0), job.output(0)[-3000:]


@pytest.mark.slow
def test_streamed_shards_keep_every_global_batchs_keys_through_a_loss_and_a_join(
        tmp_path, s3, rendezvous):
    """spotring.Shards from S3 on 3 workers in place: one is killed, a new one joins; every
    step that stood (all but the one the loss dropped and took again) trained on the keys
    of the uninterrupted run's global batch, and the weights end equal."""
    uri = "s3://spotring/in-place"
    write(shard_workload.samples(), uri, samples_per_shard=shard_workload.SAMPLES_PER_SHARD,
          block_samples=shard_workload.BLOCK_SAMPLES, progress=False)
    steps = 24
    args = {"uri": uri, "steps": steps}
    reference = tmp_path / "reference"
    output = ranks.run(reference, 2, shard_workload.train, cache_dir=str(tmp_path / "c0"),
                       **args)
    expected = shard_workload.keys_by_step(output, 2)
    run_dir = tmp_path / "run"
    with Ranks(run_dir, 3, shard_workload.train, cache_dir=str(tmp_path / "c1"),
               in_place=True, timeout_s=30, hold_at=10, **args) as job:
        assert job.until(lambda: job.step() >= 6, "step 6")
        job.signal(1, signal.SIGKILL)  # 2 left
        assert job.until(lambda: changes(job) >= 1, "the loss's change",
                         while_any=True), job.output()[-5000:]
        joiner = job.start_another()  # 3 again, taken in once rank 0 goes on past step 10
        assert job.until(lambda: "asked to join" in job.output(joiner), "the joiner's ask",
                         while_any=True), job.output()[-5000:]
        workloads.release(run_dir)
        codes = job.wait()
        output = job.output()
    assert codes == [0, -9, 0, 0], (codes, output[-5000:])
    history = shard_workload.keys_in_place(output)
    assert all(history[s] == expected[s] for s in history), "a batch differs from the run's"
    assert len(history) >= steps - 1 and steps in history, sorted(history)
    assert {w for w in re.findall(r"^keys \d+ \d+/(\d+) ", output, re.M)} == {"2", "3"}
    assert_close(workloads.weights(run_dir), workloads.weights(reference), 1e-10)


@pytest.mark.slow
def test_the_trainer_in_place_through_rank_0_lost_a_join_a_notice_and_a_join_ends_exact(
        tmp_path, rendezvous):
    """`spotring train` on 2 workers in place, as `spotring launch job.launcher=in_place`
    starts it (SPOTRING_IN_PLACE, SPOTRING_RUN_DIR): rank 0's process is killed in the
    first step, a new one joins, it leaves on a notice, another joins. The trainer splits
    its global batch anew at each change (2, 1, 2, 1, 2 workers) and takes the dropped
    step again; it ends with the uninterrupted run's weights, and the process that became
    rank 0 (a launcher's rank 1) writes the metrics from then on and the summary, with
    every change, in the run directory. The training reads are held while a joiner starts
    (harness/held_data.py), so that the job waits for it rather than racing it. Under
    HSDP in groups of one: the trainer's path is DDP's, and FSDP's in place is sharded anew
    at each change and accumulates (one worker alone takes 2 micro-steps a step)."""
    hold = tmp_path / "hold"
    args = [*QUICK, "model._target_=harness.held_data.net", "+model.width=8",
            "dataset._target_=harness.held_data.data", "+dataset.train_size=3200",
            f"+dataset.hold={hold}", "data.workers=0", "train.global_batch=32",
            "train.batch_size=16", "train.epochs=2", "train.dtype=float64",
            "train.threads=1", "train.channels_last=false", "train.precision=fp32"]
    reference = run_trainer(tmp_path / "reference", *args, launcher="spawned")
    run_dir = tmp_path / "run"
    hold.touch()  # the first step waits: rank 0's process is lost in it
    with Ranks(run_dir, 2, ranks.trainer, env={"SPOTRING_IN_PLACE": "on"},
               argv=[*args, "engine=fsdp", "engine.shard_size=1"]) as job:
        def seen(text: str, index: int, times: int = 1) -> None:
            assert job.until(lambda: job.output(index).count(text) >= times, text,
                             while_any=True), job.output()[-5000:]

        def joins() -> int:  # one more process, taken in once it asked to join
            hold.touch()
            seen("asked to join", index := job.start_another())
            hold.unlink()
            seen("1 -> 2 workers", 1, times=index - 1)
            return index

        seen("training harness.held_data.net", 0)  # both through init and wrap
        job.signal(0, signal.SIGKILL)  # rank 0's process: the launcher's rank 1 is now
        hold.unlink()
        seen("2 -> 1 workers", 1)
        job.signal(joins(), signal.SIGTERM)
        seen("2 -> 1 workers", 1, times=2)
        joins()
        codes = job.wait()
    assert codes == [-9, 0, EXIT_PREEMPTED, 0], (codes, job.output()[-5000:])
    summary = json.loads((run_dir / "summary.json").read_text())
    assert [(c["why"], c["workers"]) for c in summary["in_place"]] == [
        ("lost", [2, 1]), ("join", [1, 2]), ("leave", [2, 1]), ("join", [1, 2])], summary
    assert summary["in_place"][0]["step"] == 0, summary  # the first step, dropped and taken again
    assert (summary["steps"], summary["world_size"], summary["accumulation"]) == (200, 2, 1)
    assert_close(Run(run_dir, None).params(), reference.params(), 1e-10)
    records = [json.loads(line) for line in _read(run_dir / "metrics.jsonl").splitlines()]
    trained = [r["step"] for r in records if r["kind"] == "train"]
    assert trained == sorted(set(trained)) and trained[-1] == 200, trained  # each once
    assert [r["step"] for r in records if r["kind"] == "test"] == [100, 200], records


def _read(path: Path) -> str:
    return path.read_text() if path.exists() else ""


@pytest.mark.slow
def test_too_few_to_go_on_take_todays_path_saying_why_and_the_run_resumes_exact(
        tmp_path, rendezvous, reference):
    """Two workers with elastic.min_workers=2: a lost one leaves the other below the
    minimum, which writes the checkpoint of its step, says why, and exits 75; the run
    then resumes from it (on 2 workers, a new job) to the uninterrupted run's weights."""
    run_dir = tmp_path / "run"
    with Ranks(run_dir, 2, workloads.in_place, steps=STEPS, min_workers=2) as job:
        assert job.until(lambda: job.step() >= 4, "step 4")
        job.signal(1, signal.SIGKILL)
        assert job.wait()[0] == EXIT_PREEMPTED, job.output()[-4000:]
        output = job.output(0)
    assert "fewer than elastic.min_workers=2: today's path (a checkpoint, exit 75)" in output
    step = json.loads((run_dir / "preempted.json").read_text())["step"]
    assert 4 <= step < STEPS, output[-4000:]
    # A new job in its own rendezvous: this one's generations are over.
    rest = ranks.run(run_dir, 2, workloads.residual, steps=STEPS)
    assert f"at step {step} " in rest, rest[-3000:]
    assert_close(workloads.weights(run_dir), reference[1], 1e-10)


def test_in_place_needs_a_rendezvous_store(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("SPOTRING_RENDEZVOUS", raising=False)
    with pytest.raises(SystemExit) as exit:
        spotring.init(in_place="auto")
    assert exit.value.code == EXIT_CONFIG
    assert "elastic.in_place=auto needs a rendezvous store that outlives every training " \
           "node" in capsys.readouterr().err
