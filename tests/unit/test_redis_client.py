"""REDIS_URL parsing: schemes, hosts, credentials, TLS options; errors name the setting and
never show a password."""

from __future__ import annotations

import pytest

from services.common.redis_client import RedisConfigError, RedisMode, parse_redis_url


def test_a_plain_url() -> None:
    target = parse_redis_url("redis://localhost:6380/2")
    assert (target.mode, target.nodes, target.db, target.tls) == (
        RedisMode.STANDALONE,
        (("localhost", 6380),),
        2,
        False,
    )
    assert target.describe() == "redis://localhost:6380/2"


def test_acl_credentials_are_unquoted_and_masked() -> None:
    target = parse_redis_url("rediss://svc:p%40ss%3Aword@redis.example:6379/0")
    assert target.username == "svc" and target.password is not None
    assert target.password.get_secret_value() == "p@ss:word"
    assert target.tls and target.tls_verify, "TLS is verified by default"
    for shown in (target.describe(), repr(target), str(target)):
        assert "p@ss" not in shown and "ss%3A" not in shown
    assert target.describe() == "rediss://svc:***@redis.example:6379/0"


def test_sentinel_and_cluster_urls() -> None:
    sentinel = parse_redis_url("redis+sentinel://s1,s2:26380,[::1]:26381/mymaster/3", sentinel_password="x")
    assert sentinel.mode is RedisMode.SENTINEL and sentinel.sentinel_service == "mymaster"
    assert sentinel.nodes == (("s1", 26379), ("s2", 26380), ("::1", 26381)) and sentinel.db == 3
    assert "x" not in sentinel.describe().replace("redis+sentinel", "")
    cluster = parse_redis_url("rediss+cluster://u:p@n1:7000,n2:7001")
    assert cluster.mode is RedisMode.CLUSTER and cluster.tls and len(cluster.nodes) == 2


@pytest.mark.parametrize(
    ("url", "message"),
    [
        ("http://localhost", "REDIS_URL: scheme 'http'"),
        ("redis://a:1,b:2/0", r"REDIS_URL: several hosts need redis\+sentinel:// or redis\+cluster://"),
        ("redis+cluster://a:1/1", "REDIS_URL: .*only db 0"),
        ("redis+sentinel://a:1", "REDIS_URL: .*names the master's service"),
        ("redis://a:99999/0", "bad host:port"),
        ("redis://a/x", "path '/x' is not /<db>"),
        ("rediss://a/0?ssl_cert_reqs=optional", "ssl_cert_reqs must be"),
        ("rediss://a/0?timeout=3", "unknown query parameter 'timeout'"),
    ],
)
def test_bad_urls_name_the_setting(url: str, message: str) -> None:
    with pytest.raises(RedisConfigError, match=message):
        parse_redis_url(url)


def test_a_bad_url_never_shows_its_password() -> None:
    with pytest.raises(RedisConfigError) as raised:
        parse_redis_url("redis+cluster://u:hunter2@a:1/4")
    assert "hunter2" not in str(raised.value)


def test_url_and_setting_must_not_disagree(tmp_path) -> None:  # type: ignore[no-untyped-def]
    ca, other = tmp_path / "ca.pem", tmp_path / "other.pem"
    ca.write_text("x")
    other.write_text("y")
    assert parse_redis_url(f"rediss://a/0?ssl_ca_certs={ca}", tls_ca_file=ca).tls_ca_file == ca
    with pytest.raises(RedisConfigError, match="ssl_ca_certs and VERST_REDIS_TLS_CA_FILE differ"):
        parse_redis_url(f"rediss://a/0?ssl_ca_certs={other}", tls_ca_file=ca)
    with pytest.raises(
        RedisConfigError, match="VERST_REDIS_TLS_KEY_FILE is set without VERST_REDIS_TLS_CERT_FILE"
    ):
        parse_redis_url("rediss://a/0", tls_key_file=ca)
