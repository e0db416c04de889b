"""The sweep's structured config (conf/sweeper.yaml + a study of conf/sweep/) and the
checks that run before any trial: the search space in Hydra's sweep grammar, turned
into Optuna's distributions, and everything a trial would fail on.

    sweep.params        KEY: EXPRESSION, in Hydra's override grammar (what
                        hydra-optuna-sweeper reads too):
                          choice(a, b, c)                 categorical
                          range(1, 9, 2)                  integers 1, 3, 5, 7 (end excluded)
                          interval(0.001, 0.5)            floats in [low, high]
                          tag(log, interval(1e-5, 1e-2))  sampled on a log scale
                          tag(int, interval(16, 256))     integers in [low, high]
                        KEY is any trainer key (optim.lr, model.width) or config group
                        (model: choice(convnet, fast_convnet)).
    sweep.args          trainer overrides every trial gets (also: after `--`)
    sweep.objectives    [METRIC, ...], the first the main one; each a number the trainer
                        writes to summary.json, or dollars (needs a price), optimised in
                        the one direction that makes sense for it (METRICS)
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, DictConfig

from spotring.exits import ConfigError
from trainer import config as trainer_config
from trainer.config import choices, compose_checked, one_of

SamplerName = choices("SamplerName", "auto grid random tpe nsga2")
PrunerName = choices("PrunerName", "none median hyperband")


@dataclass
class SweepConfig:
    name: str = MISSING  # the study's name; the default sweep directory is named after it
    # Where the study, the trials' run directories and the report go. The same
    # directory continues the same study: finished trials are never run again.
    dir: str = "runs/sweeps/${.name}"
    params: dict[str, str] = field(default_factory=dict)  # KEY: Hydra sweep expression
    args: list[str] = field(default_factory=list)  # trainer overrides of every trial
    objectives: list[str] = field(default_factory=lambda: ["test_accuracy"])
    # auto: grid when every param is a choice or range and sweep.trials covers them
    # all... tpe for one objective, nsga2 for several.
    sampler: SamplerName = SamplerName.auto
    trials: int | None = None  # None: every grid point (grid), else required
    seed: int = 0
    # Trials at once, and the workers each gets: GPUs per trial where there are GPUs,
    # else processes per trial, the CPU cores split evenly between the trials.
    parallel: int = 1
    workers: int = 1
    # Stop poor trials early from their test accuracy at each evaluation
    # (train.eval_every_steps, or each epoch end); single objective only.
    pruner: PrunerName = PrunerName.none
    # A trial killed or preempted resumes from its own checkpoint up to this many times
    # before it is recorded as failed.
    max_retries: int = 2
    # $/hour of this machine (or of one cluster node): trials are billed for their wall
    # time and their share, and `dollars` becomes an objective and a report column.
    hourly_price: float | None = None
    # A cluster `spotring up` brought up (its run id, or "latest"): the trials run across
    # its nodes, sweep.nodes each, instead of on this machine.
    cluster: str | None = None
    nodes: int = 1
    launcher: str = "torchrun"  # on a cluster: torchrun | horovodrun | mpirun
    runs_dir: str = "runs/launch"  # where cluster= looks for the run
    # Each trial its own SLURM job (srun) of sweep.nodes nodes x sweep.workers tasks,
    # sweep.parallel of them queued at a time; the sweep dir on storage the nodes share.
    slurm: bool = False
    slurm_options: list[str] = field(default_factory=list)  # e.g. [--partition=gpu]


@dataclass
class SweeperConfig:
    sweep: SweepConfig = MISSING


def register() -> None:
    cs = ConfigStore.instance()
    cs.store(name="sweeper_schema", node=SweeperConfig)
    cs.store(group="schema/sweep", name="sweep", node=SweepConfig)




# What a trial's summary.json reports that a study can optimise (trainer/loop.py), and
# `dollars`, which the sweep adds where it has a price; each in its own direction.
METRICS = {"test_accuracy": "maximize", "images_per_second": "maximize",
           "test_loss": "minimize", "train_seconds": "minimize", "parameters": "minimize",
           "parameter_mb": "minimize", "peak_memory_mb": "minimize", "dollars": "minimize"}
# Reported at every evaluation (metrics.jsonl, kind=test): what a pruner can judge by.
PRUNABLE = {"test_accuracy": "accuracy", "test_loss": "loss"}
LAUNCHERS = ("torchrun", "horovodrun", "mpirun")


@dataclass(frozen=True)
class Param:
    """One dimension of the search: a trainer key and its Optuna distribution."""

    key: str
    expression: str  # as the user wrote it, for messages and the study's identity
    distribution: Any  # optuna.distributions.BaseDistribution
    grid: tuple | None  # every value, where the dimension is discrete

    def override(self, value: Any) -> str:
        if isinstance(value, float) and self.grid is None:
            # 4 significant digits: what the trial runs with is what the report shows.
            value = float(f"{value:.4g}")
        return f"{self.key}={override_text(value)}"

    def values_to_check(self) -> list[Any]:
        """Values whose composed configs stand for the whole dimension: every choice, or
        the ends of a range or interval."""
        if self.grid is not None and not self.expression.lstrip().startswith("range"):
            return list(self.grid)
        d = self.distribution
        if hasattr(d, "low"):
            return [d.low, d.high]
        return list(self.grid or [])


def override_text(value: Any) -> str:
    """A value as a Hydra override writes it: true/false, [a,b] lists, floats exactly."""
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, list | tuple):
        return "[" + ",".join(override_text(v) for v in value) + "]"
    return repr(value) if isinstance(value, float) else str(value)


def parse_params(params: dict[str, str]) -> list[Param]:
    """sweep.params in Hydra's grammar to Optuna distributions; a ConfigError names every
    expression that is not a search dimension, or an empty or inverted one."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.core.override_parser.types import ChoiceSweep, IntervalSweep, RangeSweep
    from hydra.errors import HydraException
    from optuna.distributions import (
        CategoricalDistribution,
        FloatDistribution,
        IntDistribution,
    )

    parser, problems, result = OverridesParser.create(), [], []
    for key, expression in params.items():
        where = f"sweep.params: {key}: {expression}"
        try:
            sweep = parser.parse_overrides([f"{key}={expression}"])[0].value()
        except HydraException as e:
            problems.append(f"{where}: not Hydra's override grammar ({str(e).splitlines()[0]})")
            continue
        tags = getattr(sweep, "tags", set())
        if isinstance(sweep, ChoiceSweep):
            values = tuple(override_text(v) if isinstance(v, list | dict) else v
                           for v in sweep.list)
            if not values:
                problems.append(f"{where}: an empty choice")
                continue
            result.append(Param(key, expression, CategoricalDistribution(values), values))
        elif isinstance(sweep, RangeSweep):
            values = tuple(_range(sweep.start, sweep.stop, sweep.step))
            if not values:
                problems.append(f"{where}: an empty range (start {sweep.start}, stop "
                                f"{sweep.stop}, step {sweep.step}; the stop is excluded)")
                continue
            dist = (IntDistribution(values[0], values[-1], step=int(sweep.step))
                    if all(isinstance(v, int) for v in values) and len(values) > 1
                    else CategoricalDistribution(values))
            result.append(Param(key, expression, dist, values))
        elif isinstance(sweep, IntervalSweep):
            low, high, log = sweep.start, sweep.end, "log" in tags
            if not low < high:
                problems.append(f"{where}: an empty or inverted interval (low {low} must be "
                                f"below high {high})")
            elif log and low <= 0:
                problems.append(f"{where}: a log-scale interval must start above 0")
            elif "int" in tags:
                result.append(Param(key, expression, IntDistribution(int(low), int(high),
                                                                     log=log), None))
            else:
                result.append(Param(key, expression, FloatDistribution(low, high, log=log),
                                    None))
        else:
            problems.append(f"{where}: a single value, not a search dimension; valid: "
                            "choice(...), range(...), interval(...), tag(log, interval(...))"
                            " (a fixed value goes in sweep.args or after --)")
    if problems:
        raise ConfigError("bad search space:\n  - " + "\n  - ".join(problems))
    return result


