"""tools/gpu-check OUTDIR: spotring's GPU paths proved and measured in one command
(docs/gpu.md says what each check runs and when it passes).

    tools/gpu-check OUTDIR --bundle gpu-bundle        # on a GPU machine
    tools/gpu-check OUTDIR --device cpu --tiny        # the same, a few steps each, on a CPU

tools/gpu-check starts this by its path through tools/run_bundled.py, the bundle's wheels
installed first. First the tests marked gpu, tests/test_gpu.py, under pytest in a process
of its own (tools/gpu_tests.py gives them the device and size and reports each as it
ends), then the figures (tools/gpu_figures.py); a table row as each ends, and
OUTDIR/results.json and OUTDIR/report.md (from results.json alone) saved after each. The
tests' runs go under OUTDIR/tests/ (pytest's output: OUTDIR/tests.log), the figures'
under OUTDIR/runs/, without checkpoints.

    results.json   command, mode, device, devices, bundle, spotring (where it was imported
                   from), throughput_workload, started, machine (benchmarks/machine.py's,
                   the GPU's name, count, driver, CUDA and cuDNN among it), checks (each:
                   check, kind (test or figure), status, summary, seconds, figures,
                   commands), stopped_by (the signal that stopped the kit, or null),
                   wall_seconds, passed

Stopping: when --budget seconds have passed, or at SIGTERM, SIGINT or SIGHUP, every
process the kit started is killed (benchmarks/processes.py), pytest and the launchers'
ranks with it, nothing starts after, and the results say which checks were cut off
("stopped") and which never started ("skipped"). Exit code: 0 when every check that ran
to its end passed, 1 when one failed, 2 when the kit cannot start (no GPU, pytest or the
trainer's packages missing, bad input), 128 + N when signal N stopped it.

Until the trainer's packages are known to import, this imports only the standard
library, torch and the parts of benchmarks/ that need nothing more (not matplotlib, which
a GPU machine's Python with only torch may lack).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import asdict, dataclass, field
from importlib import metadata
from pathlib import Path

import torch

from spotring.benchmarks import machine, processes
from spotring.benchmarks.predict import positive

# The kit's other modules, beside this one (run by its path: its folder is not on the path).
sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_figures import FIGURES, FULL, TINY, Failed, Kit, Skipped  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
BUDGET = 540.0  # seconds: the 9 minutes of a 10-minute command, the rest to start and save
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
TESTS = REPO / "tests" / "test_gpu.py"
SUMMARY_CHARS = 300


STATUSES = ("passed", "failed", "stopped", "skipped")
COLUMNS = ["check", "result", "figures", "s"]


def cells(check: dict) -> list[str]:
    """A check's row of the tables, as printed when it ends and in report.md."""
    return [check["check"], check["status"], check["summary"], f"{check['seconds']:g}"]


def row(cells: list[str]) -> str:
    return "| " + " | ".join(c.replace("|", "/") for c in cells) + " |"


def table(header: list[str], rows: list[list[str]]) -> str:
    """A markdown table. (Not benchmarks.report's: that module draws with matplotlib,
    which a GPU machine's Python with only torch may lack.)"""
    return "\n".join(map(row, [header, ["---"] * len(header), *rows]))


