"""The whole verst stack as local processes: what `verst up` and `verst demo` run.

Redis (embedded unless REDIS_URL is set), then the reward service, the trainers,
the rollout engines, the router, the runner and the api (which runs the job controller, unless
``separate_controller`` gives it a process of its own), each a child process
with its log in one folder. Children die with the stack: on `stop()`, on
Ctrl-C, and (Linux) when the `verst` process itself is killed. With ``port_base`` every port
comes from one layout (services/stack_ports.py); with ``supervise`` a child that ends on its own
is restarted with backoff (services/supervisor.py).
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

from services.common.healthcheck import grpc_serving, http_ok
from services.common.parented import parented
from services.common.redis_server import EmbeddedRedis, free_port
from services.common.service_logs import log_path as service_log_path
from services.stack_ports import check_free, port_layout
from services.supervisor import RestartPolicy, Supervisor

log = logging.getLogger(__name__)

STOP_TIMEOUT_S = 20.0


@dataclass
class Child:
    """One service process of the stack."""

    name: str
    args: list[str]
    env: dict[str, str]
    health: tuple[str, str]
    """("grpc", "host:port") or ("http", url): how to tell it is ready."""
    process: subprocess.Popen[bytes] | None = None
    log_file: IO[bytes] | None = None


@dataclass
class StackConfig:
    """Where the stack listens and writes. Port 0 picks a free port."""

    log_dir: Path = Path(".verst/logs")
    redis_dir: Path | None = None
    """Persist the embedded Redis here (append-only file); None keeps it in memory."""
    engines: int = 1
    trainers: int = 1
    """Trainer processes (trainer-0..N-1), each training one job at a time, so up to N jobs run at
    once; 0: another process consumes the jobs, as bench/control_plane.py's."""
    api_port: int = 8000
    router_port: int = 50051
    engine_port: int = 50052
    engine_metrics_port: int = 9400
    """HTTP /metrics of engine-0; the other engines get free ports (their logs say which)."""
    reward_port: int = 50053
    trainer_port: int = 50054
    """gRPC port of trainer-0; the other trainers get free ports (their logs say which)."""
    runner_port: int = 50055
    separate_controller: bool = False
    """Run the job controller as its own process instead of inside the api."""
    controller_port: int = 50056
    controller_metrics_port: int = 9466
    host: str = "127.0.0.1"
    extra_env: dict[str, str] = field(default_factory=dict)
    ready_timeout_s: float = 180.0
    port_base: int | None = None
    """Take every port from services/stack_ports.py's layout from this base (the *_port fields
    are then ignored), so stacks with bases a span apart share a host; None: the fields."""
    supervise: bool = False
    """Restart a child that ends on its own, with backoff (services/supervisor.py); `verst up`
    sets it. Off, a child's end is an error of ``check_alive``, as tests want."""
    restart_policy: RestartPolicy = field(default_factory=RestartPolicy)
    """When ``supervise`` restarts a child: backoff, its cap and reset, the crash-loop window."""

    def resolved(self) -> StackConfig:
        """A copy with the ports of ``port_base``'s layout, else every 0 port replaced by a free one."""
        if self.port_base is not None:
            layout = port_layout(self.port_base, engines=self.engines, trainers=self.trainers)
            ports = {name: layout.get(part, getattr(self, name)) for name, part in FIELD_PORTS.items()}
        else:
            ports = {name: getattr(self, name) or free_port(self.host) for name in FIELD_PORTS}
        return StackConfig(**{**vars(self), **ports})


FIELD_PORTS = {
    "api_port": "api", "router_port": "router", "engine_port": "engine-0",
    "engine_metrics_port": "engine-0 metrics", "reward_port": "reward", "trainer_port": "trainer-0",
    "runner_port": "runner", "controller_port": "controller", "controller_metrics_port": "controller metrics",
}  # fmt: skip
"""Each StackConfig port field and its name in the port plan (services/stack_ports.py)."""


