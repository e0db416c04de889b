"""The sweep's structured config (conf/sweeper.yaml + a study of conf/sweep/) and the
checks that run before any trial: the search space in Hydra's sweep grammar, turned
into Optuna's distributions, and everything a trial would fail on.

What a trial runs is a command with a placeholder {KEY} for each param, which each trial
fills with its value. From the words after `--` (launch/contract.py): a command of the
user's own, or the built-in trainer's overrides, which make it `spotring train FIXED...
KEY={KEY}...` (sweep.args and the plain values among the overrides fixed, the search
expressions among them params); from there on the trainer's sweep is a command's.

    sweep.params        KEY: EXPRESSION, in Hydra's override grammar (what
                        hydra-optuna-sweeper reads too):
                          choice(a, b, c)                 categorical
                          range(1, 9, 2)                  integers 1, 3, 5, 7 (end excluded)
                          interval(0.001, 0.5)            floats in [low, high]
                          tag(log, interval(1e-5, 1e-2))  sampled on a log scale
                          tag(int, interval(16, 256))     integers in [low, high]
                        For the trainer, KEY is any trainer key (optim.lr, model.width) or
                        config group (model: choice(convnet, fast_convnet)). For a command,
                        KEY names a placeholder {KEY} of the command; every param is one of
                        the command's placeholders and every placeholder a param.
                        Also on the command line: 'sweep.params.KEY=EXPRESSION'.
    sweep.args          the trainer's overrides every trial gets (also: after `--`)
    sweep.objectives    [METRIC, ...], the first the main one: a number of the trial's
                        summary.json (job.finish(**results) writes it), or dollars (needs
                        a price). METRICS have their direction; any other name is
                        written NAME:min or NAME:max (val_loss:min).

Before any trial, the command is checked with the values that stand for each dimension
(launch.project.check_command: what the trainer says of its overrides, on the trial's
workers; a command's script in the project), with every other problem in one message.
"""

from __future__ import annotations

import difflib
import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, DictConfig

from spotring.exits import ConfigError
from spotring.launch import project
from spotring.launch.contract import command_of, split_command
from spotring.options import choices, one_of
from spotring.support.checkpoint import CheckpointNode, checkpoint_problems
from spotring.support.compose import compose_checked

SamplerName = choices("SamplerName", "auto grid random tpe nsga2")
PrunerName = choices("PrunerName", "none median hyperband")


@dataclass
class SweepConfig:
    name: str = MISSING  # the study's name; the default sweep directory is named after it
    # Where the study, the trials' run directories and the report go. The same
    # directory continues the same study: finished trials are never run again.
    dir: str = "runs/sweeps/${.name}"
    params: dict[str, str] = field(default_factory=dict)  # KEY: Hydra sweep expression
    args: list[str] = field(default_factory=list)  # the trainer's overrides of every trial
    # METRIC, or NAME:min / NAME:max for a number only the user's script reports.
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
    # Stop poor trials early from their objective at each evaluation (the trainer's:
    # train.eval_every_steps, or each epoch end; a script's: job.log("test", ...));
    # single objective only.
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
    # checkpoint.uri=s3://, gs:// or az://bucket/prefix: each trial checkpoints to
    # URI/sweeps/NAME/trials/NNN (its SPOTRING_CHECKPOINT_URI) and the study's journal
    # goes to URI/sweeps/NAME/.
    checkpoint: CheckpointNode = field(default_factory=CheckpointNode)


def register() -> None:
    cs = ConfigStore.instance()
    cs.store(name="sweeper_schema", node=SweeperConfig)
    cs.store(group="schema/sweep", name="sweep", node=SweepConfig)




# What a trial's summary.json reports that a study can optimise (trainer/loop.py, and
# spotring.Job.finish for a script), and `dollars`, which the sweep adds where it has a
# price; each in its own direction.
METRICS = {"test_accuracy": "maximize", "images_per_second": "maximize",
           "test_loss": "minimize", "train_seconds": "minimize", "parameters": "minimize",
           "parameter_mb": "minimize", "peak_memory_mb": "minimize", "dollars": "minimize"}
DIRECTIONS = {"min": "minimize", "max": "maximize", "minimize": "minimize",
              "maximize": "maximize"}
LAUNCHERS = ("torchrun", "horovodrun", "mpirun")
# {KEY} in a command's words, where KEY is a param; ${VAR} is the shell's, not one.
PLACEHOLDER = re.compile(r"(?<!\$)\{([A-Za-z_][\w.\-/]*)\}")
# sweep.params.KEY=EXPRESSION among the sweep's overrides (Hydra would refuse a sweep
# expression there: it takes it for a --multirun sweep).
_PARAM_OVERRIDE = re.compile(r"^\+{0,2}sweep\.params\.([^=]+)=(.*)$", re.DOTALL)


