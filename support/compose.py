"""Hydra's compose for spotring's own root configs, with its errors made a user's: the
trainer's (conf/config.yaml), the launcher's (launch.yaml), sbatch's and the sweep's.
They all live in spotring.conf, which ships in the wheel."""

from __future__ import annotations

from hydra import compose as hydra_compose
from hydra import initialize_config_module
from hydra.errors import HydraException
from omegaconf import DictConfig
from omegaconf.errors import OmegaConfBaseException

from spotring.exits import ConfigError

# conf/ is spotring.conf, so that it ships in the wheel (pkg://spotring.conf for Hydra).
CONF_MODULE = "spotring.conf"


def compose_checked(name: str, overrides: list[str], hint: str) -> DictConfig:
    """conf/``name``.yaml with ``overrides``; a bad override is a ConfigError ending in
    ``hint``."""
    try:
        with initialize_config_module(CONF_MODULE, version_base="1.3"):
            return hydra_compose(name, overrides=list(overrides))
    except (HydraException, OmegaConfBaseException) as e:
        cause = f": {e.__cause__}" if e.__cause__ else ""
        raise ConfigError(f"{_for_users(f'{e}{cause}')}\n{hint}") from e


def _for_users(message: str) -> str:
    """Hydra's message without what only its developers need: the search path and
    OmegaConf's type names. The bad value and the valid options stay."""
    message = message.split("\nConfig search path:")[0]
    return "\n".join(line for line in message.splitlines() if line.strip() and not
                     line.lstrip().startswith(("reference_type=", "object_type=")))
