"""A step compiled ahead of time: torch.export, then AOTInductor into a shared library.

torch.compile runs every call through dynamo: the frame's guards, the bytecode that gathers the
graph's inputs and Python wrappers around the compiled graph. On a CPU the demo model's decode
step at batch 64 took 1.17 ms that way and 0.82 ms as an AOTInductor package, which is called
with a flat list of tensors and runs its kernels from C++, with nothing in between.

The price is that it checks nothing at a call: the caller keeps every input within the dtypes,
devices and dynamic ranges it was exported with, as a decoder does with its own slots and cache.
"""

from __future__ import annotations

import atexit
import logging
import tempfile
import time
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import Tensor
from torch.utils import _pytree as pytree

log = logging.getLogger(__name__)

_LIVE: weakref.WeakSet[AotStep] = weakref.WeakSet()


@atexit.register
def _release_all() -> None:
    """Drop every loaded package at exit: a package's loader unpacks it into a temporary folder
    that only its destructor removes, and Python does not destroy what is still alive at exit."""
    for step in list(_LIVE):
        step._loader = None


class _FlatModule(torch.nn.Module):
    """What torch.export sees: a module that owns no parameters and takes a flat tuple of
    tensors, which it puts back into ``fn``'s arguments (so their pytree types need no
    registering with export's serializer)."""

    def __init__(self, fn: Callable[..., Any], spec: pytree.TreeSpec, nones: list[int]) -> None:
        super().__init__()
        self.fn, self.spec, self.nones = fn, spec, nones

    def forward(self, *tensors: Tensor) -> Any:
        leaves: list[Tensor | None] = list(tensors)
        for index in self.nones:  # in increasing order, so each lands where it was
            leaves.insert(index, None)
        return self.fn(*pytree.tree_unflatten(leaves, self.spec))


class AotStep:
    """``fn(frame, *inputs)`` compiled by AOTInductor; called the same way, it returns the tuple
    of ``fn``'s output tensors.

    ``frame`` is a pytree of tensors (and Nones) that changes rarely, such as a model's weights
    and caches: its flat list is kept until another frame object comes in. ``inputs`` are plain
    tensors. ``dims`` mirrors ``(frame, *inputs)`` with, for each tensor, the ``{dim: Dim}`` of
    its dynamic dims (``{}`` for none).
    """

    def __init__(
        self, fn: Callable[..., Any], example: tuple[Any, ...], dims: tuple[Any, ...], *, name: str
    ) -> None:
        started = time.monotonic()
        leaves, spec = pytree.tree_flatten(example)
        if not all(leaf is None or isinstance(leaf, Tensor) for leaf in leaves):
            raise TypeError(f"{name}: every argument must be a pytree of tensors (and Nones)")
        flat_dims = pytree.tree_leaves(dims, is_leaf=lambda node: isinstance(node, dict))
        if len(flat_dims) != len(leaves):
            raise ValueError(f"{name}: {len(flat_dims)} dims entries for {len(leaves)} leaves")
        nones = [index for index, leaf in enumerate(leaves) if leaf is None]
        tensors = tuple(leaf for leaf in leaves if leaf is not None)
        tensor_dims = tuple(d for d, leaf in zip(flat_dims, leaves, strict=True) if leaf is not None)
        module = _FlatModule(fn, spec, nones)
        with torch.no_grad():  # forward(*tensors) is one argument to export: its dims nest once
            program = torch.export.export(module, tensors, dynamic_shapes=(tensor_dims,))
        if program.state_dict:
            raise ValueError(f"{name} holds parameters {sorted(program.state_dict)}: pass them in its frame")
        with tempfile.TemporaryDirectory(prefix="verst-aot-") as directory:
            package = str(Path(directory) / f"{name}.pt2")
            self._loader: Any = torch._inductor.aoti_load_package(
                torch._inductor.aoti_compile_and_package(program, package_path=package)
            ).loader
        self._inputs = len(tensors)
        _LIVE.add(self)
        self._frame: Any = None
        self._frame_tensors: list[Tensor] = []
        log.info("compiled %s ahead of time in %.1f s", name, time.monotonic() - started)

    def __call__(self, frame: Any, *inputs: Tensor) -> tuple[Tensor, ...]:
        if frame is not self._frame:
            self._frame = frame
            self._frame_tensors = [leaf for leaf in pytree.tree_leaves(frame) if leaf is not None]
        flat = [*self._frame_tensors, *inputs]
        if len(flat) != self._inputs:
            raise ValueError(f"{len(flat)} tensors for a step exported with {self._inputs}")
        if self._loader is None:
            raise RuntimeError("the step was released (the process is exiting)")
        return tuple(self._loader.boxed_run(flat))
