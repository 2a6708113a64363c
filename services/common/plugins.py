"""A user's function named by a dotted path, ``module:function``, as every plug-in point takes it.

A JobSpec field that picks an implementation (a data source, a rollout strategy, a reward
shaping, a group filter) names a registered entry or a user's function as ``module:function``;
``Registry.resolve`` (registry.py) calls ``load_function`` for the latter. The process that runs
the plug-in imports the module from its own import path, once. Modules of the standard library
and of verst itself are refused (``os:system`` is no plug-in), as are names starting with ``_``.

A user's function declares its traits with ``@traits(...)``, the same traits a registered entry
of that kind declares; traits it does not declare keep their defaults::

    from services.common.plugins import traits

    @traits(endless=True)
    def my_rows(source): ...

The reward service's plugins (reward/plugins.py) follow the same rules with settings of their own.
"""

from __future__ import annotations

import importlib
import re
import sys
from collections.abc import Callable
from typing import Any, TypeVar

PLUGIN_PATH = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z]\w*$")
"""``module:function``: what a JobSpec plug-in field accepts besides a registered name."""
REFUSED_PACKAGES = frozenset(sys.stdlib_module_names) | {"services"}
"""Top-level packages a plug-in may not come from: the standard library and verst itself."""
TRAITS_ATTRIBUTE = "verst_traits"
"""Where ``@traits`` keeps a function's declared traits."""

F = TypeVar("F", bound=Callable[..., Any])


class PluginError(ValueError):
    """A plug-in may not, or could not, be loaded; the message says which and why."""


def is_plugin_path(name: str) -> bool:
    """Whether ``name`` names a user's function (registered names have no colon)."""
    return ":" in name


def traits(**declared: Any) -> Callable[[F], F]:
    """Declare a user function's traits (checked against its registry's when it is resolved)."""

    def mark(fn: F) -> F:
        setattr(fn, TRAITS_ATTRIBUTE, dict(declared))
        return fn

    return mark


def declared_traits(fn: Any) -> dict[str, Any]:
    """The traits ``@traits`` declared on ``fn`` (none: an empty dict)."""
    return dict(getattr(fn, TRAITS_ATTRIBUTE, {}))


def load_function(path: str) -> Callable[..., Any]:
    """The callable ``module:function`` names; ``PluginError`` saying why it cannot be had."""
    if PLUGIN_PATH.fullmatch(path) is None:
        raise PluginError(f"{path!r} is not module:function")
    module_name, function = path.split(":")
    if module_name.split(".")[0] in REFUSED_PACKAGES:
        raise PluginError(f"{path!r} may not come from the standard library or verst itself")
    try:
        module = importlib.import_module(module_name)
    except ImportError as err:
        raise PluginError(f"cannot import {module_name!r}: {err}") from None
    target = getattr(module, function, None)
    if target is None:
        raise PluginError(f"module {module_name!r} has no {function!r}")
    if not callable(target):
        raise PluginError(f"{path} is not callable")
    return target
