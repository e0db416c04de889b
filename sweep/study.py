"""The Optuna study of a sweep: its storage, sampler and pruner.

The study lives in SWEEP_DIR/study.journal, Optuna's journal storage: an append-only
log of every ask, report and tell, which a crash can cut short but never corrupt, and
which needs no database server. With checkpoint.uri (s3://, gs://, az://) it is
also uploaded to URI/sweeps/NAME/study.journal at every start and end of a trial, and
downloaded from there when the sweep directory is new (a sweep that resumes on another machine).
"""

from __future__ import annotations

import logging
from pathlib import Path

import optuna
from optuna.storages import JournalStorage
from optuna.storages.journal import JournalFileBackend

from spotring.exits import ConfigError
from spotring.stores import open_store
from spotring.sweep.config import Plan

JOURNAL = "study.journal"
log = logging.getLogger("launch")


class Study:
    def __init__(self, plan: Plan, sweep_dir: Path, remote_uri: str | None) -> None:
        self.plan, self.path = plan, sweep_dir / JOURNAL
        self.remote = open_store(f"{remote_uri.rstrip('/')}/sweeps/{plan.cfg.sweep.name}",
                                 key="checkpoint.uri") if remote_uri else None
        if self.remote is not None and not self.path.exists() and JOURNAL in self.remote.names():
            self.path.write_bytes(self.remote.read(JOURNAL))
            log.info("sweep: the study from %s", self.remote.location(JOURNAL))
        optuna.logging.set_verbosity(optuna.logging.WARNING)  # the sweep logs its own lines
        self.study = optuna.create_study(
            study_name=plan.cfg.sweep.name,
            storage=JournalStorage(JournalFileBackend(str(self.path))),
            directions=list(plan.objectives.values()),
            sampler=_sampler(plan), pruner=_pruner(plan), load_if_exists=True)
        saved = self.study.user_attrs.get("identity")
        if saved is None:
            self.study.set_user_attr("identity", plan.identity)
        elif saved != plan.identity:
            raise ConfigError(
                f"{sweep_dir} holds study {plan.cfg.sweep.name} with other settings: "
                f"{_difference(saved, plan.identity)}. Continue it with the same ones, or "
                "start another study with sweep.dir=NEW_DIR (or sweep.name=NEW_NAME)")

    def save(self) -> None:
        """The journal to the sweep's checkpoint URI, where it has one."""
        if self.remote is not None:
            self.remote.write(JOURNAL, self.path.read_bytes())


def _difference(saved: dict, now: dict) -> str:
    return "; ".join(f"{key} was {saved.get(key)}, now {now[key]}" for key in now
                     if saved.get(key) != now[key])


def _sampler(plan: Plan) -> optuna.samplers.BaseSampler:
    seed = plan.cfg.sweep.seed
    if plan.sampler == "grid":
        return _Grid({p.key: list(p.grid) for p in plan.params}, seed=seed)
    if plan.sampler == "random":
        return optuna.samplers.RandomSampler(seed=seed)
    if plan.sampler == "nsga2":
        # Optuna's default generation of 50 would leave a 16-trial study all random.
        population = max(4, min(50, plan.trials // 4))
        return optuna.samplers.NSGAIISampler(population_size=population, seed=seed)
    # TPE starts from random trials; fewer of them than its default 10 in short studies.
    return optuna.samplers.TPESampler(n_startup_trials=max(2, min(10, plan.trials // 4)),
                                      multivariate=True, seed=seed)


class _Grid(optuna.samplers.GridSampler):
    """GridSampler without its end-of-grid study.stop(), which Optuna allows inside
    study.optimize() only; the sweep stops asking after sweep.trials itself."""

    def after_trial(self, study, trial, state, values) -> None:
        pass


def _pruner(plan: Plan) -> optuna.pruners.BasePruner:
    name = plan.cfg.sweep.pruner
    if name == "median":
        # Judged against the trials before it at the same step, once 4 have finished.
        return optuna.pruners.MedianPruner(n_startup_trials=4)
    if name == "hyperband":
        return optuna.pruners.HyperbandPruner()
    return optuna.pruners.NopPruner()
