"""The GPU kit's checks that two ways of training end in the same weights
(benchmarks/gpu_check.py runs them; benchmarks/gpu_kit.py is what they share):

    parity       N ranks over NCCL against one process alone with the N-fold batch, float64
    preemption   a run stopped by SIGTERM and resumed by the same command, against one
                 never stopped, bit for bit (deterministic algorithms on)
"""

from __future__ import annotations

import contextlib
import json
import signal
import sys
from pathlib import Path

import torch

from spotring import checkpoint
from spotring.benchmarks.gpu_kit import Failed, Kit, Result, torchrun
from spotring.benchmarks.runs import drop_heavy, shown, started, until_step
from spotring.exits import EXIT_PREEMPTED
from spotring.launch.commands import local_command

PARITY_RTOL = 1e-10  # float64: what tests/test_equivalence.py holds N ranks to
PARITY_BATCH = 32  # per rank
LOG = "output.log"  # in each preemption run's folder: what it printed


def final_weights(run_dir: Path) -> dict[str, torch.Tensor]:
    """The model of a trainer run's newest checkpoint."""
    return checkpoint.newest_valid(run_dir / "checkpoints").load()["model"]


def relative_difference(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """The largest of |a - b| / |b| over the tensors (norms, in float64)."""
    if a.keys() != b.keys():
        raise Failed(f"different parameters: {sorted(a.keys() ^ b.keys())}")
    return max(((a[k].double() - b[k].double()).norm()
                 / b[k].double().norm().clamp_min(1e-12)).item() for k in a)


def check_parity(kit: Kit, result: Result) -> None:
    """N ranks of PARITY_BATCH under torchrun against one process alone with N x
    PARITY_BATCH, in float64: the same global batches, so the same weights up to rounding.
    Both at once: only the weights are compared."""
    n = kit.devices
    common = ["train.dtype=float64", f"train.max_steps={kit.mode.parity_steps}",
              "train.seed=11", "train.eval_samples=1000"]
    many, one = kit.run_dir(f"parity-w{n}"), kit.run_dir("parity-w1")
    commands = [torchrun(n, kit.trainer_args(many, *common, f"train.batch_size={PARITY_BATCH}")),
                local_command("single", 1, kit.trainer_args(
                    one, *common, f"train.batch_size={n * PARITY_BATCH}"))]
    result.commands += map(shown, commands)
    kit.run(*commands)
    difference = relative_difference(final_weights(many), final_weights(one))
    for run_dir in (many, one):
        drop_heavy(run_dir)
    result.figures = {"ranks": n, "steps": kit.mode.parity_steps,
                      "relative_difference": difference, "rtol": PARITY_RTOL}
    result.summary = (f"{n} x {PARITY_BATCH} = 1 x {n * PARITY_BATCH} after "
                      f"{kit.mode.parity_steps} steps: relative difference {difference:.1e}")
    if not difference <= PARITY_RTOL:
        raise Failed(f"weights differ by {difference:.3g} relative (float64 allows "
                     f"{PARITY_RTOL:g})")


def check_preemption(kit: Kit, result: Result) -> None:
    """One run stopped by SIGTERM after sigterm_after steps must exit 75 with a checkpoint,
    and the same command must resume it to the weights of an uninterrupted run started
    beside it, bit for bit: deterministic algorithms on (benchmarks/deterministic_trainer)."""
    steps = ([] if kit.mode.preemption_steps is None
             else [f"train.max_steps={kit.mode.preemption_steps}"])

    def command(run_dir: Path) -> list[str]:
        # A record every step, so that the signal is sent as soon as the step is logged.
        return [sys.executable, "-m", "spotring.benchmarks.deterministic_trainer",
                *kit.trainer_args(run_dir, "telemetry.log_every=1", "preemption.notices=none",
                                  *steps)]

    whole, cut = kit.run_dir("preemption-whole"), kit.run_dir("preemption-cut")
    result.commands += [shown(command(whole)), shown(command(cut))]
    with contextlib.ExitStack() as stack:
        procs = [stack.enter_context(started(command(d), d / LOG)) for d in (whole, cut)]
        try:
            until_step(procs[1], cut, kit.mode.sigterm_after, kit.mode.run_timeout)
        except RuntimeError as e:
            raise Failed(f"{e}; its output: {cut / LOG}") from e
        procs[1].send_signal(signal.SIGTERM)
        codes = [p.wait(timeout=kit.mode.run_timeout) for p in procs]
    stopped = json.loads((cut / "preempted.json").read_text()) if codes[1] == EXIT_PREEMPTED \
        else None
    result.figures = {"exit_code": codes[1], "stopped_at": stopped and stopped["step"]}
    if codes[0] != 0:
        raise Failed(f"the uninterrupted run failed (exit {codes[0]}): {whole / LOG}")
    if stopped is None:
        raise Failed(f"SIGTERM after step {kit.mode.sigterm_after}: exit {codes[1]}, expected "
                     f"{EXIT_PREEMPTED}: {cut / LOG}")
    kit.run(command(cut))  # the same command again: it resumes
    total = json.loads((whole / "summary.json").read_text())["steps"]
    resumed = json.loads((cut / "summary.json").read_text())
    a, b = final_weights(cut), final_weights(whole)
    equal = a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    difference = relative_difference(a, b)
    for run_dir in (whole, cut):
        drop_heavy(run_dir)
    result.figures |= {"steps": total, "resumed_steps": resumed["steps"],
                       "resumed_from": resumed["resumed_from"], "bitwise_equal": equal,
                       "relative_difference": difference}
    result.summary = (f"SIGTERM: exit 75 at step {stopped['step']} of {total}; resumed: "
                      + ("weights equal bit for bit" if equal
                         else f"weights differ by {difference:.1e} relative"))
    if not (stopped["step"] < total and resumed["resumed_from"]
            and resumed["steps_this_run"] == total - stopped["step"]):
        raise Failed(f"stopped at step {stopped['step']} of {total}, then the same command "
                     f"ran {resumed['steps_this_run']} steps from {resumed['resumed_from']}")
    if not equal:
        raise Failed(f"the resumed run's weights differ from the uninterrupted run's by "
                     f"{difference:.3g} relative")
