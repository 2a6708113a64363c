"""A registry of named implementations, each with the traits it declares when registered.

The trainer's advantage estimators, policy losses, KL estimators and stale policies, and the
reward service's verifiers, are each a ``Registry``: a JobSpec or a setting names an entry, and
code that must treat entries differently asks the entry's traits (``estimator.needs_critic``),
never compares its name. An entry is a frozen dataclass: ``Entry`` (``name`` and ``fn``) or a
subclass that adds the traits of its kind as fields with defaults::

    @dataclass(frozen=True, slots=True)
    class Estimator(Entry[EstimatorFn]):
        needs_critic: bool = False

    ESTIMATORS = Registry(Estimator, kind="advantage estimator", field="algorithm.advantage")

    @ESTIMATORS.register("gae", needs_critic=True)
    def gae(inputs): ...

A registry that is a plug-in point also takes a user's function by its dotted path:
``resolve("mypkg.rows:read")`` imports it (plugins.py) and makes an entry with the traits the
function declared with ``@plugins.traits``. ``register_lazy`` adds an entry whose function is
imported on first use, so a registry can name an implementation whose module it must not import
(torch, or a module that imports the registry's own).

This module imports nothing heavy: the JobSpec's module may use it.
"""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from services.common.plugins import PluginError, declared_traits, is_plugin_path, load_function

F = TypeVar("F")
E = TypeVar("E", bound="Entry[Any]")
Registered = TypeVar("Registered")


@dataclass(frozen=True, slots=True)
class Entry(Generic[F]):
    """One registered implementation. Subclasses add their kind's traits, each with a default."""

    name: str
    """The name a JobSpec or setting uses."""
    fn: F
    """The implementation."""


class Registry(Generic[E]):
    """Entries of one kind by name; ``register`` adds one, ``get`` finds one or names the choices."""

    def __init__(self, entry: type[E], *, kind: str, field: str, owner: str = "trainer") -> None:
        self.entry = entry
        self.kind = kind
        """What an entry is, in words (``"policy loss"``), for errors."""
        self.field = field
        """The setting that names an entry (``"algorithm.policy_loss"``), for errors."""
        self.owner = owner
        """The service whose registry this is, for errors."""
        self.traits = frozenset(f.name for f in dataclasses.fields(entry)) - {"name", "fn"}
        """The trait names its entries declare."""
        self._entries: dict[str, E] = {}
        self._lazy: dict[str, tuple[str, dict[str, Any]]] = {}
        self._plugins: dict[str, E] = {}

    def register(self, name: str, **traits: Any) -> Callable[[Registered], Registered]:
        """A decorator that adds its function as ``name`` with ``traits``; the function is
        returned unchanged. A name registered twice or a trait the entry lacks is a ValueError."""
        self._check_traits(name, traits)

        def add(fn: Registered) -> Registered:
            if name in self:  # a lazy entry not imported yet counts too
                raise ValueError(f"{self.kind} {name!r} is registered twice")
            self._entries[name] = self.entry(name=name, fn=fn, **traits)
            return fn

        return add

    def register_lazy(self, name: str, path: str, **traits: Any) -> None:
        """Add ``name`` as the function ``module:function`` at ``path``, imported when first got."""
        self._check_traits(name, traits)
        if name in self._entries or name in self._lazy:
            raise ValueError(f"{self.kind} {name!r} is registered twice")
        self._lazy[name] = (path, traits)

    def get(self, name: str) -> E:
        """The entry ``name``; a ValueError naming the field and the available names otherwise."""
        entry = self._entries.get(name)
        if entry is not None:
            return entry
        if name in self._lazy:
            path, traits = self._lazy.pop(name)
            module_name, function = path.split(":")
            fn = getattr(importlib.import_module(module_name), function)
            self._entries[name] = entry = self.entry(name=name, fn=fn, **traits)
            return entry
        available = ", ".join(self.names())
        raise ValueError(
            f"{self.field} {name!r} is not available in this {self.owner} (available: {available})"
        )

    def resolve(self, name: str) -> E:
        """A registered entry, or a user's function named ``module:function`` (imported once, with
        the traits it declared); a ValueError (a ``PluginError`` for a path) saying why not."""
        if not is_plugin_path(name):
            return self.get(name)
        entry = self._plugins.get(name)
        if entry is None:
            try:
                fn = load_function(name)
            except PluginError as err:
                raise PluginError(f"{self.field} ({self.kind}) {name!r}: {err}") from None
            declared = declared_traits(fn)
            unknown = set(declared) - self.traits
            if unknown:
                raise PluginError(
                    f"{self.field} {name!r} declares unknown traits {sorted(unknown)}"
                    f" (a {self.kind} has: {sorted(self.traits)})"
                )
            self._plugins[name] = entry = self.entry(name=name, fn=fn, **declared)
        return entry

    def accepts(self, name: str) -> bool:
        """Whether ``name`` is registered or has the form of a user's function (not imported)."""
        return name in self or is_plugin_path(name)

    def names(self) -> tuple[str, ...]:
        """Every registered name, sorted."""
        return tuple(sorted([*self._entries, *self._lazy]))

    def declared(self, name: str) -> dict[str, Any]:
        """The traits of registered ``name``, defaults filled in, without importing a lazy entry
        (the JobSpec asks them where it may not import the implementation)."""
        if name in self._lazy:
            defaults = {f.name: f.default for f in dataclasses.fields(self.entry) if f.name in self.traits}
            return {**defaults, **self._lazy[name][1]}
        entry = self.get(name)
        return {trait: getattr(entry, trait) for trait in self.traits}

    def _check_traits(self, name: str, traits: dict[str, Any]) -> None:
        unknown = set(traits) - self.traits
        if unknown:
            raise ValueError(
                f"{self.kind} {name!r}: unknown traits {sorted(unknown)} (known: {sorted(self.traits)})"
            )

    def where(self, **traits: Any) -> frozenset[str]:
        """The names of the entries whose traits have the given values (``where(needs_critic=True)``)."""
        unknown = set(traits) - self.traits
        if unknown:
            raise ValueError(f"{self.kind} entries have no traits {sorted(unknown)}")
        return frozenset(
            name
            for name in self.names()
            if all(self.declared(name)[trait] == value for trait, value in traits.items())
        )

    def __contains__(self, name: object) -> bool:
        return name in self._entries or name in self._lazy

    def __iter__(self) -> Iterator[E]:
        """Every entry (a lazy one imported now), in registration order."""
        return iter([self.get(name) for name in [*self._entries, *self._lazy]])

    def __len__(self) -> int:
        return len(self._entries) + len(self._lazy)