def thread_split(engines: int, cores: int, trainers: int = 1) -> dict[str, str]:
    """Torch threads for each trainer and each engine: every core shared by the trainers, the busy
    stage (the engines keep ``max_staleness`` versions of work ahead of each and wait on it), at
    least one each, and half the cores shared by the engines, at least one each. Torch's default
    (every core for every process) has the engines' and the trainers' OpenMP teams spin against
    each other; the environment (or ``extra_env``) overrides these."""
    engine = max(1, cores // 2 // max(1, engines))
    trainer = max(1, cores // max(1, trainers))
    return {"VERST_TRAINER_TORCH_THREADS": str(trainer), "VERST_ENGINE_TORCH_THREADS": str(engine)}


class Stack:
    """Starts, watches and stops the services of one local verst deployment."""

    def __init__(self, config: StackConfig) -> None:
        self.config = config.resolved()
        self.redis: EmbeddedRedis | None = None
        self.redis_url = ""
        self.children: list[Child] = []
        self.ports = self._port_plan()
        """Every port the stack binds, by what binds it (``router``, ``engine-0 metrics``)."""
        self.metrics_ports: dict[str, int] = {}
        """Each child's Prometheus /metrics port, by child name (the api serves it on its own port)."""
        self.lock = threading.Lock()
        """Held while children are started, replaced or stopped: the supervisor and ``stop`` take turns."""
        self.supervisor: Supervisor | None = None

    @property
    def api_url(self) -> str:
        return f"http://{self.config.host}:{self.config.api_port}"

    def start(self) -> None:
        """Check the ports, start everything, wait until every service reports healthy, then
        (``supervise``) start watching them."""
        cfg = self.config
        cfg.log_dir.mkdir(parents=True, exist_ok=True)
        self.redis_url = os.environ.get("REDIS_URL", "")
        check_free(self._ports_to_bind(), cfg.host)
        if not self.redis_url:
            self.redis = EmbeddedRedis(cfg.redis_dir, port=self.ports.get("redis"))
            self.redis_url = self.redis.start()
        try:
            for child in self._plan():
                self._spawn(child)
            log.info(
                "/metrics on %s", ", ".join(f"{name} :{port}" for name, port in self.metrics_ports.items())
            )
            self.wait_ready()
            if cfg.supervise:
                self.supervisor = Supervisor(self, cfg.restart_policy, self.redis_url)
                self.supervisor.start()
        except BaseException:
            self.stop()
            raise

    def _port_plan(self) -> dict[str, int]:
        """The layout of ``port_base``; else the config's ports, free ones for the rest (the
        embedded Redis then picks its own)."""
        cfg = self.config
        if cfg.port_base is not None:
            return port_layout(cfg.port_base, engines=cfg.engines, trainers=cfg.trainers)
        ports = {part: getattr(cfg, name) for name, part in FIELD_PORTS.items()}
        for name in ("router", "reward", "runner"):
            ports[f"{name} metrics"] = free_port(cfg.host)
        for index in range(1, cfg.engines):
            ports |= {f"engine-{index}": free_port(cfg.host), f"engine-{index} metrics": free_port(cfg.host)}
        for index in range(cfg.trainers):
            ports[f"trainer-{index}"] = cfg.trainer_port if index == 0 else free_port(cfg.host)
            ports[f"trainer-{index} metrics"] = free_port(cfg.host)
        if cfg.engines == 0:
            del ports["engine-0"], ports["engine-0 metrics"]
        if cfg.trainers == 0:
            ports.pop("trainer-0", None)
        return ports

    def _ports_to_bind(self) -> dict[str, int]:
        """The planned ports something of this stack will listen on."""
        unused = set() if self.config.separate_controller else {"controller", "controller metrics"}
        if os.environ.get("REDIS_URL"):
            unused.add("redis")
        return {name: port for name, port in self.ports.items() if name not in unused}

    def _plan(self) -> list[Child]:
        cfg = self.config
        host = cfg.host
        ports = self.ports
        router = f"{host}:{cfg.router_port}"
        reward = f"{host}:{cfg.reward_port}"
        base = {
            **os.environ,
            **cfg.extra_env,
            "REDIS_URL": self.redis_url,
            "PYTHONUNBUFFERED": "1",
        }
        base = {**thread_split(cfg.engines, os.cpu_count() or 1, cfg.trainers), **base}
        py = [sys.executable, "-m"]
        self.metrics_ports = {}
        children = [
            Child("reward", [*py, "services.reward"], {**base, "VERST_REWARD_PORT": str(cfg.reward_port),
                  "VERST_REWARD_METRICS_PORT": self._metrics_port("reward")}, ("grpc", reward)),
        ]  # fmt: skip
        for index in range(cfg.trainers):
            name = f"trainer-{index}"
            env = {
                "VERST_TRAINER_WEIGHT_TRANSPORT_HOST": host,
                **base,
                "VERST_TRAINER_PORT": str(ports[name]),
                "VERST_TRAINER_METRICS_PORT": self._metrics_port(name),
            }
            if f"{name} weights" in ports:  # port_base: the TCPStore too (else a free one when it binds)
                env["VERST_TRAINER_WEIGHT_TRANSPORT_PORT"] = str(ports[f"{name} weights"])
            children.append(Child(name, [*py, "services.trainer"], env, ("grpc", f"{host}:{ports[name]}")))
        for index in range(cfg.engines):
            name = f"engine-{index}"
            env = {
                "VERST_ENGINE_WEIGHT_TRANSPORT_HOST": host,  # the weight group's address, as the trainer's
                **base,
                "VERST_ENGINE_PORT": str(ports[name]),
                "VERST_ENGINE_METRICS_PORT": self._metrics_port(name),
                "VERST_ENGINE_ENGINE_ID": name,
            }
            if f"{name} sglang" in ports:  # port_base: a launched SGLang server's port too
                env["VERST_ENGINE_SGLANG_PORT"] = str(ports[f"{name} sglang"])
            children.append(Child(name, [*py, "services.rollout"], env, ("grpc", f"{host}:{ports[name]}")))
        children += [
            Child("router", [*py, "services.router"], {**base, "VERST_ROUTER_PORT": str(cfg.router_port),
                  "VERST_ROUTER_METRICS_PORT": self._metrics_port("router")}, ("grpc", router)),
            Child("runner", [*py, "services.runner"],
                  {**base, "VERST_RUNNER_PORT": str(cfg.runner_port), "VERST_RUNNER_ROUTER_ADDRESS": router,
                   "VERST_RUNNER_REWARD_ADDRESS": reward,
                   "VERST_RUNNER_METRICS_PORT": self._metrics_port("runner")},
                  ("grpc", f"{host}:{cfg.runner_port}")),
        ]  # fmt: skip
        return children + self._control_plane(base, router, reward)

    def _control_plane(self, base: dict[str, str], router: str, reward: str) -> list[Child]:
        """The api, and the controller when it runs as a process of its own."""
        cfg = self.config
        py = [sys.executable, "-m"]
        children = []
        controller = {"VERST_CONTROLLER_ROUTER_ADDRESS": router, "VERST_CONTROLLER_REWARD_ADDRESS": reward}
        api = {**base, "VERST_API_PORT": str(cfg.api_port), "VERST_API_ROUTER_ADDRESS": router,
               "VERST_API_REWARD_ADDRESS": reward,
               "VERST_API_LOG_DIR": str(cfg.log_dir.resolve())}  # fmt: skip
        if cfg.separate_controller:
            controller |= {
                "VERST_CONTROLLER_PORT": str(cfg.controller_port),
                "VERST_CONTROLLER_METRICS_PORT": self._metrics_port("controller"),
            }
            address = f"{cfg.host}:{cfg.controller_port}"
            children.append(Child("controller", [*py, "services.controller"], {**base, **controller},
                                  ("grpc", address)))  # fmt: skip
            api["VERST_API_CONTROLLER"] = "false"
        else:
            api |= controller
        children.append(Child("api", [*py, "services.api"], api, ("http", f"{self.api_url}/healthz")))
        self.metrics_ports["api"] = cfg.api_port
        return children

    def _metrics_port(self, name: str) -> str:
        """The /metrics port of child ``name`` from the port plan; recorded."""
        self.metrics_ports[name] = self.ports[f"{name} metrics"]
        return str(self.metrics_ports[name])

    def _spawn(self, child: Child, *, replacing: int | None = None, why: str = "") -> None:
        """Start ``child``: appended to the children, or in place of the one at ``replacing``
        (the stop order stays); ``why`` is noted in its log first."""
        log_path = service_log_path(self.config.log_dir, child.name)
        child.log_file = log_path.open("ab")
        if why:
            child.log_file.write(f"--- verst: starting {child.name} again ({why}) ---\n".encode())
            child.log_file.flush()
        try:
            child.process = subprocess.Popen(
                parented(child.args),  # dies with this process
                env=child.env,
                stdout=child.log_file,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,  # Ctrl-C reaches `verst`, which stops children in order
            )
        except OSError:
            child.log_file.close()
            raise
        if replacing is None:
            self.children.append(child)
        else:
            self.children[replacing] = child
        log.info("started %s (pid %d), log %s", child.name, child.process.pid, log_path)

    def running(self) -> dict[str, subprocess.Popen[bytes]]:
        """Each child's current process, by name (the supervisor's view; the lock held)."""
        return {child.name: child.process for child in self.children if child.process is not None}

    def respawn(self, name: str, why: str = "") -> subprocess.Popen[bytes]:
        """Start child ``name`` again with its command, environment and ports, in its place; the
        old process must have ended. Callers hold the lock."""
        [index] = [i for i, child in enumerate(self.children) if child.name == name]
        old = self.children[index]
        if old.log_file is not None:
            old.log_file.close()
        again = Child(old.name, old.args, old.env, old.health)
        self._spawn(again, replacing=index, why=why)
        assert again.process is not None
        return again.process

    def peak_memory(self) -> dict[str, int]:
        """Each running child's peak resident memory so far, in bytes (the kernel's VmHWM; Linux)."""
        peaks: dict[str, int] = {}
        for child in self.children:
            if child.process is None or child.process.poll() is not None:
                continue
            try:
                status = Path(f"/proc/{child.process.pid}/status").read_text()
            except OSError:  # not Linux, or it just ended
                continue
            for line in status.splitlines():
                if line.startswith("VmHWM:"):
                    peaks[child.name] = int(line.split()[1]) * 1024
        return peaks

    def wait_ready(self) -> None:
        """Block until every child is healthy; raise naming the one that died or hung."""
        deadline = time.monotonic() + self.config.ready_timeout_s
        for child in list(self.children):
            self._wait_healthy(child, deadline)

    def check_alive(self) -> None:
        """Raise if a child exited, with the end of its log. Supervised, an exit is the
        supervisor's to handle: raise only if the supervisor itself is gone."""
        if self.supervisor is not None:
            if not self.supervisor.alive() and not self.supervisor.stopping.is_set():
                raise RuntimeError("the supervisor thread ended: children are no longer restarted")
            return
        for child in self.children:
            if child.process is not None and child.process.poll() is not None:
                status = child.process.returncode
                raise RuntimeError(f"{child.name} exited with status {status}:\n{self.log_tail(child.name)}")

    def restart(self, name: str, *, kill: bool = True) -> None:
        """Stop one child (SIGKILL, or SIGTERM with ``kill=False``) and start it again with the same
        command, environment and ports; returns once it is healthy again. Under the lock, so a
        supervisor never takes this end for a crash."""
        with self.lock:
            [child] = [c for c in self.children if c.name == name]
            assert child.process is not None
            if kill:
                child.process.kill()
            else:
                child.process.terminate()
            child.process.wait(timeout=STOP_TIMEOUT_S)
            self.respawn(name, "restarted on request")
            [again] = [c for c in self.children if c.name == name]
        self._wait_healthy(again, time.monotonic() + self.config.ready_timeout_s)

    def restart_redis(self, down_s: float) -> None:
        """Stop the embedded Redis (SIGTERM: it flushes its append-only file), keep it down for
        ``down_s``, and start it again on the same port from that file."""
        if self.redis is None or self.redis.data_dir is None:
            raise RuntimeError("only an embedded Redis with a data directory can be restarted")
        self.redis.stop()
        time.sleep(down_s)
        self.redis.start()

    def _wait_healthy(self, child: Child, deadline: float) -> None:
        kind, target = child.health
        while not (grpc_serving if kind == "grpc" else http_ok)(target):
            self.check_alive()
            if time.monotonic() > deadline:
                raise RuntimeError(f"{child.name} not healthy after {self.config.ready_timeout_s}s: "
                                   f"{self.log_tail(child.name)}")  # fmt: skip
            time.sleep(0.2)

    def log_tail(self, name: str, lines: int = 30) -> str:
        path = service_log_path(self.config.log_dir, name)
        if not path.exists():
            return "(no log)"
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])

    def stop(self) -> None:
        """Stop the supervisor (no restart begins after), then SIGTERM every child (api first,
        reward last), wait, then SIGKILL what is left."""
        if self.supervisor is not None:
            self.supervisor.stop()
        with self.lock:
            self._stop_children()
        if self.supervisor is not None:
            self.supervisor.release()
        if self.redis is not None:
            self.redis.stop()
            self.redis = None

    def _stop_children(self) -> None:
        for child in reversed(self.children):
            if child.process is not None and child.process.poll() is None:
                child.process.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + STOP_TIMEOUT_S
        for child in reversed(self.children):
            if child.process is None:
                continue
            try:
                child.process.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                log.warning("%s did not stop within %.0fs: killed", child.name, STOP_TIMEOUT_S)
                child.process.kill()
                child.process.wait(timeout=10)
            if child.log_file is not None:
                child.log_file.close()
        self.children.clear()

    def __enter__(self) -> Stack:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