def report(results: dict) -> str:
    """report.md, from results.json alone."""
    info, checks = results["machine"], results["checks"]
    gpu = info.get("gpu")
    where = f"{gpu['count']} x {gpu['name']}" if gpu else f"CPU ({info['cpu']})"
    counts = {s: sum(c["status"] == s for c in checks) for s in STATUSES}
    stopped = (f" **Stopped by {results['stopped_by']}**: the checks it cut off say "
               "\"stopped\", those it left unstarted \"skipped\"." if results["stopped_by"]
               else "")
    machine = [["torch, torchvision", f"{info['packages']['torch']}, "
                                      f"{info['packages']['torchvision']}"],
               ["Python, CPU", f"{info['python']}, {info['cpu']}, {info['cores']} cores, "
                               f"{info['memory_gib']} GiB"],
               ["spotring", f"{results['spotring']}, commit {info['commit']}; bundle "
                            f"{results['bundle']}"]]
    if gpu:
        machine[:0] = [["GPUs", f"{gpu['count']} x {gpu['name']} ({gpu['memory_gib']} GiB, "
                                f"compute capability {gpu['capability']})"],
                       ["driver, CUDA, cuDNN, NCCL", f"{gpu['driver']}, {gpu['cuda']}, "
                                                     f"{gpu['cudnn']}, {info['nccl']}"]]
    lines = [f"# spotring GPU check: {where}", "",
             f"{results['started']}, `{results['command']}`, {results['mode']} mode, "
             f"{results.get('wall_seconds', '...')} s: "
             + ", ".join(f"{n} {s}" for s, n in counts.items() if n) + "." + stopped, "",
             table(["machine", ""], machine), ""]
    for kind, title in (("test", "Tests (tests/test_gpu.py)"), ("figure", "Figures")):
        lines += [f"## {title}", "", table(COLUMNS, [cells(c) for c in checks
                                                     if c["kind"] == kind]), ""]
    lines += [f"The throughput runs train {results['throughput_workload']}.", ""]
    failed = [c for c in checks if c["status"] == "failed"]
    if failed:
        lines += ["## Failures", ""]
        for c in failed:
            lines += [f"{c['check']}:", "", *(f"    {line}" for line in
                                               c["figures"]["error"].splitlines()), ""]
    lines += ["## Commands", "", "Each figure's runs, as started (their folders: runs/; the "
              "tests': tests/, their output: tests.log).", ""]
    for c in checks:
        if c["commands"]:
            lines += [f"{c['check']}:", "", *(f"    {command}" for command in c["commands"]), ""]
    return "\n".join(lines)


def save(out: Path, results: dict) -> None:
    """results.json and report.md, each whole: a kit cut off while saving leaves the
    previous pair."""
    from spotring.stores import write_atomic  # boto3's: once the trainer's packages import

    write_atomic(out / "results.json", (json.dumps(results, indent=1) + "\n").encode())
    write_atomic(out / "report.md", report(results).encode())


class Unusable(Exception):
    """The kit cannot start here (exit 2); the message says what to do."""


@dataclass
class Result:
    """A check's row, a test's or a figure's; a figure fills it as it goes, so that a
    failure late in it keeps what was measured before."""

    check: str
    kind: str = "figure"  # figure | test
    status: str = "passed"  # passed | failed | stopped (cut off) | skipped (not run)
    summary: str = ""  # the table's cell: the figures, or why it failed or did not run
    seconds: float = 0.0
    figures: dict = field(default_factory=dict)
    commands: list[str] = field(default_factory=list)


def run_figure(kit: Kit, name: str) -> Result:
    """One figure (gpu_figures.FIGURES), its failure, skip or stop caught and said in one
    line."""
    (figure, many), result, start = FIGURES[name], Result(name), time.monotonic()
    try:
        if many and kit.devices < 2:
            raise Skipped(f"needs 2 {kit.device} devices or more; this machine has 1")
        if (why := processes.stop_reason()) is not None:
            raise Skipped(f"not started: {why}")
        figure(kit, result)
    except Skipped as e:
        result.status, result.summary = "skipped", str(e)
    except Exception as e:  # noqa: BLE001 - any failure is this check's, the others go on
        if (why := processes.stop_reason()) is not None:  # its processes were killed
            result.status = "stopped"
            result.summary = f"stopped after {time.monotonic() - start:.0f} s: {why}"
        else:
            why = str(e) if isinstance(e, Failed) else f"{type(e).__name__}: {e}"
            result.status, result.summary = "failed", " ".join(why.split())[:SUMMARY_CHARS]
            result.figures["error"] = why
    result.seconds = round(time.monotonic() - start, 1)
    return result


def row_of_test(said: dict) -> Result:
    """A gpu test's line from tools/gpu_tests.py as a row: its figures where it
    passed, why where it did not."""
    figures = said["figures"]
    shown = "; ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}"
                      for k, v in figures.items())
    summary = shown if said["outcome"] == "passed" else said["why"]
    if said["outcome"] == "failed":
        figures = {**figures, "error": said["error"]}
    return Result(said["test"].split("::", 1)[-1], "test", said["outcome"],
                  " ".join(summary.split())[:SUMMARY_CHARS], said["seconds"], figures)


