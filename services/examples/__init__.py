"""Job specs shipped with verst as package data, so that `verst demo` runs from a plain
`pip install` (the repository's examples/ holds the rest; its addition.yaml is a link here)."""

from __future__ import annotations

import contextlib
from importlib import resources
from pathlib import Path


def example_names() -> list[str]:
    """The shipped specs, by name (``addition`` for ``addition.yaml``)."""
    files = resources.files(__name__).iterdir()
    return sorted(entry.name.removesuffix(".yaml") for entry in files if entry.name.endswith(".yaml"))


def example_spec(name: str) -> contextlib.AbstractContextManager[Path]:
    """The file of shipped spec ``name``, as a path while the context is open (a temporary copy
    where the package is not on a file system, a zip say)."""
    if name not in example_names():
        raise LookupError(f"no shipped example {name!r} (there are: {', '.join(example_names())})")
    return resources.as_file(resources.files(__name__) / f"{name}.yaml")
