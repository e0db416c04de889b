"""python -m spotring.benchmarks.trainer_sweep -m ARGS: a Hydra sweep of the trainer in one process.

    python -m spotring.benchmarks.trainer_sweep -m model=convnet,lenet train.batch_size=32,64 \
        dataset=synthetic hydra.sweep.dir=DIR

Every point of the sweep runs the trainer's own job (trainer/job.py: checks, engine, fit,
summary.json), one after another, so Python, torch and the data are loaded once. It exists
because `python -m spotring.trainer -m ...` ends after the first point: its Hydra task exits the
process with the job's exit code. Single-process runs only (the points share a process).
"""

from __future__ import annotations

import hydra
from omegaconf import DictConfig

from spotring import exits
from spotring.trainer import compose, config, job


@hydra.main(version_base="1.3", config_path=f"pkg://{compose.CONF_MODULE}",
            config_name="config")
def _one_point(cfg: DictConfig) -> None:
    code = job.run(cfg)
    if code != exits.EXIT_OK:
        raise RuntimeError(f"the trainer exited with code {code}; see the log above")


def main() -> None:
    config.register()
    _one_point()


if __name__ == "__main__":
    main()
