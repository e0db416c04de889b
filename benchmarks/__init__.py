"""Benchmarks and the scaling predictor: how far training scales, and what it costs.

    spotring bench --quick && spotring report    # a few minutes; <results>/<run>/report.md
    spotring predict --preset horovod-resnet101 --deadline-hours 12

(`make bench [QUICK=1]`, `make report [RUN=...]`, `python -m
spotring.benchmarks.suite|report|predict` run the same.) The method and the model:
docs/benchmarks.md. The modules:

    suite.py        spotring bench: the sections below into one results.json
    throughput.py   img/s for worker counts x engines x batch sizes; speedup, efficiency
    allreduce.py    algbw and busbw against message size per transport (nccl-tests)
    batch_sizes.py  img/s per model and batch size of one worker (the Chameleon talk's table)
    time_to_accuracy.py  training seconds to 99% test accuracy per worker count, beside
                    reference_loop.py (a fixed MNIST recipe, never tuned)
    predict.py      spotring predict: the alpha-beta model, 1 to 256 nodes, time and cost
    report.py       spotring report: results.json -> report.md, with plots.py's PNGs

and, run on their own (python -m spotring.benchmarks.X): notice_budget.py (a spot notice to the
checkpoint on S3), api_cost.py (what spotring's API costs a script, the DataLoader over
files; its loops api_cost_loops.py, its figures api_cost_report.py), fsdp_memory.py
(bytes per worker under engine=fsdp against ddp; each rank runs fsdp_ranks.py), gpu_check.py
(tools/gpu-check: every GPU path in one command; gpu_kit.py what its checks share,
gpu_mnist.py, gpu_equivalence.py and gpu_speed.py the checks, gpu_report.py its report,
gpu_bundle.py the wheels an offline GPU machine lacks, deterministic_trainer.py)

and what they share: runs.py (start a measured run as users do), processes.py (the
processes a benchmark starts, taken down whole), allreduce_ranks.py (each rank of the
allreduce benchmark), plain_loop.py (the plain PyTorch DDP baseline), trainer_sweep.py (a
Hydra sweep of the trainer in one process), stats.py, record.py (results folders),
machine.py (what a run ran on). The plots draw with spotring.plotting, which the sweep's
report shares.
"""

from spotring.cli import Command

# What this package adds to the `spotring` command (spotring/cli.py).
COMMANDS = {
    "bench": Command("spotring.benchmarks.suite:main",
                     "measure throughput, scaling and allreduce bandwidth into a results "
                     "folder"),
    "report": Command("spotring.benchmarks.report:main", "a results folder's report.md and plots"),
    "predict": Command("spotring.benchmarks.predict:main",
                       "predict img/s, time and cost for 1 to 256 nodes; the cheapest for a "
                       "deadline"),
}
