"""tools/gpu-check OUTDIR: spotring's GPU paths, run, measured and checked in one command.

    tools/gpu-check OUTDIR --bundle gpu-bundle        # on a GPU machine (docs/gpu.md)
    tools/gpu-check OUTDIR --device cpu --tiny        # the same checks in minutes on a CPU

Made for a GPU machine at hand for half an hour with no network, whose Python has torch
but not spotring: tools/gpu-check first installs the wheels `make gpu-bundle` made (--bundle
DIR: spotring's own and the packages its trainer needs beside torch) into a cache, once per
bundle (tools/run_bundled.py), then starts this. It runs the checks below, prints a table
row as each ends, and writes OUTDIR/report.md and OUTDIR/results.json (the machine: GPU
name and count, driver, CUDA, cuDNN, torch, NCCL; each figure with the command that gave
it), saved again after every check; each run's own folder is under OUTDIR/runs/. Planned
to end within 9 minutes on one H100.

    check            what runs                                           passes when
    mnist 1          the default run (MNIST) under torchrun, 1 rank      every seed reaches
                     (an NCCL group of one), seeds 0-2: seconds to 99%   99% test accuracy
                     and img/s
    mnist all        the same on all N GPUs                              the same
    parity           N ranks over NCCL against one process alone with    weights within 1e-10
                     the N-fold batch, float64
    throughput ...   ResNet-50 on synthetic 3x224x224, batch 128, one    the run ends well
                     GPU: img/s and peak memory at fp32, bf16, bf16
                     channels_last, the same compiled, fp16 (scaler)
    preemption       SIGTERM mid-run (deterministic algorithms on):      exit 75, and the
                     the same command resumes, beside an uninterrupted   weights equal bit
                     run                                                 for bit
    allreduce        bus bandwidth against message size over NCCL        every size timed
    fsdp             GPT-2 small (124M), batch 8 x 1024 tokens, bf16,    both runs end well,
                     one rank under torchrun: tokens/s and peak memory   and FSDP's shard on
                     of engine=fsdp against engine=ddp (alone, FSDP      a group of one is
                     shards over a group of one: its cost, not its       the whole model
                     saving across GPUs, which fsdp_memory.py counts)
    checkpoint       a 4 GB state (weights, AdamW) on every GPU, saved   both kinds of save
                     every 5 steps to local disk, in the background and  ran
                     blocking by turns: each kind's stall of a step

The N-GPU checks are skipped on one GPU, and a configuration the trainer refuses here
(fp16 on a CPU, torch.compile with no compiler or no Triton) is skipped with its words.
A check that fails says why and the others go on.

Stopping: when --budget (540 s) runs out, the checks still running are stopped and those
not started are skipped. SIGTERM (a `timeout`, a machine's time limit), SIGINT (Ctrl-C)
or SIGHUP does the same at once. Either way every process the kit started, the checks'
launchers and their ranks, is killed, and the results say which checks ran to their end
("stopped": cut off; "skipped": not run).

Exit code: 0 when every check that ran to its end passed, 1 when one failed, 2 when the
kit cannot start (no GPU, the trainer's packages missing, bad input), 128 + N when signal
N stopped it (143: SIGTERM, 130: SIGINT).

--tiny: a few steps of each, for `make test` (tests/test_gpu_check.py), so that the kit
cannot rot: 70% for the MNIST target, one seed, a small convnet on 3x32x32 for ResNet-50,
a two-block toy GPT for GPT-2 small, a 0.02 GB state to checkpoint, and with --device
cpu two CPU workers over Gloo stand in for N GPUs.

The modules: gpu_kit.py (modes, the kit, a check's result), gpu_mnist.py,
gpu_equivalence.py (parity, preemption) and gpu_speed.py (throughput, allreduce, fsdp,
checkpoint) the checks, gpu_report.py results.json and report.md, processes.py the
processes and taking them down, gpu_bundle.py the bundle. Until the trainer's packages
are known to import, this imports only the standard library, torch and the parts of
benchmarks/ that need nothing more; the checks import the rest where they use it.
"""

from __future__ import annotations

import argparse
import contextlib
import shlex
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import asdict, dataclass
from functools import partial
from importlib import metadata
from pathlib import Path

import torch

from spotring.benchmarks import processes
from spotring.benchmarks.gpu_equivalence import check_parity, check_preemption
from spotring.benchmarks.gpu_kit import FULL, TINY, Failed, Kit, Result, Skipped
from spotring.benchmarks.gpu_mnist import check_mnist
from spotring.benchmarks.gpu_report import HEADER, check_row, describe, save
from spotring.benchmarks.gpu_speed import (
    VARIANTS,
    check_allreduce,
    check_checkpoint,
    check_fsdp,
    check_throughput,
)
from spotring.benchmarks.predict import positive

BUDGET = 540.0  # seconds: the 9 minutes of a 10-minute command, the rest to start and save
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


class Unusable(Exception):
    """The kit cannot start here (exit 2); the message says what to do."""


@dataclass(frozen=True)
class Check:
    name: str
    run: Callable[[Kit, Result], None]
    many: bool = False  # needs 2 devices or more


