"""Redis deployments for the external-Redis tests, from the embedded redis-server binary: a
3-shard cluster, a master + replica + sentinel, and a TLS front (the binary is built without TLS,
so a loopback TLS proxy stands in for a TLS-enabled server). Every wait has a deadline."""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import ssl
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import redis
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from services.common.parented import parented
from services.common.redis_server import free_port, redis_server_binary

START_TIMEOUT_S = 15.0
START_ATTEMPTS = 3
CLUSTER_TIMEOUT_S = 30.0
SLOTS = 16384


def wait_for(check: Callable[[], bool], what: str, *, timeout_s: float, poll_s: float = 0.05) -> None:
    """Poll ``check`` until it is true; AssertionError naming ``what`` after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with contextlib.suppress(redis.RedisError, OSError):
            if check():
                return
        time.sleep(poll_s)
    raise AssertionError(f"{what}: not within {timeout_s}s")


@dataclass
class Node:
    """One redis-server (or sentinel) process on a loopback port."""

    port: int
    process: subprocess.Popen[bytes]

    def client(self, **kwargs: object) -> redis.Redis:
        return redis.Redis(host="127.0.0.1", port=self.port, socket_timeout=2.0, **kwargs)  # type: ignore[arg-type]

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait(timeout=5)


def start_node(workdir: Path, *args: str, config: str = "", password: str = "") -> Node:
    """A redis-server with ``args`` (a config file first when ``config``), answering PING (with
    ``password``); tries another port when the first is taken meanwhile."""
    for _ in range(START_ATTEMPTS):
        port = cluster_safe_port()
        node = _launch(workdir, port, args, config)
        with contextlib.suppress(AssertionError):
            ping = node.client(password=password or None).ping
            wait_for(lambda: node.process.poll() is not None or bool(ping()),  # noqa: B023
                     f"redis-server on {port}", timeout_s=START_TIMEOUT_S)  # fmt: skip
            if node.process.poll() is None:
                return node
        node.kill()
    output = (workdir / f"redis-{port}.log").read_text(errors="replace")
    raise AssertionError(f"redis-server did not start in {START_ATTEMPTS} tries: {output[-500:]}")


def _launch(workdir: Path, port: int, args: tuple[str, ...], config: str) -> Node:
    command = [redis_server_binary()]
    if config:
        path = workdir / f"redis-{port}.conf"
        path.write_text(config.replace("{port}", str(port)))
        command.append(str(path))
    command += ["--port", str(port), "--bind", "127.0.0.1", "--dir", str(workdir), "--save", "",
                "--appendonly", "no", "--loglevel", "warning", *args]  # fmt: skip
    with (workdir / f"redis-{port}.log").open("wb") as log:
        process = subprocess.Popen(
            parented(command), stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL
        )
    return Node(port, process)


def cluster_safe_port() -> int:
    """A free port whose cluster bus port (+10000) is a port too."""
    for _ in range(100):
        port = free_port()
        if port + 10000 < 65536:
            return port
    raise AssertionError("no free port below 55536 in 100 tries")


@contextlib.contextmanager
def nodes_in(workdir_prefix: str) -> Iterator[tuple[Path, list[Node]]]:
    """A scratch directory and a list of nodes, all killed at the end."""
    started: list[Node] = []
    with tempfile.TemporaryDirectory(prefix=workdir_prefix) as tmp:
        try:
            yield Path(tmp), started
        finally:
            for node in started:
                node.kill()


def shard_ranges(shards: int) -> list[range]:
    """The slots of each shard: SLOTS split evenly."""
    bounds = [SLOTS * n // shards for n in range(shards + 1)]
    return [range(bounds[n], bounds[n + 1]) for n in range(shards)]


@contextlib.contextmanager
def redis_cluster(shards: int = 3) -> Iterator[list[Node]]:
    """``shards`` masters with cluster-enabled, slots split evenly, met and ``cluster_state:ok``."""
    with nodes_in("verst-cluster-") as (workdir, nodes):
        for _ in range(shards):
            port_conf = f"--cluster-config-file nodes-{len(nodes)}.conf".split()
            nodes.append(start_node(workdir, "--cluster-enabled", "yes", *port_conf))
        for node, slots in zip(nodes, shard_ranges(shards), strict=True):
            node.client().execute_command("CLUSTER ADDSLOTS", *slots)
        first = nodes[0].client()
        for node in nodes[1:]:
            first.execute_command("CLUSTER MEET", "127.0.0.1", node.port)
        for node in nodes:
            client = node.client()
            wait_for(
                lambda client=client: (
                    client.cluster("info")["cluster_state"] == "ok"  # type: ignore[misc]
                    and int(client.cluster("info")["cluster_known_nodes"]) == shards
                ),
                f"cluster node {node.port} ok",
                timeout_s=CLUSTER_TIMEOUT_S,
            )
        yield nodes


SENTINEL_CONFIG = """port {port}
sentinel monitor {service} 127.0.0.1 {master} 1
sentinel down-after-milliseconds {service} 1000
sentinel failover-timeout {service} 10000
sentinel parallel-syncs {service} 1
"""


@dataclass
class SentinelSet:
    master: Node
    replica: Node
    sentinel: Node
    service: str


@contextlib.contextmanager
def redis_sentinel(service: str = "verst-master", *, sentinel_password: str = "") -> Iterator[SentinelSet]:
    """A master, a replica in sync with it, and one sentinel (quorum 1) that knows both."""
    with nodes_in("verst-sentinel-") as (workdir, nodes):
        master = start_node(workdir)
        replica = start_node(workdir, "--replicaof", "127.0.0.1", str(master.port))
        nodes += [master, replica]
        config = SENTINEL_CONFIG.replace("{service}", service).replace("{master}", str(master.port))
        if sentinel_password:
            config += f"requirepass {sentinel_password}\n"
        sentinel = start_node(workdir, "--sentinel", config=config, password=sentinel_password)
        nodes.append(sentinel)
        link = replica.client()
        wait_for(lambda: link.info("replication")["master_link_status"] == "up", "replica in sync",
                 timeout_s=CLUSTER_TIMEOUT_S)  # fmt: skip
        asking = sentinel.client(password=sentinel_password or None)
        # A sentinel learns of replicas from the master's INFO, every 10 s.
        wait_for(lambda: len(asking.sentinel_slaves(service)) == 1, "sentinel knows the replica",
                 timeout_s=CLUSTER_TIMEOUT_S, poll_s=0.2)  # fmt: skip
        yield SentinelSet(master, replica, sentinel, service)


@dataclass
class Certificates:
    ca: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path


def _key_and_cert(
    name: str, issuer: tuple[x509.Name, ec.EllipticCurvePrivateKey] | None, *, ca: bool = False
) -> tuple[ec.EllipticCurvePrivateKey, x509.Certificate]:
    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    issuer_name, issuer_key = issuer or (subject, key)
    now = datetime.datetime.now(datetime.UTC)
    builder = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(issuer_name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(hours=1))
        .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
    )
    if not ca:
        builder = builder.add_extension(
            x509.SubjectAlternativeName([x509.DNSName("localhost")]), critical=False
        )
    return key, builder.sign(issuer_key, hashes.SHA256())


def make_certificates(folder: Path) -> Certificates:
    """A throwaway CA, a server certificate for ``localhost`` and a client certificate."""
    ca_key, ca_cert = _key_and_cert("verst test CA", None, ca=True)
    paths = {}
    for role in ("server", "client"):
        key, cert = _key_and_cert(f"verst {role}", (ca_cert.subject, ca_key))
        paths[f"{role}_cert"] = folder / f"{role}.crt"
        paths[f"{role}_key"] = folder / f"{role}.key"
        paths[f"{role}_cert"].write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        paths[f"{role}_key"].write_bytes(
            key.private_bytes(
                serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
            )
        )
    (folder / "ca.crt").write_bytes(ca_cert.public_bytes(serialization.Encoding.PEM))
    return Certificates(ca=folder / "ca.crt", **paths)


class TlsFront:
    """A loopback TLS server that requires a client certificate signed by the CA and relays
    each connection's bytes to a plain Redis: what a TLS-enabled Redis looks like to a client."""

    def __init__(self, certs: Certificates, redis_port: int) -> None:
        self.context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH, cafile=str(certs.ca))
        self.context.load_cert_chain(str(certs.server_cert), str(certs.server_key))
        self.context.verify_mode = ssl.CERT_REQUIRED
        self.redis_port = redis_port
        self.server: asyncio.Server | None = None
        self.port = 0
        self.handshakes = 0

    async def start(self) -> int:
        self.server = await asyncio.start_server(self._relay, "127.0.0.1", 0, ssl=self.context)
        self.port = self.server.sockets[0].getsockname()[1]
        return self.port

    async def close(self) -> None:
        if self.server is not None:
            self.server.close()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.server.wait_closed(), 5)

    async def _relay(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.handshakes += 1
        upstream_reader, upstream_writer = await asyncio.open_connection("127.0.0.1", self.redis_port)

        async def pipe(source: asyncio.StreamReader, sink: asyncio.StreamWriter) -> None:
            with contextlib.suppress(ConnectionError, OSError):
                while data := await source.read(65536):
                    sink.write(data)
                    await sink.drain()
            with contextlib.suppress(ConnectionError, OSError, RuntimeError):
                sink.close()

        await asyncio.gather(pipe(reader, upstream_writer), pipe(upstream_reader, writer))
