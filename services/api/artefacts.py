"""A job's saved weights over REST: ``GET /v1/jobs/{id}/checkpoints`` lists them and
``GET /v1/jobs/{id}/checkpoints/{version}/archive`` streams one directory as a tar.gz.

What a job's checkpoint directory holds is read through its owner's view
(services/common/checkpoint_layout.py's ``SavedVersions``), where the job's spec says
(``trainer.checkpoint_dir``, relative to the api's working directory when relative). An archive
holds exactly the entry's regular files, never a symbolic link or anything that resolves outside
the entry's directory; it is written by a thread into a bounded queue on the event loop that the
response drains, so a download holds QUEUE_CHUNKS chunks of memory at most, whatever the
checkpoint's size, and no worker thread waits on a slow client.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import tarfile
import threading
import time
from collections.abc import AsyncIterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Annotated, Any

from fastapi import FastAPI, HTTPException, Request, status
from fastapi import Path as PathParam
from fastapi.responses import StreamingResponse
from pydantic import BaseModel, ConfigDict

from services.api.config import ApiSettings
from services.api.guard import JobId, error_responses
from services.common.checkpoint_layout import ENTRY_REF, EntryKind, SavedEntry, SavedVersions
from services.common.jobs import JobNotFoundError, JobStore

log = logging.getLogger(__name__)

CHUNK_BYTES = 1 << 20
"""The archive goes out in chunks of about this size."""
QUEUE_CHUNKS = 8
"""Chunks written ahead of the client at most: a download's memory bound."""
STALL_S = 60.0
"""A client that takes no chunk for this long ends its download (the writer thread stops)."""

Version = Annotated[
    str,
    PathParam(
        pattern=ENTRY_REF.pattern,
        max_length=40,
        description="A policy version (its durable checkpoint, else its newest weights-only copy) or an"
        " entry's name as listed: `v000003`, `v000003-e1`, `base`.",
    ),
]


class CheckpointView(BaseModel):
    """One saved directory of a job."""

    model_config = ConfigDict(use_attribute_docstrings=True)

    name: str
    """Its name in the archive route: `v000003` (durable), `v000003-e1` (weights-only), `base`."""
    kind: EntryKind
    """`durable` (weights, optimiser state, what it consumed: a trainer resumes from it), `weights`
    (weights-only, for the engines: the newest few are kept) or `base` (a LoRA job's base model)."""
    lora_adapter: bool
    """Its weights are a LoRA adapter of the job's `base` (adapter_model.safetensors)."""
    version: int
    epoch: int
    """The trainer lineage: one more each time a trainer starts or resumes the job."""
    step: int
    created_at: datetime | None
    size_bytes: int
    """All its files, in bytes: what the archive holds before compression."""
    uri: str
    """Where it lies on the api's host (file://)."""

    @classmethod
    def of(cls, entry: SavedEntry) -> CheckpointView:
        handle = entry.handle
        created = handle.created_at.ToDatetime(UTC) if handle.HasField("created_at") else None
        return cls(
            name=entry.name,
            kind=entry.kind,
            lora_adapter=handle.HasField("adapter"),
            version=handle.version,
            epoch=handle.epoch,
            step=handle.step,
            created_at=created,
            size_bytes=entry.size_bytes(),
            uri=entry.directory.as_uri(),
        )


class CheckpointList(BaseModel):
    model_config = ConfigDict(use_attribute_docstrings=True)

    job_id: str
    checkpoints: list[CheckpointView]
    """The base first, then oldest first by (epoch, version); a version both weights-only and
    durable is listed twice."""


async def saved_versions(request: Request, job_id: str, settings: ApiSettings) -> SavedVersions:
    """The owner's view of the job's checkpoint directory; 404 when there is no such job, or
    its directory lies outside VERST_CHECKPOINT_ROOT (when that is set)."""
    store: JobStore = request.app.state.store
    try:
        spec = await store.spec(job_id)
    except JobNotFoundError:
        raise HTTPException(status.HTTP_404_NOT_FOUND, f"no job {job_id!r}") from None
    saved = SavedVersions(Path(spec.trainer.checkpoint_dir), job_id)
    root = settings.checkpoint_root_path()
    if root is not None and not saved.job_dir.is_relative_to(root):
        raise HTTPException(
            status.HTTP_404_NOT_FOUND, f"job {job_id}'s checkpoints lie outside VERST_CHECKPOINT_ROOT"
        )
    return saved


Chunk = bytes | BaseException | None
"""A piece of the archive, the error that ended it early, or None: its end."""


