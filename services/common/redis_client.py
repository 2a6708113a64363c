"""The one Redis client factory: every service's clients come from here.

``REDIS_URL`` names the deployment; its scheme picks how to reach it:

- ``redis://[user:password@]host:port/db``: one server; ``rediss://`` with TLS.
- ``redis+sentinel://[user:password@]sentinel:26379,sentinel2:26379/service[/db]``: the master
  that Sentinel names for ``service``, followed across fail-overs (``rediss+sentinel://``: TLS to
  the sentinels and to the data nodes).
- ``redis+cluster://[user:password@]node:6379,node2:6379``: Redis Cluster (``rediss+cluster://``:
  TLS); db 0 only. Every key of one job shares one hash tag (streams.py), so a job's
  transactions and scripts stay within one slot.

``user:password`` are the data nodes' ACL credentials (percent-encode special characters). TLS
options come from the URL query (redis-py's names: ``ssl_ca_certs``, ``ssl_certfile``,
``ssl_keyfile``, ``ssl_cert_reqs=none`` to skip verification) or from the settings
VERST_REDIS_TLS_CA_FILE, VERST_REDIS_TLS_CERT_FILE, VERST_REDIS_TLS_KEY_FILE; the server's
certificate and host name are verified unless told otherwise. The sentinels' own password is
VERST_REDIS_SENTINEL_PASSWORD. Passwords are never logged: ``RedisTarget.describe`` masks them.
"""

from __future__ import annotations

import enum
import functools
import logging
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, quote, unquote, urlsplit

import redis
import redis.asyncio as aioredis
import redis.cluster
import redis.sentinel
from pydantic import BaseModel, ConfigDict, Field, SecretStr, ValidationError, model_validator
from redis.asyncio.cluster import ClusterNode
from redis.asyncio.retry import Retry
from redis.asyncio.sentinel import Sentinel, SentinelConnectionPool, SentinelManagedConnection
from redis.backoff import ExponentialBackoff
from redis.crc import key_slot
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import MaxConnectionsError

log = logging.getLogger(__name__)

AsyncClient = aioredis.Redis | aioredis.RedisCluster
"""What ``async_client`` returns: one server's (or Sentinel's master's) client, or a cluster's."""
SyncClient = redis.Redis | redis.cluster.RedisCluster

REDIS_PORT = 6379
SENTINEL_PORT = 26379
CLUSTER_RETRY_CAP_S = 2.0
"""Longest backoff between a cluster client's retries (it counts retries rather than time)."""


class RedisConfigError(ValueError):
    """REDIS_URL or a VERST_REDIS_* setting is malformed; the text names which."""


class RedisMode(enum.StrEnum):
    STANDALONE = "standalone"
    SENTINEL = "sentinel"
    CLUSTER = "cluster"


_SCHEMES = {
    "redis": (RedisMode.STANDALONE, False),
    "rediss": (RedisMode.STANDALONE, True),
    "redis+sentinel": (RedisMode.SENTINEL, False),
    "rediss+sentinel": (RedisMode.SENTINEL, True),
    "redis+cluster": (RedisMode.CLUSTER, False),
    "rediss+cluster": (RedisMode.CLUSTER, True),
}
_QUERY_FIELDS = {
    "ssl_ca_certs": "tls_ca_file",
    "ssl_certfile": "tls_cert_file",
    "ssl_keyfile": "tls_key_file",
}
_SETTINGS = {
    "tls_ca_file": "VERST_REDIS_TLS_CA_FILE",
    "tls_cert_file": "VERST_REDIS_TLS_CERT_FILE",
    "tls_key_file": "VERST_REDIS_TLS_KEY_FILE",
    "sentinel_password": "VERST_REDIS_SENTINEL_PASSWORD",
}
"""The setting each field comes from (the others come from REDIS_URL)."""