def _range(start: float, stop: float, step: float) -> list:
    values, v = [], start
    while step and (step > 0 and v < stop) or (step < 0 and v > stop):
        values.append(v)
        v += step
    return values


@dataclass(frozen=True)
class Plan:
    """A sweep checked end to end: what every trial runs and how the study searches."""

    cfg: DictConfig  # the composed sweeper config (cfg.sweep)
    params: list[Param]
    args: list[str]  # the fixed trainer overrides of every trial
    objectives: dict[str, str]  # metric -> maximize | minimize, in order
    sampler: str  # grid | random | tpe | nsga2
    trials: int

    @property
    def identity(self) -> dict[str, Any]:
        """What makes two command lines the same study: a sweep dir holding another one
        is refused rather than mixed."""
        return {"params": {p.key: p.expression for p in self.params}, "args": self.args,
                "objectives": self.objectives}


def compose(overrides: list[str]) -> DictConfig:
    """conf/sweeper.yaml with Hydra overrides; a bad override is a ConfigError."""
    register()
    return compose_checked("sweeper", overrides,
                           "See conf/sweeper.yaml and the studies in conf/sweep/.")


def plan(overrides: list[str], trainer_args: list[str]) -> Plan:
    """Compose and check a sweep: sweep-grammar values after `--` join sweep.params.
    Raises ConfigError naming every problem; touches no file and starts nothing."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException

    cfg = compose(overrides)
    sweep = cfg.sweep
    try:
        parsed = OverridesParser.create().parse_overrides(trainer_args)
    except HydraException as e:
        raise ConfigError(f"trainer arguments after --: {e}") from e
    params = dict(sweep.params)
    params |= {o.key_or_group: o.input_line.split("=", 1)[1] for o in parsed
               if o.is_sweep_override()}
    args = [*sweep.args, *(o.input_line for o in parsed if not o.is_sweep_override())]
    space = parse_params(params)
    problems = []
    if not space:
        problems.append("sweep.params is empty: name at least one KEY: choice(...), "
                        "range(...) or interval(...) to search over")
    objectives = {k: METRICS.get(k, "") for k in sweep.objectives}
    priced = sweep.hourly_price is not None or sweep.cluster is not None
    problems += filter(None, (one_of("sweep.objectives", k, list(METRICS)) for k in objectives))
    if len(objectives) < len(sweep.objectives):
        problems.append(f"sweep.objectives={list(sweep.objectives)}: a metric twice")
    if not objectives:
        problems.append(f"sweep.objectives is empty; valid: {', '.join(METRICS)}")
    if "dollars" in objectives and not priced:
        problems.append("sweep.objectives: dollars needs a price: sweep.hourly_price=USD "
                        "(this machine's $/hour) or sweep.cluster=RUN_ID")
    sampler, trials = _sampler(sweep, space, len(objectives), problems)
    if sweep.pruner != "none":
        first = next(iter(objectives), None)
        if len(objectives) != 1 or first not in PRUNABLE:
            problems.append(
                f"sweep.pruner={sweep.pruner} with objectives {', '.join(objectives)}: a "
                f"pruner judges one objective reported at every evaluation; valid: "
                f"{' or '.join(PRUNABLE)} alone, or sweep.pruner=none")
    for key, value in {"sweep.parallel": sweep.parallel, "sweep.workers": sweep.workers,
                       "sweep.nodes": sweep.nodes}.items():
        if value < 1:
            problems.append(f"{key}={value}: must be 1 or more")
    if sweep.max_retries < 0:
        problems.append(f"sweep.max_retries={sweep.max_retries}: must be 0 or more")
    if sweep.hourly_price is not None and sweep.hourly_price < 0:
        problems.append(f"sweep.hourly_price={sweep.hourly_price}: must be 0 or more")
    problems += filter(None, [one_of("sweep.launcher", sweep.launcher, LAUNCHERS)])
    if sweep.slurm and sweep.cluster is not None:
        problems.append(f"sweep.slurm=true with sweep.cluster={sweep.cluster}: trials run "
                        "either as SLURM jobs or on a launched cluster; choose one")
    if problems:
        raise ConfigError("bad sweep:\n  - " + "\n  - ".join(problems))
    check_trials(args, space)
    return Plan(cfg, space, args, objectives, sampler, trials)


def _sampler(sweep: DictConfig, space: list[Param], objectives: int,
             problems: list[str]) -> tuple[str, int]:
    grid = 1
    for p in space:
        grid = grid * len(p.grid) if p.grid is not None and grid else 0
    name = str(sweep.sampler)
    if name == "auto":
        name = ("grid" if grid and (sweep.trials is None or sweep.trials >= grid)
                else "nsga2" if objectives > 1 else "tpe")
    if name == "grid" and not grid:
        continuous = ", ".join(p.key for p in space if p.grid is None)
        problems.append(f"sweep.sampler=grid needs choice(...) or range(...) for every "
                        f"param; continuous: {continuous}")
    trials = sweep.trials if sweep.trials is not None else (grid if name == "grid" else 0)
    if trials < 1:
        problems.append(f"sweep.trials={sweep.trials}: sampler {name} needs a number of "
                        "trials (1 or more)")
    elif name == "grid" and trials > grid:
        trials = grid  # every point once; more would repeat them
    return name, trials


def check_trials(args: list[str], space: list[Param]) -> None:
    """Compose and validate the trainer config of the fixed arguments with each value
    that stands for a dimension, so that an unknown key, a bad group option or a value
    the trainer refuses stops the sweep before any trial."""
    base = [a for a in args]
    trainer_config.validate(trainer_config.compose(base))
    problems = []
    for param in space:
        for value in param.values_to_check():
            try:
                trainer_config.validate(trainer_config.compose([*base, param.override(value)]))
            except ConfigError as e:
                problems.append(f"sweep.params: {param.key}={override_text(value)} "
                                f"(from {param.expression}): {e}")
                break
    if problems:
        raise ConfigError("a trial would not start:\n  - " + "\n  - ".join(problems))