CHECKS = [
    Check("mnist 1", partial(check_mnist, workers=1)),
    Check("mnist all", lambda kit, result: check_mnist(kit, result, kit.devices), many=True),
    Check("parity", check_parity, many=True),
    *(Check(f"throughput {v}", partial(check_throughput, variant=v)) for v in VARIANTS),
    Check("preemption", check_preemption),
    Check("allreduce", check_allreduce, many=True),
    Check("fsdp", check_fsdp),
    Check("checkpoint", check_checkpoint),
]


def run_check(kit: Kit, check: Check) -> Result:
    """One check, its failure, skip or stop caught and said in one line."""
    result, start = Result(check.name), time.monotonic()
    try:
        if check.many and kit.devices < 2:
            raise Skipped(f"needs 2 {kit.device} devices or more; this machine has 1")
        if (why := processes.stop_reason()) is not None:
            raise Skipped(f"not started: {why}")
        check.run(kit, result)
    except Skipped as e:
        result.status, result.summary = "skipped", str(e)
    except Exception as e:  # noqa: BLE001 - any failure is this check's, the others go on
        if (why := processes.stop_reason()) is not None:  # its processes were killed
            result.status = "stopped"
            result.summary = f"stopped after {time.monotonic() - start:.0f} s: {why}"
        else:
            why = str(e) if isinstance(e, Failed) else f"{type(e).__name__}: {e}"
            result.status, result.summary = "failed", " ".join(why.split())[:300]
            result.figures["error"] = why
    result.seconds = round(time.monotonic() - start, 1)
    return result


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


def trainer_imports(bundle: Path | None) -> str:
    """Where spotring is imported from, once the trainer's packages are known to import
    (tools/gpu-check installed --bundle's wheels before this started)."""
    try:
        import torch.utils.tensorboard  # noqa: F401  (what rank 0 writes with)

        import spotring.trainer.__main__  # noqa: F401
    except ImportError as e:
        where = (f"the bundle {bundle} does not bring it: a package is missing from "
                 "tools/gpu-bundle.txt" if bundle else
                 "the trainer's packages are missing here. Where the package index is "
                 "reachable, `make gpu-bundle` downloads them into gpu-bundle/; bring that "
                 "folder and give --bundle gpu-bundle (docs/gpu.md)")
        raise Unusable(f"{e}: {where}") from e
    return f"{metadata.version('spotring')} from {Path(spotring.__file__).parents[1]}"


def parser() -> argparse.ArgumentParser:
    # No abbreviations: tools/run_bundled.py finds --bundle among the arguments by its
    # whole name, before this parses them.
    p = argparse.ArgumentParser(prog="tools/gpu-check", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                allow_abbrev=False)
    p.add_argument("out", type=Path, metavar="OUTDIR",
                   help="where report.md, results.json and runs/ go")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                   help="cuda (default): every GPU torch sees; cpu: 2 CPU workers")
    p.add_argument("--tiny", action="store_true", help="a few steps of each check")
    p.add_argument("--bundle", type=Path, metavar="DIR",
                   help="the folder `make gpu-bundle` made, installed by tools/gpu-check "
                   "before this starts (default: none, this Python's own packages)")
    p.add_argument("--budget", type=positive, default=BUDGET, metavar="SECONDS",
                   help=f"seconds after which the checks still running are stopped and no "
                   f"other starts (default {BUDGET:g})")
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    argv = sys.argv[1:] if argv is None else argv
    try:
        if args.device == "cuda" and not torch.cuda.is_available():
            raise Unusable("--device cuda: torch sees no GPU here (torch "
                           f"{torch.__version__}); --device cpu --tiny runs on a CPU")
        source = trainer_imports(args.bundle)
    except Unusable as e:
        print(f"gpu-check: {e}", file=sys.stderr)
        return 2
    mode = TINY if args.tiny else FULL
    devices = torch.cuda.device_count() if args.device == "cuda" else 2
    kit = Kit(args.out.resolve(), args.device, devices, mode)
    kit.runs.mkdir(parents=True, exist_ok=True)
    start = time.monotonic()
    bundle = (f"{args.bundle} ({len(list(args.bundle.glob('*.whl')))} wheels)" if args.bundle
              else "none (this Python's own packages)")
    with stoppable(args.budget) as signals:
        results = {"command": shlex.join(["tools/gpu-check", *argv]), "mode": mode.name,
                   "device": args.device, "devices": devices, "bundle": bundle,
                   "spotring": source, "throughput_workload": mode.workload,
                   "started": time.strftime("%Y-%m-%d %H:%M:%S"),
                   "machine": describe(args.device), "checks": [], "stopped_by": None}
        where = results["machine"].get("gpu", {}).get("name", "CPU")
        print(f"gpu-check: {devices} x {where}, {mode.name} mode, into {kit.out}\n{HEADER}",
              flush=True)
        order = [c.name for c in CHECKS]
        with ThreadPoolExecutor(mode.parallel) as pool:
            for future in as_completed([pool.submit(run_check, kit, c) for c in CHECKS]):
                result = asdict(future.result())
                print(check_row(result), flush=True)
                results["checks"].append(result)
                results["checks"].sort(key=lambda c: order.index(c["check"]))
                results["stopped_by"] = signals[0].name if signals else None
                save(kit.out, results)
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
