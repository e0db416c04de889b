"""A public spot preemption trace replayed on the local cluster: a job in place against
today's restart, for the same events (root; network namespaces with sshd:
`make system-deps`):

    git clone https://github.com/skypilot-org/spot-traces
    .venv/bin/python benchmarks/results/spot-trace/replay.py \\
        spot-traces/preemption/4-node/aws-08-03-2023/us-east-2a_v100_1.json

The trace (skypilot-org/spot-traces, of "Can't Be Late", NSDI '24) counts, every 5
minutes, how many of a 4-node cluster's spot V100 instances still run. Each drop in the
window ``--window FIRST:LAST`` (ticks) is that many nodes lost at that tick, and
``--tick-seconds`` compresses a tick. A draw seeded by ``--seed`` picks
which of the running nodes it hits (node 0's among them); the lost nodes are in turn a
spot notice (EC2's, from the node's metadata service) and a loss without notice (its
namespace deleted, every process in it killed at once).

Three launches of harness/user_script.py's train.py from an installed wheel, 4 nodes of
1 slot, a global batch of 12 (it splits over 4, 3, 2 and 1 workers), a sleep in every
step so that 4 ranks on a 2-core machine take steps at the pace of a GPU job:

    uninterrupted   no event: the figures the others are held against
    in_place        job.launcher=in_place: survivors train on, a replacement joins
    restart         the default launcher: every event restarts the job from a checkpoint

An event comes at its time in the compressed trace, or once the job trains on 4 workers
again, whichever is later (the trace's count was back at 4 before each of its drops in
the default window). A replacement is always to be had: the trace's recoveries are not
replayed, and a local node boots in seconds, not minutes.

Per launch: the seconds of training lost per event (its first to last step's wall time
against the uninterrupted run's), goodput (steps per second against the uninterrupted
run's), the node-seconds paid beyond the uninterrupted run's (the ledger's launch to
termination of each node), the node-seconds idle (nodes up while the job took no step,
beyond a step's time), and the final weights' largest relative difference from the
uninterrupted run's. Prints a row per launch; writes results.json and replay.png (steps
against seconds, the events marked) beside this file.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import random
import re
import signal
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

from harness.installed import spotring_venv  # noqa: E402
from harness.launcher import Followed, launch_with_spares, metadata_service_of, run_dir_of  # noqa: E402
from harness.local_launch import installed, project  # noqa: E402
from spotring.launch.local import netns  # noqa: E402
from spotring.launch.rundir import RunDir  # noqa: E402

NODES, GLOBAL_BATCH = 4, 12
MODES = {"uninterrupted": (), "in_place": ("job.launcher=in_place",), "restart": ()}
WORKERS = re.compile(r"in place: \d+ -> (\d+) workers")
KINDS = ("notice", "vanished")  # taken in turn


def drops(trace: Path, first: int, last: int, tick_s: float) -> list[tuple[float, int]]:
    """(seconds after the window's start, nodes lost) for each drop in the window."""
    count = json.loads(trace.read_text())["data"]
    return [((t - first) * tick_s, count[t - 1] - count[t]) for t in range(first + 1, last + 1)
            if count[t] < count[t - 1]]


class Stubs:
    """EC2's metadata service on every node of the run as soon as it exists (a job looks
    for one in its first seconds), closed when its node goes."""

    def __init__(self, names: netns.Names) -> None:
        self.names, self.stubs, self.done = names, {}, threading.Event()
        self.thread = threading.Thread(target=self._watch, daemon=True)
        self.thread.start()

    def _watch(self) -> None:
        while not self.done.wait(0.1):
            up = set(netns.namespaces(self.names.ns_prefix))
            for ns in up - set(self.stubs):
                # One that went as it came is not looked at again.
                with contextlib.suppress(Exception):
                    self.stubs[ns] = metadata_service_of(ns)
            for ns in set(self.stubs) - up:
                self.stubs.pop(ns).close()

    def close(self) -> None:
        self.done.set()
        self.thread.join()
        for stub in self.stubs.values():
            stub.close()


def train_records(run: RunDir) -> list[tuple[float, int]]:
    """(time, step) of every train record rank 0 wrote, on whichever node it ran."""
    records = set()
    for metrics in run.path.glob(f"nodes/*/work/runs/{run.id}/metrics.jsonl"):
        for line in metrics.read_text().splitlines():
            if line.endswith("}") and (r := json.loads(line))["kind"] == "train":
                records.add((r["time"], r["step"]))
    return sorted(records)


def ready(mode: str, followed: Followed, run: RunDir, since: float) -> bool:
    """The job trains on all its nodes again: as many nodes as it began with, a step
    taken after ``since`` (the last event's node gone), and in place every node's process
    a member again."""
    if len(netns.namespaces(netns.Names(run.id).ns_prefix)) < NODES:
        return False
    changes = WORKERS.findall(followed.text) if mode == "in_place" else []
    if changes and int(changes[-1]) != NODES:
        return False
    return train_records(run)[-1][0] > since


def replay(mode: str, events: list[tuple[float, int]], rng: random.Random, followed: Followed,
           ) -> tuple[RunDir, list[dict]]:
    """Each event of ``events`` on the launch ``followed``; what was done, and when."""
    followed.wait_for(lambda: run_dir_of(followed.text) is not None)
    run = run_dir_of(followed.text)
    names = netns.Names(run.id)
    stubs = Stubs(names)
    done, since = [], 0.0
    try:
        followed.wait_for(lambda: len(train_records(run)) > 0)
        start = time.time()
        for at, lost in events:
            followed.wait_for(lambda at=at, since=since: time.time() >= start + at
                              and ready(mode, followed, run, since))
            hit = rng.sample(sorted(netns.namespaces(names.ns_prefix)), lost)
            for ns in hit:
                kind = KINDS[len(done) % len(KINDS)]
                fired = time.time()
                if kind == "notice":
                    followed.wait_for(lambda ns=ns: ns in stubs.stubs)
                    stubs.stubs[ns].announce_interruption()
                else:
                    netns.delete_namespace(ns, stops=((signal.SIGKILL, 5.0),))
                done.append({"node": ns, "kind": kind, "trace_s": at, "at": fired - start})
                print(f"{mode}: {kind} on {ns} at {fired - start:.1f} s "
                      f"(the trace's {at:.0f} s)", flush=True)
            # Its effect seen before the next event waits for the job to be whole again.
            followed.wait_for(lambda hit=hit: not set(hit) & set(
                netns.namespaces(names.ns_prefix)))
            since = time.time()
    finally:
        stubs.close()
    return run, done


def launch(mode: str, venv: Path, tmp: Path, steps: int, sleep: float) -> Followed:
    args = ["launch", "cluster=local", f"nodes={NODES}", "cluster.notice_poll_s=1",
            f"runs_dir={tmp / 'runs'}", "cluster.min_nodes=1", "cluster.max_preemptions=50",
            "cluster.max_restarts=50", *MODES[mode], "--", "python", "train.py",
            "--steps", str(steps), "--batch", str(GLOBAL_BATCH), "--save-every", "20",
            "--sleep", str(sleep), "--poll-seconds", "1"]
    root = project(tmp / f"project-{mode}")
    return Followed(launch_with_spares(50, *args, python=str(venv / "bin" / "python"),
                                       cwd=root, env=installed(venv)), timeout_s=1800)


def figures(mode: str, run: RunDir, events: list[dict], base: dict | None) -> dict:
    records = train_records(run)
    span = records[-1][0] - records[0][0]
    steps = records[-1][1]
    pairs = list(itertools.pairwise(records))
    gaps = [b[0] - a[0] for a, b in pairs]
    ledger = json.loads(run.ledger.read_text())
    nodes = [(n["launched_at"], n["terminated_at"]) for n in ledger["nodes"]]
    summary = json.loads((run.job / "summary.json").read_text())
    row = {"mode": mode, "events": events, "steps": steps, "train_span_s": span,
           "progress": [(round(t - records[0][0], 3), step) for t, step in records],
           "steps_per_s": steps / span, "node_s": sum(e - s for s, e in nodes),
           "weights": summary["weights"], "in_place": summary.get("in_place"),
           "restarts": [{k: r[k] for k in ("cause", "step", "steps_redone", "lost_s")}
                        for r in ledger["restarts"]]}
    step_s = statistics.median(gaps) if base is None else base["step_s"]
    row["step_s"] = step_s
    # Nodes up while no step was taken: each gap beyond a step's time, times the nodes
    # billed at its middle.
    row["idle_node_s"] = sum(
        (g - step_s) * sum(s <= (a[0] + b[0]) / 2 <= e for s, e in nodes)
        for g, (a, b) in zip(gaps, pairs, strict=True) if g > 2 * step_s)
    if base is not None:
        row["seconds_lost"] = span - base["train_span_s"]
        row["seconds_lost_per_event"] = row["seconds_lost"] / max(1, len(events))
        row["goodput"] = row["steps_per_s"] / base["steps_per_s"]
        row["extra_node_s"] = row["node_s"] - base["node_s"]
        row["weights_max_rel_diff"] = max(
            abs(a - b) / max(abs(b), 1e-300)
            for a, b in zip(summary["weights"], base["weights"], strict=True))
    return row


def plot(result: dict, path: Path) -> None:
    """Each launch's steps against its seconds of training, the events marked."""
    from spotring.support.plotting import plt, save

    fig, ax = plt.subplots(figsize=(8, 4.5))
    for row in result["launches"]:
        seconds, steps = zip(*row["progress"], strict=True)
        line, = ax.plot(seconds, steps, label=row["mode"].replace("_", " "))
        for event in row["events"]:
            ax.axvline(event["at"], color=line.get_color(), alpha=0.4,
                       linestyle="--" if event["kind"] == "notice" else ":")
    ax.set(title=f"{result['trace']}, ticks {result['window']} at {result['tick_seconds']:g} s "
                 "each: a node lost at each line (dashed: a notice; dotted: none)",
           xlabel="seconds since the first step", ylabel="steps taken")
    ax.title.set_fontsize(9)
    ax.grid(alpha=0.3)
    ax.legend()
    save(fig, path)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("trace", type=Path, help="a preemption trace of skypilot-org/spot-traces")
    p.add_argument("--window", default="1100:1200", help="FIRST:LAST tick of the trace")
    p.add_argument("--tick-seconds", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--steps", type=int, default=480)
    p.add_argument("--sleep", type=float, default=0.25)
    p.add_argument("--modes", default=",".join(MODES),
                   help="the launches, uninterrupted first (the others are held against it)")
    p.add_argument("--work", type=Path, help="where the runs are kept (default: deleted)")
    args = p.parse_args()
    # SIGTERM unwinds as Ctrl-C does: each launch's `with` stops its launcher, which takes
    # down the nodes it started (by default SIGTERM would leave them running).
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    first, last = (int(t) for t in args.window.split(":"))
    events = drops(args.trace, first, last, args.tick_seconds)
    print(f"{sum(n for _, n in events)} nodes lost at {[round(t) for t, _ in events]} s",
          flush=True)
    rows, base = [], None
    with tempfile.TemporaryDirectory() as tmp:
        work = args.work or Path(tmp)
        venv = spotring_venv(work / "venv")
        for mode in args.modes.split(","):
            with launch(mode, venv, work, args.steps, args.sleep) as followed:
                run, done = replay(mode, [] if mode == "uninterrupted" else events,
                                   random.Random(args.seed), followed)
                code, out = followed.end()
            (run.path / "launch.log").write_text(out)
            assert code == 0, out[-5000:]
            row = figures(mode, run, done, base)
            base = row if mode == "uninterrupted" else base
            print(json.dumps({k: v for k, v in row.items()
                              if k not in ("weights", "events", "progress")}),
                  flush=True)
            rows.append(row)
    result = {"trace": args.trace.name, "window": args.window, "tick_seconds": args.tick_seconds,
              "seed": args.seed, "drops": events, "launches": rows}
    here = Path(__file__).parent
    (here / "results.json").write_text(json.dumps(result, indent=2) + "\n")
    plot(result, here / "replay.png")


if __name__ == "__main__":
    main()
