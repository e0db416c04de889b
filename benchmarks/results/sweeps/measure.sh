#!/bin/bash
# 16 trials of the default MNIST run (1 epoch each), random sampler seed 0: the same 16
# configurations each time.
cd /work/main
R=benchmarks/results/sweeps
for cfg in "sequential sweep.parallel=1" "parallel sweep.parallel=2" "parallel-median sweep.parallel=2 sweep.pruner=median"; do
  set -- $cfg; name=$1; shift
  rm -rf $R/$name
  start=$(date +%s.%N)
  .venv/bin/spotring sweep sweep=mnist_lr_wd sweep.sampler=random sweep.dir=$R/$name "$@" -- train.eval_every_steps=100 telemetry.progress=false > $R/$name.log 2>&1
  code=$?
  end=$(date +%s.%N)
  echo "$name exit $code wall $(echo "$end - $start" | bc) s" >> $R/timings.txt
done
