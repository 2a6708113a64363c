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

This module imports nothing heavy: the JobSpec's module may use it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

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

    def register(self, name: str, **traits: Any) -> Callable[[Registered], Registered]:
        """A decorator that adds its function as ``name`` with ``traits``; the function is
        returned unchanged. A name registered twice or a trait the entry lacks is a ValueError."""
        unknown = set(traits) - self.traits
        if unknown:
            raise ValueError(
                f"{self.kind} {name!r}: unknown traits {sorted(unknown)} (known: {sorted(self.traits)})"
            )

        def add(fn: Registered) -> Registered:
            if name in self._entries:
                raise ValueError(f"{self.kind} {name!r} is registered twice")
            self._entries[name] = self.entry(name=name, fn=fn, **traits)
            return fn

        return add

    def get(self, name: str) -> E:
        """The entry ``name``; a ValueError naming the field and the available names otherwise."""
        try:
            return self._entries[name]
        except KeyError:
            available = ", ".join(self.names())
            raise ValueError(
                f"{self.field} {name!r} is not available in this {self.owner} (available: {available})"
            ) from None

    def names(self) -> tuple[str, ...]:
        """Every registered name, sorted."""
        return tuple(sorted(self._entries))

    def where(self, **traits: Any) -> frozenset[str]:
        """The names of the entries whose traits have the given values (``where(needs_critic=True)``)."""
        unknown = set(traits) - self.traits
        if unknown:
            raise ValueError(f"{self.kind} entries have no traits {sorted(unknown)}")
        return frozenset(
            name
            for name, entry in self._entries.items()
            if all(getattr(entry, trait) == value for trait, value in traits.items())
        )

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def __iter__(self) -> Iterator[E]:
        """The entries in registration order."""
        return iter(self._entries.values())

    def __len__(self) -> int:
        return len(self._entries)
