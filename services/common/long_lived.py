"""Objects that live as long as the process, kept out of the garbage collector's full passes.

A service's imports, and far more transformers' (a job's tokenizer: ~300k objects), a loaded
model or a compiled step (dynamo's and inductor's graphs: ~600k), stay alive for long. Every
full collection walks them all: 0.15 s in a runner holding a tokenizer, 0.3 to 0.6 s with a
compiled model, a stall of whichever thread allocated (the event loop, a decode step, a training
step). In bench/control_plane.py the runner spent 1.7 s of 45 in 12 such passes. Frozen
(``gc.freeze``), they are skipped.
"""

from __future__ import annotations

import gc


def freeze_long_lived_objects() -> None:
    """Put every object alive now out of the collector's reach; collecting first keeps garbage
    out of the freeze. Call it when what was just built lives on (a server, a job's tokenizer,
    model or optimiser). Frozen objects that die later are freed by their reference counts;
    cycles among them only once ``release_long_lived_objects`` hands them back."""
    gc.collect()
    gc.freeze()


def release_long_lived_objects() -> None:
    """Hand every frozen object back to the collector and collect: what was dropped since it
    was frozen (a finished job's engine) is freed now, its cycles included."""
    gc.unfreeze()
    gc.collect()
