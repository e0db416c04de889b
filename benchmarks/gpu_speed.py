"""The GPU kit's speed checks (benchmarks/gpu_check.py runs them; benchmarks/gpu_kit.py is
what they share):

    throughput VARIANT   img/s and peak memory of one process, per precision, memory
                         order and compilation (VARIANTS)
    allreduce            nccl-tests' bus bandwidth against message size on every device
    fsdp                 tokens/s and peak memory of a GPT-2-small-size model on one
                         device, engine=fsdp against engine=ddp
    checkpoint           the training stall of a sharded checkpoint of a 4 GB state on
                         every device: a blocking save against a background one
"""

from __future__ import annotations

import json
from pathlib import Path

from spotring.benchmarks.allreduce import bandwidth, size_label
from spotring.benchmarks.gpu_kit import COMPOSING, Failed, Kit, Result, Skipped, rate, torchrun
from spotring.benchmarks.runs import (
    REPO,
    Setup,
    drop_heavy,
    json_line,
    measure,
    shown,
    synthetic,
)
from spotring.benchmarks.stats import mean_ci

# The throughput checks: precision, memory order, compilation.
VARIANTS = {
    "fp32": ("train.precision=fp32", "train.channels_last=false"),
    "bf16": ("train.precision=bf16", "train.channels_last=false"),
    "bf16 channels_last": ("train.precision=bf16", "train.channels_last=true"),
    "bf16 channels_last compile": ("train.precision=bf16", "train.channels_last=true",
                                   "train.compile=true"),
    "fp16": ("train.precision=fp16", "train.channels_last=false"),
}


def refused(overrides: tuple[str, ...]) -> list[str]:
    """What the trainer would refuse about ``overrides`` here (exit 2): its own words."""
    from spotring.trainer.config import compose
    from spotring.trainer.validation import gpu_path_problems

    with COMPOSING:
        return gpu_path_problems(compose(list(overrides)))


def check_throughput(kit: Kit, result: Result, variant: str) -> None:
    """img/s of one process over the measured intervals (warm-up and compilation left
    out), and its peak memory, for one precision / memory order / compile variant."""
    mode = kit.mode
    model, *model_args = mode.model
    workload = synthetic(model, mode.shape, *model_args, f"train.device={kit.device}",
                         *VARIANTS[variant], train_size=mode.timing.steps * mode.batch)
    if problems := refused(workload.overrides):
        raise Skipped("; ".join(problems))
    run = measure(Setup("ddp", 1, mode.batch, kit.threads), workload, mode.timing,
                  kit.run_dir(f"throughput-{variant.replace(' ', '-')}"))
    result.commands.append(run.command)
    summary = json.loads((Path(REPO, run.dir) / "summary.json").read_text())
    per_second = mean_ci(run.per_worker)
    result.figures = {"workload": " ".join(mode.model), "shape": list(mode.shape),
                      "batch": mode.batch, "images_per_second": per_second,
                      "intervals": run.per_worker, "peak_memory_mb": summary["peak_memory_mb"],
                      "precision": summary["precision"], "compile_seconds":
                      summary["compile_seconds"], "command": run.command}
    compiling = (f", {summary['compile_seconds']:.0f} s compiling" if summary["compile"]
                 else "")
    result.summary = f"{rate(per_second)}, peak {summary['peak_memory_mb']:.0f} MiB{compiling}"


def check_allreduce(kit: Kit, result: Result) -> None:
    """benchmarks/allreduce_ranks.py on every device: nccl-tests' bus bandwidth per size."""
    transport = "nccl" if kit.device == "cuda" else "gloo"
    command = torchrun(kit.devices, [transport, "--sizes", *map(str, kit.mode.allreduce_sizes),
                                     "--budget", str(kit.mode.allreduce_budget)],
                       module="spotring.benchmarks.allreduce_ranks")
    result.commands.append(shown(command))
    (stdout,) = kit.run(command)
    said = json_line(stdout, "transport")
    rows = [{"bytes": r["bytes"], "seconds": r["seconds"],
             **bandwidth(r["bytes"], r["seconds"], said["ranks"])} for r in said["results"]]
    best = max(rows, key=lambda r: r["busbw_gbps"])
    result.figures = {"transport": transport, "ranks": said["ranks"], "sizes": rows,
                      "command": shown(command)}
    result.summary = (f"{transport}, {said['ranks']} ranks: busbw {best['busbw_gbps']:.2f} GB/s "
                      f"at {size_label(best['bytes'])}, {rows[0]['seconds'] * 1e6:.0f} µs at "
                      f"{size_label(rows[0]['bytes'])}")


