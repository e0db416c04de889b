"""Your own builders: a config group's ``_target_`` (dataset._target_, model._target_)
called with the keys added to the group (+model.KEY=VALUE) and what the trainer gives it.

    model = instantiate("model", cfg.model, input_shape=(1, 28, 28), num_classes=10)

A target that cannot be imported or is not callable, or a call that raises, is a
ConfigError naming the target: it happens before anything of the run has started, on
every rank, so the run ends with exit 2 and one paragraph. ``describe`` words what a
builder returned for the error messages of the code that checks it (trainer/datasets.py,
trainer/models.py).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from omegaconf import DictConfig, OmegaConf

from spotring.exits import ConfigError


def added_keys(node: DictConfig) -> dict[str, Any]:
    """The keys of a group's config that its schema does not declare: those added with
    +model.KEY=VALUE, the arguments of its _target_ (plain Python values). The schema's
    own (name, l1, augment, the zoo option's channels...) are the trainer's."""
    declared = {f.name for f in dataclasses.fields(OmegaConf.get_type(node))}
    values = OmegaConf.to_container(node, resolve=True)
    return {key: value for key, value in values.items() if key not in declared}


def instantiate(group: str, node: DictConfig, **arguments: Any) -> Any:
    """What ``node._target_`` returns, called with ``added_keys(node)`` (through
    hydra.utils.instantiate: a nested node with a _target_ of its own is instantiated
    first) and ``arguments`` as they are (Hydra would make a tuple a list). A target that
    cannot be imported or is not callable, or a call that raises, is a ConfigError naming
    the target (as ``group``._target_) and why: nothing of the run has started then."""
    from hydra.utils import instantiate as hydra_instantiate

    target, keys = node._target_, added_keys(node)
    if clash := sorted(keys.keys() & arguments.keys()):
        raise ConfigError(f"{group}.{clash[0]}: the trainer gives {group}._target_={target} "
                          f"{', '.join(clash)} itself; remove the key")
    try:
        build = hydra_instantiate({"_target_": target, **keys}, _partial_=True,
                                  _convert_="all")
    except Exception as e:
        if str(e).startswith("Error locating target"):  # Hydra's words for a failed import
            why = "import failed: " + " ".join(str(e.__cause__).split())
        else:  # not callable, or a nested _target_ failed: Hydra's message says which
            why = " ".join(str(e).split())
        raise ConfigError(f"{group}._target_={target}: {why}") from e
    try:
        return build(**arguments)
    except Exception as e:
        call = ", ".join(f"{k}={v!r}" for k, v in {**keys, **arguments}.items())
        raise ConfigError(f"{group}._target_={target}: {target}({call}) raised "
                          f"{type(e).__name__}: {e}") from e


def describe(value: Any) -> str:
    """A short account of a value a builder returned, for an error message: its type and
    a glimpse of it (a tensor's or array's dtype and shape, a tuple's first items)."""
    if hasattr(value, "dtype") and hasattr(value, "shape"):
        return f"a {type(value).__name__} of {value.dtype} {list(value.shape)}"
    if isinstance(value, tuple | list):
        items = ", ".join(describe(v) for v in value[:3]) + (", ..." if len(value) > 3 else "")
        return f"a {type(value).__name__} of {len(value)} ({items})"
    text = " ".join(repr(value).split())
    return f"a {type(value).__name__} ({text if len(text) <= 60 else text[:57] + '...'})"
