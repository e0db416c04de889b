"""python -m spotring.trainer: synchronous data-parallel training, configured by Hydra.

One machine, the default (MNIST, 2 workers on CPU or one per GPU):

    make train
    torchrun --standalone --nproc-per-node 2 -m spotring.trainer

Other datasets, models, engines; anything in `python -m spotring.trainer --cfg job`:

    torchrun --nproc-per-node 4 -m spotring.trainer dataset=cifar10 model=resnet20 train.epochs=30
    horovodrun -np 2 -H localhost:2 python -m spotring.trainer engine=horovod
    mpirun -np 2 python -m spotring.trainer engine=ddp            # or engine=horovod

Several machines (every host has this repository and its .venv at the same path):

    horovodrun -np 16 -H a:8,b:8 python -m spotring.trainer engine=horovod
    torchrun --nnodes 2 --nproc-per-node 8 --rdzv-endpoint a:29500 -m spotring.trainer
    make launch NODES=8                                   # EC2 spot instances

Resume: run the same command with the same run directory (resume=auto is the
default), e.g. `hydra.run.dir=runs/mnist`, or give `resume=PATH/ckpt-000000500.json`.
Started by spotring's launchers, the run directory is $SPOTRING_RUN_DIR and
checkpoint.uri defaults to $SPOTRING_CHECKPOINT_URI, as for any script (spotring.init).
Every rank reads this; only rank 0 writes logs and TensorBoard files, and every rank its
part of each checkpoint, in rank 0's checkpoint directory.
"""

from __future__ import annotations

import logging
import sys

import hydra
from hydra._internal.utils import get_args_parser
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.errors import HydraException
from omegaconf import DictConfig

from spotring import contract, runtime
from spotring.exits import EXIT_CONFIG, ConfigError
from spotring.global_batch import split_global_batch
from spotring.trainer import config, job, validation


@hydra.main(version_base="1.3", config_path="pkg://spotring.conf", config_name="config")
def _hydra_main(cfg: DictConfig) -> None:
    sys.exit(job.run(cfg))


def check_overrides(argv: list[str]) -> None:
    """Compose the config of every run the command line asks for, so that a bad group
    option (dataset=imagenet), key or type (optim.lr=abc) is a ConfigError (exit 2) here,
    where Hydra itself would exit 1, and validate it, so that a bad value or combination
    (train.precision=bf16 train.dtype=float64) stops the run before Hydra makes its run
    directory. A sweep (-m a=1,2) is checked one value at a time. `--cfg` only prints the
    composed config, so that is composed but not validated."""
    args = get_args_parser().parse_args(argv)
    if args.help or args.hydra_help or args.info or args.shell_completion \
            or args.config_path or args.config_name or args.config_dir:
        return  # Hydra's own questions, or another config than spotring's
    try:
        parsed = OverridesParser.create().parse_overrides(args.overrides)
    except HydraException as e:
        raise ConfigError(f"{e}") from e

    def check(overrides: list[str]) -> None:
        cfg = config.compose(overrides)
        if not args.cfg:
            validation.validate(cfg)

    fixed = [o.input_line for o in parsed if not o.is_sweep_override()]
    sweeps = [o for o in parsed if o.is_sweep_override()]
    if not sweeps:
        check(fixed)
    else:
        config.compose(fixed)  # a bad fixed override is named once, not per value
    for sweep in sweeps:
        try:
            values = list(sweep.sweep_string_iterator())
        except HydraException:
            continue  # an interval or other range for a search: the sweeper samples it
        for value in values:
            check([*fixed, f"{sweep.get_key_element()}={value}"])


def check(args: list[str], world_sizes: list[int]) -> None:
    """What a launcher asks before it starts `spotring train ARGS` (spotring.cli.Command):
    the overrides compose and validate, and the run's global batch splits over every
    one of ``world_sizes`` (a run that comes back on fewer workers keeps it). Raises
    ConfigError naming the problem."""
    check_overrides(args)
    if world_sizes:
        # That of the largest, where train.global_batch is not given.
        cfg = config.compose(args)
        batch = config.global_batch(cfg, max(world_sizes))
        for world_size in world_sizes:
            split_global_batch(batch, world_size, cfg.train.batch_size)


def pin(args: list[str], world_size: int) -> list[str]:
    """``args`` with the global batch they make on ``world_size`` workers written out
    (train.global_batch), unless they give one: on any other number of workers the run
    then takes the same samples in the same steps (spotring.cli.Command)."""
    cfg = config.compose(args)
    if cfg.train.global_batch is not None:
        return list(args)
    return [*args, f"train.global_batch={config.global_batch(cfg, world_size)}"]


def main(argv: list[str] | None = None) -> int:
    """`spotring train ARGS` (``argv``), or `python -m spotring.trainer ARGS`."""
    if argv is not None:  # Hydra reads the command line itself
        sys.argv = [f"{sys.argv[0]} train", *argv]
    try:
        check_overrides(sys.argv[1:])
    except ConfigError as e:
        job.report_bad_input(e, runtime.detect())
        return EXIT_CONFIG
    rank = runtime.env_rank()
    if rank > 0:
        # Only rank 0 keeps a log file; the others must not write Hydra's files (or leave
        # empty directories stamped with their own start times) and only speak up, on
        # stderr, when something is wrong. They keep the run directory a launcher gives
        # ($SPOTRING_RUN_DIR): where a job in place loses rank 0's process, one of them
        # becomes rank 0, and writes the metrics and the summary there.
        logging.basicConfig(level=logging.WARNING,
                            format=f"[rank {rank}] %(levelname)s %(name)s: %(message)s")
        sys.argv += ["hydra.output_subdir=null", "hydra/job_logging=none",
                     "hydra/hydra_logging=none"]
        if not (contract.run_dir() or any(a.startswith("hydra.run.dir=") for a in sys.argv)):
            sys.argv.append("hydra.run.dir=.")
    config.register()
    _hydra_main()
    return 0  # not reached: the task exits with the job's code


if __name__ == "__main__":
    sys.exit(main())