def run_tests(kit: Kit, expression: str | None, record: Callable[[Result], None]) -> None:
    """tests/test_gpu.py under pytest (only those ``expression`` selects, as pytest -k
    does): a row to ``record`` as each test ends, then one for each it did not end."""
    command = [sys.executable, str(REPO / "tools" / "gpu_tests.py"), str(TESTS), "-v",
               "--gpu-device", kit.device, "--gpu-size", kit.mode.name,
               # Only what the kit has: no conftest, and the checkout's folders kept off
               # the path (its spotring/ is the base package alone; the bundle's is whole).
               "--noconftest", "--import-mode=importlib", "-p", "no:cacheprovider",
               "--basetemp", str(kit.out / "tests"), *(["-k", expression] if expression else [])]
    read, write = os.pipe()
    with os.fdopen(read) as lines:
        try:
            with (kit.out / "tests.log").open("w") as log:
                proc = processes.start([*command, "--gpu-results", f"/dev/fd/{write}"],
                                       cwd=REPO, stdout=log, stderr=subprocess.STDOUT,
                                       pass_fds=(write,))
        except processes.Stopped as e:
            record(Result("tests", "test", "skipped", f"not started: {e}"))
            return
        finally:
            os.close(write)  # pytest holds it now: the lines end when pytest does
        collected, ended, started = [], set(), {}
        for line in lines:  # one at a time, as the tests start and end
            said = json.loads(line)
            if "collected" in said:
                collected = said["collected"]
            elif "started" in said:
                started[said["started"]] = time.monotonic()
            else:
                ended.add(said["test"])
                record(row_of_test(said))
    code = proc.wait()
    for pieces in (kit.out / "tests").rglob("checkpoints"):  # results, not checkpoints
        shutil.rmtree(pieces, ignore_errors=True)
    stopped = processes.stop_reason()
    if not collected and code != 0:
        said = (kit.out / "tests.log").read_text()[-2000:]
        record(Result("tests", "test", "stopped" if stopped else "failed",
                      stopped or f"pytest exit {code}: {' '.join(said.split()[-40:])}",
                      figures={"error": said}))
    for test in (t for t in collected if t not in ended):
        name = test.split("::", 1)[-1]
        if test not in started:
            why = stopped or f"pytest ended first (exit {code}; see tests.log)"
            record(Result(name, "test", "skipped", f"not started: {why}"))
        elif stopped:
            seconds = round(time.monotonic() - started[test], 1)
            record(Result(name, "test", "stopped", f"stopped after {seconds:g} s: {stopped}",
                          seconds))
        else:
            record(Result(name, "test", "failed", f"pytest ended during it (exit {code}; see "
                          "tests.log)"))


@contextlib.contextmanager
def stoppable(budget: float) -> Iterator[list[signal.Signals]]:
    """Within the block, a stop signal (SIGTERM, SIGINT, SIGHUP) or the end of ``budget``
    seconds stops the kit: every process under it is killed and none starts after
    (processes.stop_all), while the block goes on to record what ran. Yields the list of
    the signals received. Whatever a check left behind is killed when the block ends."""
    received: list[signal.Signals] = []

    def on_signal(number: int, _frame) -> None:
        received.append(signal.Signals(number))
        # Killed from a thread: a handler runs between two bytecodes of the main thread,
        # which may be holding anything.
        threading.Thread(target=processes.stop_all,
                         args=(f"the kit got {received[-1].name}",)).start()

    previous = {s: signal.signal(s, on_signal) for s in STOP_SIGNALS}
    timer = threading.Timer(budget, processes.stop_all,
                            args=(f"the kit's time budget ran out (--budget {budget:g})",))
    timer.daemon = True
    processes.become_subreaper()  # a launcher's orphaned ranks stay where kill_all sees them
    timer.start()
    try:
        yield received
    finally:
        timer.cancel()
        for s, handler in previous.items():
            signal.signal(s, handler)
        processes.kill_all()


def check_here(args: argparse.Namespace) -> str:
    """Where spotring is imported from, once the kit is known to be able to run here
    (tools/gpu-check installed --bundle's wheels before this started); raises Unusable."""
    if args.device == "cuda" and not torch.cuda.is_available():
        raise Unusable(f"--device cuda: torch sees no GPU here (torch {torch.__version__}); "
                       "--device cpu --tiny runs on a CPU")
    try:
        from torch.utils import tensorboard  # noqa: F401  (what rank 0 writes with)

        import spotring.trainer.__main__  # noqa: F401
    except ImportError as e:
        where = (f"the bundle {args.bundle} does not bring it: a package is missing from "
                 "tools/gpu-bundle.txt" if args.bundle else
                 "the trainer's packages are missing here. Where the package index is "
                 "reachable, `make gpu-bundle` downloads them into gpu-bundle/; bring that "
                 "folder and give --bundle gpu-bundle (docs/gpu.md)")
        raise Unusable(f"{e}: {where}") from e
    if importlib.util.find_spec("pytest") is None:
        raise Unusable(f"pytest is not installed for {sys.executable}: the kit runs "
                       f"{TESTS.relative_to(REPO)} with it")
    if not TESTS.is_file():
        raise Unusable(f"{TESTS}: not there; start the kit in the checkout, whose tests/ "
                       "and data/ it uses")
    return f"{metadata.version('spotring')} from {Path(spotring.__file__).parents[1]}"


