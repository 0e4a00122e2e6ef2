"""User functions named in the config as `package.module:function` (rewards, advantage estimators,
policy losses): imported by name, so they also travel by name into worker processes."""

from __future__ import annotations

import importlib
from collections.abc import Callable


def is_function_spec(name: str) -> bool:
    """Whether `name` has the `module:function` form (anything else is a built-in name)."""
    module, sep, attr = name.partition(":")
    return bool(sep and module and attr)


def import_function(spec: str, what: str) -> Callable:
    """The callable named `module:function`; ValueError naming `what` (e.g. "algo.adv_estimator") when it
    cannot be imported or is not callable."""
    if not is_function_spec(spec):
        raise ValueError(f"{what} {spec!r} is not of the form 'package.module:function'")
    module_name, _, attr = spec.partition(":")
    try:
        fn = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"{what} {spec!r} cannot be imported: {e}") from e
    if not callable(fn):
        raise ValueError(f"{what} {spec!r} is not callable")
    return fn
