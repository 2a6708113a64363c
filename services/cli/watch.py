"""`verst watch <job>`: a job followed live in the terminal, until it ends.

It reads the job's Server-Sent Events (``GET /v1/jobs/{id}/events``, services/api/events.py) with
httpx-sse and shows them as a progress bar of trainer steps (tqdm) with the latest reward, loss and
held-out accuracy, and one line per state change, evaluation, warning and dead letter. A dropped
connection is opened again with ``Last-Event-ID``, so nothing is shown twice or skipped; it gives up
after ``--give-up-s`` without one. With ``--json``, each event's JSON on a line of its own instead.
The exit status is 0 when the job succeeded, 1 otherwise.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Iterator
from typing import Any, TextIO

import httpx
from httpx_sse import connect_sse
from tqdm import tqdm

from services.cli.options import Subcommands, new_command
from services.client import TERMINAL_STATES, auth_headers, get_job

SUCCEEDED = "JOB_STATE_SUCCEEDED"
RECONNECT_DELAY_S = 1.0
"""Pause before opening a dropped stream again."""
READ_TIMEOUT_S = 60.0
"""Longest silence on an open stream (the api sends a heartbeat every 15 s by default)."""
SHOWN = {"trainer": ("reward_mean", "loss"), "eval": ("accuracy",)}
"""Metrics the progress bar shows, by source."""
SCORES = ("accuracy", "pass@", "mean@")
"""An evaluation's line shows the values whose name (after a set's ``<name>/``) starts so."""


class WatchError(Exception):
    """The stream cannot be followed (refused, or lost for longer than the give-up time)."""


def follow_events(
    api: str, job_id: str, *, give_up_s: float, read_timeout_s: float = READ_TIMEOUT_S
) -> Iterator[dict[str, Any]]:
    """The job's events (their JSON data) from the first, reconnecting with Last-Event-ID when the
    stream drops; ends after the job's terminal state event."""
    url = f"{api}/v1/jobs/{job_id}/events"
    last_id = ""
    lost_since: float | None = None
    timeout = httpx.Timeout(10.0, read=read_timeout_s)
    with httpx.Client(timeout=timeout, headers=auth_headers()) as client:
        while True:
            headers = {"Last-Event-ID": last_id} if last_id else {}
            try:
                with connect_sse(client, "GET", url, headers=headers) as source:
                    _check(source.response, job_id)
                    for sse in source.iter_sse():
                        lost_since = None
                        if not sse.data:  # a heartbeat: httpx-sse gives comments as empty events
                            continue
                        last_id = sse.id or last_id
                        data = json.loads(sse.data)
                        yield data
                        if data.get("kind") == "state" and data.get("state") in TERMINAL_STATES:
                            return
                problem = "the stream ended before the job did"
            except (httpx.TransportError, httpx.HTTPStatusError) as err:
                problem = f"{type(err).__name__}: {err}"
            lost_since = lost_since or time.monotonic()
            if time.monotonic() - lost_since > give_up_s:
                raise WatchError(f"lost the event stream for {give_up_s:.0f}s ({problem})")
            time.sleep(RECONNECT_DELAY_S)


def _check(response: httpx.Response, job_id: str) -> None:
    """Refusals end the watch; a 5xx is retried (raised as HTTPStatusError)."""
    if response.status_code == 404:
        raise WatchError(f"no job {job_id!r}")
    if response.status_code == 401:
        raise WatchError("the api wants a token: set VERST_API_TOKEN")
    if 400 <= response.status_code < 500:
        raise WatchError(f"the api refused: {response.status_code} {response.read().decode()[:200]}")
    response.raise_for_status()


class JobView:
    """A tqdm bar of the job's trainer steps, and one line per event worth reading."""

    def __init__(self, job: dict[str, Any], out: TextIO) -> None:
        self.job_id = job["job_id"]
        self.out = out
        self.shown: dict[str, float] = {}
        steps = int(job.get("spec", {}).get("trainer", {}).get("steps", 0)) or None
        # disable=None: no bar where out is not a terminal; the lines are written still
        self.bar = tqdm(
            total=steps, desc=self.job_id, unit="step", file=out, disable=None, dynamic_ncols=True
        )

    def show(self, event: dict[str, Any]) -> None:
        kind = event.get("kind")
        if kind == "state":
            reason = f": {event['reason']}" if event.get("reason") else ""
            self._line(f"{event['state'].removeprefix('JOB_STATE_').lower()}{reason}")
        elif kind in ("metrics", "evaluation"):
            self._metrics(event)
        elif kind == "warning":
            self._line(f"warning: {event['message']}")
        elif kind == "dead_letter":
            stream = event["source_stream"].rsplit(":", 1)[-1]
            self._line(f"dead letter from the {stream} stream: {event['reason']}")

    def _metrics(self, event: dict[str, Any]) -> None:
        values = event.get("values", {})
        for name in SHOWN.get(event["source"], ()):
            if values.get(name) is not None:
                self.shown[name] = values[name]
        if event["source"] == "trainer" and event["step"] > self.bar.n:
            self.bar.update(min(event["step"], self.bar.total or event["step"]) - self.bar.n)
        self.bar.set_postfix({name: f"{value:.3g}" for name, value in self.shown.items()}, refresh=True)
        if event["kind"] == "evaluation":
            scores = ", ".join(
                f"{name} {value:.3f}"
                for name, value in sorted(values.items())
                if value is not None and name.rpartition("/")[2].startswith(SCORES)
            )
            self._line(f"evaluation of v{event['policy_version']}: {scores}")

    def _line(self, text: str) -> None:
        self.bar.write(f"{self.job_id}: {text}", file=self.out)

    def close(self) -> None:
        self.bar.close()


def watch_job(
    api: str, job_id: str, *, give_up_s: float, out: TextIO | None = None, as_json: bool = False
) -> int:
    """Follow the job until it ends; 0 when it succeeded, 1 when it failed or was cancelled."""
    out = out or sys.stdout
    job = get_job(api, job_id)
    view = None if as_json else JobView(job, out)
    state = job["state"]
    try:
        for event in follow_events(api, job_id, give_up_s=give_up_s):
            state = event["state"] if event.get("kind") == "state" else state
            if view is None:
                print(json.dumps(event), file=out, flush=True)
            else:
                view.show(event)
    finally:
        if view is not None:
            view.close()
    return 0 if state == SUCCEEDED else 1


def cmd_watch(args: argparse.Namespace) -> int:
    try:
        return watch_job(args.api, args.job, give_up_s=args.give_up_s, as_json=args.json)
    except WatchError as err:
        print(f"verst watch: {err}", file=sys.stderr)
        return 1


def add_watch(commands: Subcommands) -> None:
    watch = new_command(
        commands,
        "watch",
        "follow a job live (progress, metrics, evaluations, warnings) until it ends",
        cmd_watch,
        more="With --json, one event per line as the api sends it. Exit status 0 when the job succeeded.",
    )
    watch.add_argument("job", help="job id")
    watch.add_argument(
        "--give-up-s", type=float, default=60.0, help="stop after this long without a connection (seconds)"
    )