def parser() -> argparse.ArgumentParser:
    # No abbreviations: tools/run_bundled.py finds --bundle among the arguments by its
    # whole name, before this parses them.
    p = argparse.ArgumentParser(prog="tools/gpu-check", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                allow_abbrev=False)
    p.add_argument("out", type=Path, metavar="OUTDIR",
                   help="where report.md, results.json, tests/ and runs/ go")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                   help="cuda (default): every GPU torch sees; cpu: 2 CPU workers")
    p.add_argument("--tiny", action="store_true", help="a few steps of each check")
    p.add_argument("--bundle", type=Path, metavar="DIR",
                   help="the folder `make gpu-bundle` made, installed by tools/gpu-check "
                   "before this starts (default: none, this Python's own packages)")
    p.add_argument("--budget", type=positive, default=BUDGET, metavar="SECONDS",
                   help=f"seconds after which the checks still running are stopped and no "
                   f"other starts (default {BUDGET:g})")
    p.add_argument("--tests", metavar="EXPRESSION",
                   help="only the gpu tests this selects, as pytest -k does (default: all)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    argv = sys.argv[1:] if argv is None else argv
    try:
        source = check_here(args)
    except Unusable as e:
        print(f"gpu-check: {e}", file=sys.stderr)
        return 2
    mode = TINY if args.tiny else FULL
    devices = torch.cuda.device_count() if args.device == "cuda" else 2
    kit = Kit(args.out.resolve(), args.device, devices, mode)
    kit.out.mkdir(parents=True, exist_ok=True)
    start = time.monotonic()
    bundle = (f"{args.bundle} ({len(list(args.bundle.glob('*.whl')))} wheels)" if args.bundle
              else "none (this Python's own packages)")
    order = list(FIGURES)
    with stoppable(args.budget) as signals:
        results = {"command": shlex.join(["tools/gpu-check", *argv]), "mode": mode.name,
                   "device": args.device, "devices": devices, "bundle": bundle,
                   "spotring": source, "throughput_workload": mode.workload,
                   "started": time.strftime("%Y-%m-%d %H:%M:%S"),
                   "machine": machine.describe(), "checks": [], "stopped_by": None}
        gpu = results["machine"]["gpu"]
        print(f"gpu-check: {devices} x {gpu['name'] if gpu else 'CPU'}, {mode.name} mode, "
              f"into {kit.out}\n{row(COLUMNS)}", flush=True)

        def record(result: Result) -> None:
            """A row printed and saved: a test's second line replaces its first."""
            done = asdict(result)
            print(row(cells(done)), flush=True)
            checks = [c for c in results["checks"] if c["check"] != done["check"]] + [done]
            checks.sort(key=lambda c: 0 if c["kind"] == "test" else 1 + order.index(c["check"]))
            results.update(checks=checks, stopped_by=signals[0].name if signals else None,
                           wall_seconds=round(time.monotonic() - start, 1))
            save(kit.out, results)

        run_tests(kit, args.tests, record)
        with ThreadPoolExecutor(mode.parallel) as pool:
            for future in as_completed([pool.submit(run_figure, kit, n) for n in FIGURES]):
                record(future.result())
    results["stopped_by"] = signals[0].name if signals else None
    results["wall_seconds"] = round(time.monotonic() - start, 1)
    results["passed"] = all(c["status"] != "failed" for c in results["checks"])
    save(kit.out, results)
    verdict = ("STOPPED by " + signals[0].name if signals
               else "all that ran passed" if results["passed"] else "FAILED")
    print(f"gpu-check: {verdict} in {results['wall_seconds']:g} s; {kit.out / 'report.md'}",
          flush=True)
    if signals:
        return 128 + signals[0]
    return 0 if results["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