def record_field(objective: str) -> str:
    """The field of a kind=test record of metrics.jsonl that a pruner reads for an
    objective: its name less a leading `test_` (test_accuracy -> accuracy, test_loss ->
    loss, test_f1 -> f1, val_loss -> val_loss)."""
    return objective.removeprefix("test_")


@dataclass(frozen=True)
class Param:
    """One dimension of the search: a trainer key and its Optuna distribution."""

    key: str
    expression: str  # as the user wrote it, for messages and the study's identity
    distribution: Any  # optuna.distributions.BaseDistribution
    grid: tuple | None  # every value, where the dimension is discrete

    def value(self, sampled: Any) -> Any:
        """What a trial gets for Optuna's ``sampled`` value."""
        if isinstance(sampled, float) and self.grid is None:
            # 4 significant digits: what the trial runs with is what the report shows.
            return float(f"{sampled:.4g}")
        return sampled

    def text(self, sampled: Any) -> str:
        """The value as the trial's command line gets it."""
        return override_text(self.value(sampled))

    def override(self, sampled: Any) -> str:
        return f"{self.key}={self.text(sampled)}"

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
    command: list[str]  # what every trial runs, with a {KEY} for each param
    objectives: dict[str, str]  # metric -> maximize | minimize, in order
    sampler: str  # grid | random | tpe | nsga2
    trials: int
    checkpoint_uri: str | None = None  # the sweep's, each trial under it

    @property
    def identity(self) -> dict[str, Any]:
        """What makes two command lines the same study: a sweep dir holding another one
        is refused rather than mixed."""
        return {"params": {p.key: p.expression for p in self.params},
                "command": self.command, "objectives": self.objectives}

    def command_for(self, texts: dict[str, str]) -> list[str]:
        """The command with each {KEY} replaced by ``texts[KEY]``."""
        return [PLACEHOLDER.sub(lambda m: texts[m.group(1)], word) for word in self.command]

    def first(self) -> dict[str, str]:
        """A value of each param (the first that stands for its dimension): with them,
        ``command_for`` is a command some trial runs."""
        return {p.key: p.text(p.values_to_check()[0]) for p in self.params}


def compose(overrides: list[str]) -> DictConfig:
    """conf/sweeper.yaml with Hydra overrides; a bad override is a ConfigError."""
    register()
    return compose_checked("sweeper", overrides,
                           "See conf/sweeper.yaml and the studies in conf/sweep/.")