def check_fsdp(kit: Kit, result: Result) -> None:
    """benchmarks/fsdp_ranks.py as one rank under torchrun, with engine=ddp and then with
    engine=fsdp, each alone on the device: tokens/s and peak memory (the mode's model:
    GPT-2 small's shape, batch 8 x 1024 tokens, bf16 where the device computes it).
    Alone, FSDP shards over a group of one, so its shard is the whole model: the row
    measures what FSDP's machinery costs against DDP (the gathers and reduce-scatters
    through the group, the bfloat16 copies of its mixed precision, the hooks), not what
    it saves across workers, which benchmarks/fsdp_memory.py counts."""
    figures = {}
    for engine in ("ddp", "fsdp"):
        command = torchrun(1, ["--engine", engine, *kit.mode.fsdp, "--device", kit.device,
                               "--run-dir", str(kit.run_dir(f"fsdp-{engine}"))],
                           module="spotring.benchmarks.fsdp_ranks")
        result.commands.append(shown(command))
        (stdout,) = kit.run(command)
        figures[engine] = json_line(stdout, "fsdp_ranks")["fsdp_ranks"]
    result.figures = figures
    said = [f"{e} {f['tokens_per_second']:.0f} tokens/s, peak "
            f"{f['ranks'][0]['peak_memory_mib']:.0f} MiB" for e, f in figures.items()]
    run = figures["fsdp"]
    result.summary = (f"{run['parameters'] / 1e6:.3g}M parameters, {run['batch']} x "
                      f"{run['seq']} tokens, {run['precision']}: {'; '.join(said)}")
    shard, whole = (figures[e]["ranks"][0]["parameter_bytes"] for e in ("fsdp", "ddp"))
    if shard != whole:
        raise Failed(f"FSDP's shard on a group of one holds {shard} bytes of parameters, "
                     f"the model {whole}")


def check_checkpoint(kit: Kit, result: Result) -> None:
    """benchmarks/checkpoint_ranks.py's periodic mode on every device: a state of the
    mode's size (weights and AdamW's moments; 4 GB on a GPU) saved every few steps to
    local disk, the saves taking turns: in the background (each rank's share copied to
    pinned memory, written while training goes on), then blocking. The figures: each
    kind's stall (its step less a quiet one) and the blocking save's rate."""
    from spotring.benchmarks.checkpoint_scaling_report import stalls

    run_dir = kit.run_dir("checkpoint")
    command = torchrun(kit.devices, [*kit.mode.checkpoint, "--run-dir", str(run_dir),
                                     "--device", kit.device],
                       module="spotring.benchmarks.checkpoint_ranks")
    result.commands.append(shown(command))
    kit.run(command)
    drop_heavy(run_dir)
    run = json.loads((run_dir / "ranks" / "steps.json").read_text())
    found = stalls(run)
    if set(found) != {"background", "blocking"}:
        raise Failed(f"the run saved {sorted(found)}, not both kinds; see {run_dir}")
    background, blocking = found["background"]["stall"], found["blocking"]["stall"]
    result.figures = {"state_bytes": run["state_bytes"], "world_size": run["world_size"],
                      "save_every": run["save_every"], **found, "command": shown(command)}
    result.summary = (
        f"{run['state_bytes'] / 1e9:.2g} GB on {run['world_size']} ranks: a blocking save "
        f"stalls a step {blocking:.2f} s ({run['state_bytes'] / 1e9 / max(blocking, 1e-9):.2f}"
        f" GB/s), a background one {background:.2f} s "
        f"({background / max(blocking, 1e-9):.2f}x)")