class RedisTarget(BaseModel):
    """Where Redis is and how to log in: REDIS_URL parsed, with the VERST_REDIS_* settings."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    mode: RedisMode = RedisMode.STANDALONE
    """One server, the master Sentinel names, or a cluster (the URL's scheme)."""
    nodes: tuple[tuple[str, int], ...] = Field(min_length=1)
    """host:port of the server, of the sentinels, or of the cluster's seed nodes."""
    db: int = Field(0, ge=0, le=1_000_000)
    """Database number (0 on a cluster)."""
    username: str | None = None
    """ACL user of the data nodes (None: the default user)."""
    password: SecretStr | None = None
    """Password of that user (never logged)."""
    tls: bool = False
    """TLS to every node (a ``rediss`` scheme)."""
    tls_ca_file: Path | None = None
    """CA bundle that signs the servers' certificates (None: the system's)."""
    tls_cert_file: Path | None = None
    """Client certificate (PEM) for servers that ask for one (tls-auth-clients)."""
    tls_key_file: Path | None = None
    """Private key of the client certificate."""
    tls_verify: bool = True
    """Verify the server's certificate and host name (``ssl_cert_reqs=none``: don't, tests only)."""
    sentinel_service: str | None = None
    """The master's name that Sentinel knows (the URL's path)."""
    sentinel_password: SecretStr | None = None
    """Password of the sentinels themselves, if they require one."""

    @model_validator(mode="after")
    def _consistent(self) -> RedisTarget:
        if self.mode is RedisMode.CLUSTER and self.db != 0:
            raise ValueError("a Redis Cluster has only db 0")
        if self.mode is RedisMode.SENTINEL and not self.sentinel_service:
            raise ValueError(
                "a redis+sentinel URL names the master's service: redis+sentinel://host:port/name"
            )
        tls_files = {"tls_ca_file": self.tls_ca_file, "tls_cert_file": self.tls_cert_file,
                     "tls_key_file": self.tls_key_file}  # fmt: skip
        for field, path in tls_files.items():
            if path is not None and not self.tls:
                raise ValueError(f"{_SETTINGS[field]} is set but the URL is not rediss:// (no TLS)")
            if path is not None and not path.is_file():
                raise ValueError(f"{_SETTINGS[field]}: no such file {path}")
        if self.tls_key_file is not None and self.tls_cert_file is None:
            raise ValueError(f"{_SETTINGS['tls_key_file']} is set without {_SETTINGS['tls_cert_file']}")
        return self

    def describe(self) -> str:
        """The target as a URL with its password masked (for logs and errors)."""
        scheme = {v: k for k, v in _SCHEMES.items()}[(self.mode, self.tls)]
        login = f"{quote(self.username or '')}:***@" if self.password else ""
        login = login or (f"{quote(self.username)}@" if self.username else "")
        hosts = ",".join(f"[{h}]:{p}" if ":" in h else f"{h}:{p}" for h, p in self.nodes)
        path = f"/{self.sentinel_service}/{self.db}" if self.sentinel_service else f"/{self.db}"
        return f"{scheme}://{login}{hosts}{path}"


def parse_redis_url(
    url: str,
    *,
    tls_ca_file: Path | None = None,
    tls_cert_file: Path | None = None,
    tls_key_file: Path | None = None,
    sentinel_password: str | None = None,
) -> RedisTarget:
    """REDIS_URL and the VERST_REDIS_* settings as a RedisTarget; RedisConfigError names the bad one."""
    parts = urlsplit(url)
    if parts.scheme not in _SCHEMES:
        raise RedisConfigError(f"REDIS_URL: scheme {parts.scheme!r} is not one of {', '.join(_SCHEMES)}")
    mode, tls = _SCHEMES[parts.scheme]
    userinfo, _, hostlist = parts.netloc.rpartition("@")
    username, has_password, password = userinfo.partition(":")
    default_port = SENTINEL_PORT if mode is RedisMode.SENTINEL else REDIS_PORT
    nodes = tuple(_host_port(item, default_port) for item in hostlist.split(",") if item)
    if not nodes:
        raise RedisConfigError("REDIS_URL names no host")
    if len(nodes) > 1 and mode is RedisMode.STANDALONE:
        raise RedisConfigError("REDIS_URL: several hosts need redis+sentinel:// or redis+cluster://")
    service, db = _path(parts.path, mode)
    fields: dict[str, Any] = {
        "mode": mode, "nodes": nodes, "db": db, "tls": tls, "sentinel_service": service,
        "username": unquote(username) or None,
        "password": SecretStr(unquote(password)) if has_password else None,
        "tls_ca_file": tls_ca_file, "tls_cert_file": tls_cert_file, "tls_key_file": tls_key_file,
        "sentinel_password": SecretStr(sentinel_password) if sentinel_password else None,
    }  # fmt: skip
    fields.update(_query(parts.query, fields))
    try:
        return RedisTarget(**fields)
    except ValidationError as err:
        error = err.errors()[0]
        field = str(error["loc"][0]) if error["loc"] else ""
        raise RedisConfigError(f"{_SETTINGS.get(field, 'REDIS_URL')}: {error['msg']}") from None


def _host_port(item: str, default_port: int) -> tuple[str, int]:
    host, port = item, ""
    if item.startswith("["):  # [ipv6]:port
        host, _, rest = item[1:].partition("]")
        port = rest.removeprefix(":")
    elif ":" in item:
        host, _, port = item.rpartition(":")
    if not host or (port and not port.isdigit()) or not 0 < int(port or default_port) < 65536:
        raise RedisConfigError(f"REDIS_URL: bad host:port {item!r}")
    return host, int(port or default_port)


def _path(path: str, mode: RedisMode) -> tuple[str | None, int]:
    """(sentinel service, db) of the URL's path."""
    parts = [part for part in path.split("/") if part]
    service = parts.pop(0) if mode is RedisMode.SENTINEL and parts else None
    if len(parts) > 1 or (parts and not parts[0].isdigit()):
        raise RedisConfigError(
            f"REDIS_URL: path {path!r} is not /<db>" + (" or /<service>/<db>" * bool(service))
        )
    return service, int(parts[0]) if parts else 0


def _query(query: str, fields: dict[str, Any]) -> dict[str, Any]:
    """The TLS options of the URL's query; one also given by its setting must not differ."""
    out: dict[str, Any] = {}
    for name, values in parse_qs(query, keep_blank_values=True).items():
        value = values[-1]
        if name == "ssl_cert_reqs":
            if value not in ("none", "required"):
                raise RedisConfigError("REDIS_URL: ssl_cert_reqs must be 'required' or 'none'")
            out["tls_verify"] = value == "required"
        elif name in _QUERY_FIELDS:
            field = _QUERY_FIELDS[name]
            if fields[field] is not None and fields[field] != Path(value):
                raise RedisConfigError(f"REDIS_URL's {name} and {_SETTINGS[field]} differ: set one")
            out[field] = Path(value)
        else:
            known = ", ".join([*_QUERY_FIELDS, "ssl_cert_reqs"])
            raise RedisConfigError(f"REDIS_URL: unknown query parameter {name!r} (known: {known})")
    return out


def as_target(target: str | RedisTarget) -> RedisTarget:
    return target if isinstance(target, RedisTarget) else parse_redis_url(target)


def _login_and_tls(target: RedisTarget) -> dict[str, Any]:
    """Connection keyword arguments for the data nodes: ACL login and TLS."""
    kwargs: dict[str, Any] = {
        "username": target.username,
        "password": target.password.get_secret_value() if target.password else None,
    }
    if target.tls:
        kwargs.update(
            ssl_ca_certs=str(target.tls_ca_file) if target.tls_ca_file else None,
            ssl_certfile=str(target.tls_cert_file) if target.tls_cert_file else None,
            ssl_keyfile=str(target.tls_key_file) if target.tls_key_file else None,
            ssl_cert_reqs="required" if target.tls_verify else "none",
            ssl_check_hostname=target.tls_verify,
        )
    return kwargs


def _sentinel_kwargs(target: RedisTarget, timeout_s: float) -> dict[str, Any]:
    """Connection keyword arguments for the sentinels: their password, the data nodes' TLS."""
    kwargs = {**_login_and_tls(target), "socket_timeout": timeout_s, "socket_connect_timeout": timeout_s}
    kwargs["username"] = None
    kwargs["password"] = target.sentinel_password.get_secret_value() if target.sentinel_password else None
    if target.tls:
        kwargs["ssl"] = True
    return kwargs


class BoundedPool(aioredis.BlockingConnectionPool):
    """redis-py's blocking pool: a command waits for a free connection up to its ``timeout``
    (a burst of commands queues rather than fails), then fails with MaxConnectionsError, logged,
    which says the pool ran dry and what to raise (redis-py's says "No connection available", a
    ConnectionError that would pass for a Redis outage and be retried)."""

    setting = "VERST_REDIS_MAX_CONNECTIONS"
    """The setting that sizes the pool, named by the error."""

    async def get_connection(self, *args: Any, **kwargs: Any) -> Any:
        try:
            return await super().get_connection(*args, **kwargs)
        except RedisConnectionError as err:
            if not isinstance(err.__cause__, TimeoutError):  # a real connection failure
                raise
            text = (
                f"Redis connection pool exhausted: all {self.max_connections} connections in use for "
                f"{self.timeout}s (raise {self.setting}, or look for a leak of blocking reads)"
            )
            log.error("%s", text)
            raise MaxConnectionsError(text) from None


class FailoverConnection(SentinelManagedConnection):
    """A Sentinel-managed connection that asks Sentinel for the master whenever it reconnects:
    redis-py's reconnects a dropped connection whose command is retried to the address it had,
    the dead master's, until the outage bound runs out."""

    async def send_packed_command(self, command: Any, check_health: bool = True) -> None:
        if not self.is_connected:
            await self.connect()  # SentinelManagedConnection.connect: discover the master
        await super().send_packed_command(command, check_health)


class FailoverSSLConnection(FailoverConnection, aioredis.SSLConnection):
    """FailoverConnection over TLS."""


@functools.cache
def _sentinel_pool_class(
    pool_class: type[aioredis.BlockingConnectionPool],
) -> type[SentinelConnectionPool]:
    """``pool_class`` that asks Sentinel for the master (and asks again after a fail-over)."""
    return type(f"Sentinel{pool_class.__name__}", (SentinelConnectionPool, pool_class), {})


def async_client(
    target: str | RedisTarget,
    *,
    socket_timeout_s: float,
    socket_connect_timeout_s: float = 5.0,
    max_connections: int,
    pool_wait_s: float,
    retry: Retry,
    retry_on_error: list[type[Exception]],
    cluster_retries: int,
    pool_class: type[aioredis.BlockingConnectionPool] = BoundedPool,
) -> AsyncClient:
    """An asyncio client of ``target``. A standalone or Sentinel client draws on one
    ``pool_class`` of ``max_connections`` (waiting ``pool_wait_s`` for a free one) and retries
    as ``retry`` says (on ``retry_on_error``); a cluster client holds ``max_connections`` per
    node and retries a command ``cluster_retries`` times (backoff up to CLUSTER_RETRY_CAP_S)."""
    target = as_target(target)
    common: dict[str, Any] = {
        **_login_and_tls(target),
        "socket_timeout": socket_timeout_s,
        "socket_connect_timeout": socket_connect_timeout_s,
        "health_check_interval": 15,
        "decode_responses": False,
    }
    if target.mode is RedisMode.CLUSTER:
        return aioredis.RedisCluster(
            startup_nodes=[ClusterNode(host, port) for host, port in target.nodes],
            max_connections=max_connections,
            retry=Retry(ExponentialBackoff(cap=CLUSTER_RETRY_CAP_S, base=0.05), cluster_retries),
            ssl=target.tls,
            **common,
        )
    pooled = {**common, "max_connections": max_connections, "timeout": pool_wait_s, "retry": retry,
              "retry_on_error": retry_on_error, "db": target.db}  # fmt: skip
    if target.mode is RedisMode.SENTINEL:
        sentinel = Sentinel(target.nodes, sentinel_kwargs=_sentinel_kwargs(target, socket_connect_timeout_s))
        return sentinel.master_for(
            str(target.sentinel_service),
            redis_class=aioredis.Redis,
            connection_pool_class=_sentinel_pool_class(pool_class),
            connection_class=FailoverSSLConnection if target.tls else FailoverConnection,
            **pooled,
        )
    host, port = target.nodes[0]
    connection_class = aioredis.SSLConnection if target.tls else aioredis.Connection
    pool = pool_class(host=host, port=port, connection_class=connection_class, **pooled)
    return aioredis.Redis.from_pool(pool)


def sync_client(target: str | RedisTarget, *, socket_timeout_s: float) -> SyncClient:
    """A blocking client of ``target`` (metrics scrapes): no pool bound, no retries."""
    target = as_target(target)
    common = {**_login_and_tls(target), "socket_timeout": socket_timeout_s,
              "socket_connect_timeout": socket_timeout_s}  # fmt: skip
    if target.mode is RedisMode.CLUSTER:
        nodes = [redis.cluster.ClusterNode(host, port) for host, port in target.nodes]
        return redis.cluster.RedisCluster(startup_nodes=nodes, ssl=target.tls, **common)
    if target.mode is RedisMode.SENTINEL:
        sentinel = redis.sentinel.Sentinel(
            target.nodes, sentinel_kwargs=_sentinel_kwargs(target, socket_timeout_s)
        )
        return sentinel.master_for(str(target.sentinel_service), ssl=target.tls, db=target.db, **common)
    host, port = target.nodes[0]
    return redis.Redis(host=host, port=port, db=target.db, ssl=target.tls, **common)


def is_cluster(client: Any) -> bool:
    return isinstance(client, (aioredis.RedisCluster, redis.cluster.RedisCluster))


def socket_timeout_of(client: AsyncClient) -> float | None:
    """The reply timeout that ``client``'s connections were made with."""
    kwargs = client.connection_kwargs if is_cluster(client) else client.connection_pool.connection_kwargs
    return kwargs.get("socket_timeout")


def slot_groups(keys: list[str], client: Any) -> list[list[str]]:
    """``keys`` split by hash slot on a cluster (a multi-key command must stay in one slot), else
    all together; order kept within each group."""
    if not is_cluster(client):
        return [keys] if keys else []
    groups: dict[int, list[str]] = {}
    for key in keys:
        groups.setdefault(key_slot(key.encode()), []).append(key)
    return list(groups.values())
