"""Benchmarks and the scaling predictor: how far the trainer scales, and what it costs.

    make bench QUICK=1 && make report     # a few minutes; benchmarks/results/<run>/report.md
    make bench && make report             # the full run (about 45 minutes on 2 cores)
    python -m benchmarks.predict --preset horovod-resnet101 --deadline-hours 12

Each module runs on its own and writes a results folder (python -m benchmarks.X --help):

    suite.py           make bench: all of the below into one results.json, and the targets
    throughput.py      img/s for worker counts x batch sizes x engines, speedup, efficiency,
                       compute / communication per step
    mnist_engines.py   issue 3: 2-rank MNIST, ddp vs horovod (Gloo, MPI) vs the plain loop,
                       with the allreduce time per step
    allreduce.py       algbw / busbw against message size per transport (nccl-tests)
    step_split.py      compute, waiting and gradient allreduce of a 2-worker step of
                       each trainer engine, inside one job (free of launch-to-launch noise)
    batch_sizes.py     img/s per batch size per model (the Chameleon talk's table)
    mnist_overhead.py  trainer vs plain loop in time to 99% accuracy
    predict.py         the alpha-beta model: img/s, efficiency, time and cost for 1..256 nodes
                       (this_machine.py: its scenarios and validation from a results.json)
    report.py          make report: results.json -> report.md + PNGs (plots.py draws them)

and the pieces they share: runs.py (start a measured run the way users do: engines,
launchers, workloads), allreduce_ranks.py (what each rank of the allreduce benchmark
runs), plain_loop.py (the plain PyTorch/DDP baseline), trainer_sweep.py (a Hydra sweep
of the trainer in one process), stats.py, record.py (results folders), machine.py.
"""