class _Sink:
    """The file tarfile writes into (from the writer thread): chunks of CHUNK_BYTES onto the
    event loop's bounded queue, waiting while it is full, until the reader stops or STALL_S."""

    def __init__(
        self, chunks: asyncio.Queue[Chunk], loop: asyncio.AbstractEventLoop, stop: threading.Event
    ) -> None:
        self.chunks = chunks
        self.loop = loop
        self.stop = stop
        self.buffer = bytearray()

    def write(self, data: bytes) -> int:
        self.buffer += data
        if len(self.buffer) >= CHUNK_BYTES:
            self.put(bytes(self.buffer))
            self.buffer.clear()
        return len(data)

    def put(self, item: Chunk) -> None:
        future = asyncio.run_coroutine_threadsafe(self.chunks.put(item), self.loop)
        deadline = time.monotonic() + STALL_S
        while not self.stop.is_set() and time.monotonic() < deadline:
            try:
                future.result(timeout=0.5)
                return
            except concurrent.futures.TimeoutError:
                continue
        future.cancel()
        raise ConnectionAbortedError("the client stopped reading the archive")


def write_archive(entry: SavedEntry, prefix: str, sink: _Sink) -> None:
    """The entry's files as a tar.gz under ``prefix/``, into ``sink``; its end (None) or the
    error that stopped it, last."""
    try:
        with tarfile.open(fileobj=sink, mode="w|gz") as tar:  # type: ignore[call-overload]
            root = entry.directory.resolve()
            for relative in entry.files():
                tar.add(root / relative, arcname=f"{prefix}/{relative}", recursive=False)
        sink.put(bytes(sink.buffer))
        sink.put(None)
    except (ConnectionAbortedError, RuntimeError):  # the reader left, or the api's loop stopped
        return
    except Exception as err:  # a file pruned or unreadable mid-way: the client must see a failure
        log.warning("archive of %s ended early: %s", entry.directory, err)
        with contextlib.suppress(ConnectionAbortedError, RuntimeError):
            sink.put(err)


async def stream_archive(entry: SavedEntry, prefix: str) -> AsyncIterator[bytes]:
    chunks: asyncio.Queue[Chunk] = asyncio.Queue(maxsize=QUEUE_CHUNKS)
    stop = threading.Event()
    sink = _Sink(chunks, asyncio.get_running_loop(), stop)
    threading.Thread(target=write_archive, args=(entry, prefix, sink), daemon=True).start()
    try:
        while True:
            item = await asyncio.wait_for(chunks.get(), STALL_S)
            if item is None:
                return
            if isinstance(item, BaseException):  # ends the response unfinished: no valid gzip end
                raise RuntimeError(f"the archive of {entry.directory} ended early: {item}")
            yield item
    finally:
        stop.set()


def add_artefact_routes(app: FastAPI, settings: ApiSettings) -> None:
    @app.get("/v1/jobs/{job_id}/checkpoints", tags=["artefacts"], responses=error_responses(401, 404, 503))
    async def list_checkpoints(job_id: JobId, request: Request) -> CheckpointList:
        """The job's saved directories on the api's host: durable checkpoints, weights-only
        versions (the newest few the trainer keeps) and a LoRA job's base model."""
        saved = await saved_versions(request, job_id, settings)
        entries = await asyncio.to_thread(lambda: [CheckpointView.of(entry) for entry in saved.entries()])
        return CheckpointList(job_id=job_id, checkpoints=entries)

    archive_responses: dict[int | str, dict[str, Any]] = {
        200: {"content": {"application/gzip": {}}, "description": "The directory's files as a tar.gz."},
        **error_responses(401, 404, 503),
    }

    @app.get(
        "/v1/jobs/{job_id}/checkpoints/{version}/archive",
        tags=["artefacts"],
        response_class=StreamingResponse,
        responses=archive_responses,
    )
    async def checkpoint_archive(job_id: JobId, version: Version, request: Request) -> StreamingResponse:
        """One saved directory as a tar.gz, streamed: its regular files under `<job>-<name>/`. A
        weights-only version pruned by the trainer during the download ends the stream early (the
        gzip is then incomplete: keep durable checkpoints for downloads). 404 names what is saved."""
        saved = await saved_versions(request, job_id, settings)
        try:
            entry = await asyncio.to_thread(saved.entry, version)
        except LookupError as err:
            raise HTTPException(status.HTTP_404_NOT_FOUND, str(err)) from None
        if not entry.directory.resolve().is_relative_to(saved.job_dir):
            raise HTTPException(status.HTTP_404_NOT_FOUND, f"{entry.name} lies outside {saved.job_dir}")
        prefix = f"{job_id}-{entry.name}"
        headers = {"Content-Disposition": f'attachment; filename="{prefix}.tar.gz"'}
        return StreamingResponse(
            stream_archive(entry, prefix), media_type="application/gzip", headers=headers
        )