def plan(overrides: list[str], after_dashes: list[str]) -> Plan:
    """Compose and check a sweep: sweep.params.KEY=EXPRESSION overrides join
    sweep.params; after `--`, a command, or the trainer's overrides (whose sweep-grammar
    values join sweep.params). Raises ConfigError naming every problem; writes no file
    and starts nothing."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException

    given = {m.group(1): m.group(2) for o in overrides if (m := _PARAM_OVERRIDE.match(o))}
    cfg = compose([o for o in overrides if not _PARAM_OVERRIDE.match(o)])
    sweep = cfg.sweep
    trainer_args, command = split_command(after_dashes)
    try:
        parsed = OverridesParser.create().parse_overrides(trainer_args)
    except HydraException as e:
        raise ConfigError(f"trainer arguments after --: {e}") from e
    params = dict(sweep.params) | given
    params |= {o.key_or_group: o.input_line.split("=", 1)[1] for o in parsed
               if o.is_sweep_override()}
    problems = []
    if command and sweep.args:
        problems.append(f"sweep.args={list(sweep.args)}: the trainer's overrides, and the "
                        f"trials run the command `{' '.join(command)}`; put fixed "
                        "arguments in the command")
    fixed = [*sweep.args, *(o.input_line for o in parsed if not o.is_sweep_override())]
    command = command_of([*fixed, *(f"{key}={{{key}}}" for key in params)], command)
    space = parse_params(params)
    if not space:
        problems.append("sweep.params is empty: name at least one KEY: choice(...), "
                        "range(...) or interval(...) to search over")
    objectives = _objectives(list(sweep.objectives), problems)
    priced = sweep.hourly_price is not None or sweep.cluster is not None
    if "dollars" in objectives and not priced:
        problems.append("sweep.objectives: dollars needs a price: sweep.hourly_price=USD "
                        "(this machine's $/hour) or sweep.cluster=RUN_ID")
    sampler, trials = _sampler(sweep, space, len(objectives), problems)
    if sweep.pruner != "none":
        first = next(iter(objectives), None)
        if len(objectives) != 1 or not _prunable(first):
            problems.append(
                f"sweep.pruner={sweep.pruner} with objectives {', '.join(objectives)}: a "
                "pruner judges one objective that every evaluation reports (kind=test "
                "records of metrics.jsonl); valid: test_accuracy, test_loss or a metric "
                "of your script's own, alone, or sweep.pruner=none")
    for key, value in {"sweep.parallel": sweep.parallel, "sweep.workers": sweep.workers,
                       "sweep.nodes": sweep.nodes}.items():
        if value < 1:
            problems.append(f"{key}={value}: must be 1 or more")
    if sweep.max_retries < 0:
        problems.append(f"sweep.max_retries={sweep.max_retries}: must be 0 or more")
    problems += checkpoint_problems(cfg)
    if sweep.hourly_price is not None and sweep.hourly_price < 0:
        problems.append(f"sweep.hourly_price={sweep.hourly_price}: must be 0 or more")
    problems += filter(None, [one_of("sweep.launcher", sweep.launcher, LAUNCHERS)])
    if sweep.slurm and sweep.cluster is not None:
        problems.append(f"sweep.slurm=true with sweep.cluster={sweep.cluster}: trials run "
                        "either as SLURM jobs or on a launched cluster; choose one")
    plan = Plan(cfg, space, command, objectives, sampler, trials, cfg.checkpoint.uri)
    holes = _placeholder_problems(plan)
    problems += holes or _trial_problems(plan)
    if problems:
        raise ConfigError("bad sweep:\n  - " + "\n  - ".join(problems))
    return plan


def _prunable(objective: str | None) -> bool:
    """Whether every evaluation can report ``objective``: one of the known METRICS that
    evaluations give (test_*), or one of the script's own; not a whole run's figure."""
    return objective is not None and (objective.startswith("test_") or objective not in METRICS)


def _placeholder_problems(plan: Plan) -> list[str]:
    """A param the command has no placeholder for, a placeholder no param fills."""
    problems, shown = [], " ".join(plan.command)
    holes = list(dict.fromkeys(m.group(1) for word in plan.command
                               for m in PLACEHOLDER.finditer(word)))
    unused = [p.key for p in plan.params if p.key not in holes]
    if unused:
        problems.append(
            f"sweep.params {', '.join(unused)}: not in the command `{shown}`; write each "
            f"where the script takes its value ({' '.join(f'{{{k}}}' for k in unused)}, "
            "e.g. `--lr {lr}`), or start from sweep=custom, which has no params")
    unknown = [h for h in holes if h not in {p.key for p in plan.params}]
    if unknown:
        problems.append(
            f"the command's {', '.join(f'{{{h}}}' for h in unknown)}: no such param; "
            f"valid: {', '.join(f'{{{p.key}}}' for p in plan.params) or 'none'} (add one "
            f"with 'sweep.params.{unknown[0]}=choice(...)')")
    return problems


def _trial_problems(plan: Plan) -> list[str]:
    """Why a trial would not start: the command with each value that stands for a
    dimension (the others at their first), checked as the trial's workers would start it
    (launch.project.check_command), so that an unknown key, a bad group option, a value
    the trainer refuses or a missing script stops the sweep before any trial."""
    sweep = plan.cfg.sweep
    # A trial's workers, where the slots are known now (a cluster's nodes are not).
    sizes = [] if sweep.cluster else [sweep.workers * (sweep.nodes if sweep.slurm else 1)]
    first = plan.first()

    def check(texts: dict[str, str]) -> str | None:
        try:
            project.check_command(Path.cwd(), plan.command_for(texts), sizes)
        except ConfigError as e:
            return str(e).replace("\n", "\n    ")
        return None

    if (why := check(first)) is not None:
        return [f"a trial would not start: `{shlex.join(plan.command_for(first))}`: {why}"]
    problems = []
    for param in plan.params:
        for value in param.values_to_check()[1:]:
            if (why := check(first | {param.key: param.text(value)})) is not None:
                problems.append(f"a trial would not start: sweep.params: "
                                f"{param.key}={param.text(value)} (from {param.expression}): "
                                f"{why}")
                break
    return problems


def _objectives(names: list[str], problems: list[str]) -> dict[str, str]:
    """sweep.objectives as metric -> direction: METRICS' own, NAME:min|max for others."""
    objectives: dict[str, str] = {}
    for entry in names:
        name, _, given = entry.partition(":")
        direction = DIRECTIONS.get(given) if given else METRICS.get(name)
        if given and direction is None:
            problems.append(f"sweep.objectives: {entry}: unknown direction {given!r}; "
                            f"valid: {name}:min or {name}:max")
        elif direction is None:
            close = difflib.get_close_matches(name, list(METRICS), n=1)
            problems.append(
                f"sweep.objectives: {name}: not a metric spotring knows the direction of"
                f"{f' (did you mean {close[0]}?)' if close else ''}; known: "
                f"{', '.join(METRICS)}; for a number your script reports in summary.json, "
                f"give its direction: {name}:min or {name}:max")
        elif name in METRICS and direction != METRICS[name]:
            problems.append(f"sweep.objectives: {entry}: {name} is always {METRICS[name]}d")
        elif name in objectives:
            problems.append(f"sweep.objectives={names}: {name} twice")
        else:
            objectives[name] = direction
    if not names:
        problems.append(f"sweep.objectives is empty; valid: {', '.join(METRICS)}, or "
                        "NAME:min / NAME:max")
    return objectives


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
