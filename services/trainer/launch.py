"""`python -m services.trainer.launch`: the trainer of a Kubernetes StatefulSet pod, launched
across pods by torchrun.

A StatefulSet gives each pod an ordinal (``VERST_TRAINER_POD_INDEX``, from the pod's
``apps.kubernetes.io/pod-index`` label). Every ``VERST_TRAINER_NODES`` consecutive pods make one
data parallel trainer: pod ``index`` is node ``index % NODES`` of trainer group ``index // NODES``,
and the group meets at its first pod, ``VERST_TRAINER_RENDEZVOUS_HOST_TEMPLATE.format(index=
group * NODES)`` (e.g. ``verst-trainer-{index}.verst-trainer-headless``), port
``VERST_TRAINER_RENDEZVOUS_PORT``. Each pod runs ``VERST_TRAINER_PROCS_PER_NODE`` ranks (one per
GPU). This process replaces itself (exec) with torchrun's static rendezvous over those nodes, or,
with one node of one process, with the trainer itself; either way the trainer's own
``VERST_TRAINER_*`` settings apply to every rank, and rank 0 (node 0's first process) alone talks
to Redis (services/trainer/server.py).

    python -m services.trainer.launch                      # runs `-m services.trainer` so
    python -m services.trainer.launch script.py ARGS...    # or another torchrun target
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

from pydantic import Field, ValidationError, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

DEFAULT_TARGET = ("-m", "services.trainer")
"""What each rank runs unless the command line names another script or module."""
TORCHRUN = ("-m", "torch.distributed.run")


class LaunchSettings(BaseSettings):
    """Where this pod stands among the trainer's pods (environment variables VERST_TRAINER_*)."""

    model_config = SettingsConfigDict(
        env_prefix="VERST_TRAINER_", extra="ignore", use_attribute_docstrings=True
    )
    service_name: ClassVar[str] = "trainer launch"

    pod_index: int | None = Field(None, ge=0, le=1_000_000)
    """This pod's StatefulSet ordinal; required with more than one node per trainer."""
    nodes: int = Field(1, ge=1, le=4096)
    """Pods (torchrun nodes) per trainer: consecutive ordinals make one trainer group."""
    procs_per_node: int = Field(1, ge=1, le=1024)
    """Trainer ranks on each pod (torchrun's --nproc_per_node): one per GPU."""
    rendezvous_host_template: str = Field("", max_length=253)
    """Host of a group's first pod, `{index}` standing for its ordinal; required with several nodes."""
    rendezvous_port: int = Field(29500, ge=1, le=65535)
    """Port of the rendezvous store on a group's first pod (torchrun's --master_port)."""
    rendezvous_timeout_s: int = Field(900, ge=10, le=86_400)
    """Longest a pod waits at the rendezvous for the other pods of its group to join."""

    @classmethod
    def env_name(cls, field: str) -> str:
        """The environment variable that sets ``field``."""
        return f"{cls.model_config.get('env_prefix', '')}{field}".upper()

    @field_validator("rendezvous_host_template")
    @classmethod
    def _template_formats(cls, value: str) -> str:
        try:
            host = value.format(index=0)
        except (KeyError, IndexError, ValueError) as err:
            raise ValueError(f"only `{{index}}` may stand in braces ({type(err).__name__}: {err})") from None
        if any(c.isspace() for c in host) or "/" in host:
            raise ValueError(f"{value!r} does not make a host name")
        return value

    @model_validator(mode="after")
    def _several_nodes_need_a_place(self) -> LaunchSettings:
        if self.nodes > 1:
            nodes = self.env_name("nodes")
            if self.pod_index is None:
                raise ValueError(f"{self.env_name('pod_index')} is required when {nodes} is above 1")
            if not self.rendezvous_host_template:
                name = self.env_name("rendezvous_host_template")
                raise ValueError(f"{name} is required when {nodes} is above 1")
        return self


@dataclass(frozen=True, slots=True)
class Placement:
    """This pod's place: its trainer group, its node rank in it, and the group's rendezvous host."""

    group: int
    node_rank: int
    master_host: str


def placement(settings: LaunchSettings) -> Placement:
    """Group ``index // nodes``, node rank ``index % nodes``, meeting at the group's first pod."""
    index = settings.pod_index or 0
    group = index // settings.nodes
    host = settings.rendezvous_host_template.format(index=group * settings.nodes)
    return Placement(group, index % settings.nodes, host)


def launch_argv(settings: LaunchSettings, target: Sequence[str], python: str) -> list[str]:
    """The command this process becomes: the target alone (one process), or torchrun over it."""
    if settings.nodes == 1 and settings.procs_per_node == 1:
        return [python, *target]
    ranks = f"--nproc_per_node={settings.procs_per_node}"
    if settings.nodes == 1:  # one pod: its ranks meet on a free local port, no DNS involved
        return [python, *TORCHRUN, "--standalone", "--nnodes=1", ranks, *target]
    place = placement(settings)
    return [
        python,
        *TORCHRUN,
        f"--nnodes={settings.nodes}",
        f"--node_rank={place.node_rank}",
        ranks,
        f"--master_addr={place.master_host}",
        f"--master_port={settings.rendezvous_port}",
        f"--rdzv_conf=timeout={settings.rendezvous_timeout_s}",
        *target,
    ]


def target_of(args: Sequence[str]) -> list[str]:
    """The script or ``-m module`` (and its arguments) each rank runs: ``args`` less a leading
    ``--``, or the trainer service when there are none."""
    rest = list(args[1:] if args and args[0] == "--" else args)
    if not rest:
        return list(DEFAULT_TARGET)
    if rest[0] == "-m" and len(rest) < 2:
        raise SystemExit("trainer launch: `-m` needs a module name")
    return rest


def load_launch_settings() -> LaunchSettings:
    """The settings from the environment; on a bad value, exit naming the variable."""
    try:
        return LaunchSettings()
    except ValidationError as err:
        for error in err.errors():
            field = str(error["loc"][0]) if error["loc"] else ""
            name = LaunchSettings.env_name(field) if field in LaunchSettings.model_fields else "settings"
            message = str(error["msg"]).removeprefix("Value error, ")
            print(f"{LaunchSettings.service_name}: invalid {name}: {message}", file=sys.stderr)
        raise SystemExit(2) from None


def describe(settings: LaunchSettings, argv: Sequence[str]) -> str:
    """One line saying where this pod stands and what it runs."""
    if settings.nodes == 1:
        where = f"one node of {settings.procs_per_node} rank(s)"
    else:
        place = placement(settings)
        where = (
            f"pod {settings.pod_index}: node {place.node_rank} of {settings.nodes} in trainer group"
            f" {place.group}, {settings.procs_per_node} rank(s) each, meeting at"
            f" {place.master_host}:{settings.rendezvous_port}"
        )
    return f"{LaunchSettings.service_name}: {where}; exec {' '.join(argv)}"


def main(args: Sequence[str] | None = None) -> None:
    """Read the settings, say where this pod stands, and become the launch command."""
    settings = load_launch_settings()
    argv = launch_argv(settings, target_of(sys.argv[1:] if args is None else args), sys.executable)
    print(describe(settings, argv), file=sys.stderr, flush=True)
    os.execv(argv[0], argv)


if __name__ == "__main__":
    main()
