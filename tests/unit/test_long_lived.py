"""What lives as long as a process is frozen out of the collector's full passes: a service's
imports once it serves, and transformers with a job's tokenizer once one is loaded."""

from __future__ import annotations

import asyncio
import gc
import weakref
from collections.abc import Iterator
from pathlib import Path

import pytest

from services.common.config import JobSpec
from services.common.grpc_server import serve
from services.common.job_tokenizer import load_job_tokenizer
from services.common.long_lived import freeze_long_lived_objects, release_long_lived_objects
from services.common.pb import common_pb2
from services.common.settings import ServiceSettings
from services.tasks.addition_model import build_char_tokenizer


@pytest.fixture
def unfrozen() -> Iterator[None]:
    """Each test starts with nothing frozen and leaves nothing frozen."""
    gc.unfreeze()
    yield
    gc.unfreeze()


def test_a_loaded_job_tokenizer_is_out_of_the_collectors_reach(unfrozen: None, tmp_path: Path) -> None:
    build_char_tokenizer().save_pretrained(tmp_path)
    spec = JobSpec.model_validate({"name": "t", "model": {"path": "builtin:addition"}})
    handle = common_pb2.CheckpointHandle(job_id="j", version=0, uri=tmp_path.as_uri())
    tokenizer = load_job_tokenizer(spec, handle)
    assert tokenizer.decode(tokenizer.encode("12+3", add_special_tokens=False)) == "12+3"
    assert gc.get_freeze_count() > 1000  # the tokenizer and the modules loaded for it
    # frozen: tracked, yet in none of the generations a full pass walks
    assert gc.is_tracked(tokenizer.__dict__)
    assert not any(o is tokenizer.__dict__ for o in gc.get_objects())


def test_a_service_freezes_what_it_built_once_it_serves(unfrozen: None) -> None:
    seen: list[int] = []

    async def background(stop: asyncio.Event) -> None:
        seen.append(gc.get_freeze_count())
        stop.set()

    asyncio.run(serve(ServiceSettings(), background=background))
    assert seen and seen[0] > 1000


class Node:
    """An object in a cycle with itself: only a collection frees it."""

    def __init__(self) -> None:
        self.itself = self


def test_a_cycle_frozen_then_dropped_is_freed_once_released(unfrozen: None) -> None:
    node = Node()
    alive = weakref.ref(node)
    freeze_long_lived_objects()
    del node
    gc.collect()
    assert alive() is not None, "frozen: the collection did not walk it"
    release_long_lived_objects()  # what Policy.close does once a job ends
    assert alive() is None
