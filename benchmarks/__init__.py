"""Benchmarks and the scaling predictor: what users measure (docs/benchmarks.md).

    spotring bench --quick && spotring report    # suite.py, report.py (plots.py)
    spotring predict --preset horovod-resnet101 --deadline-hours 12    # predict.py

`spotring bench`'s sections: throughput.py (img/s per engine x workers x batch; the plain
loop, plain_loop.py, beside the trainer), allreduce.py (bus bandwidth per transport; each
rank runs allreduce_ranks.py), batch_sizes.py, time_to_accuracy.py (beside
reference_loop.py). Run on their own (python -m spotring.benchmarks.X): notice_budget.py,
checkpoint_scaling.py (its ranks: checkpoint_ranks.py, its report:
checkpoint_scaling_report.py), fsdp_memory.py (its ranks: fsdp_ranks.py); the GPU kit
(tools/gpu-check) runs some of them too. Shared: runs.py (a measured run, started as users
start it), processes.py (taken down whole), stats.py, record.py (results folders),
machine.py.
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
