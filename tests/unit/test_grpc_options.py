"""The clients' ping policy and the servers' agree (grpc_options.py): every ping a verst channel
sends is one a verst server accepts, so a long call is never closed for "too_many_pings"."""

from __future__ import annotations

import pytest

from services.common.grpc_options import KEEPALIVE, PING_STRIKES, KeepAlive

SERVER_MIN_PING = "grpc.http2.min_ping_interval_without_data_ms"


@pytest.mark.parametrize("policy", [KEEPALIVE, KeepAlive(1000, 500), KeepAlive(3, 1)])
def test_servers_accept_every_ping_the_clients_send(policy: KeepAlive) -> None:
    client, server = dict(policy.client_options()), dict(policy.server_options())
    interval = client["grpc.keepalive_time_ms"]
    assert interval == policy.ping_interval_ms
    assert 2 * server[SERVER_MIN_PING] <= interval, "a margin of 2 for timer jitter"
    assert client["grpc.http2.max_pings_without_data"] == 0, "pings go on through a quiet call"
    assert client["grpc.keepalive_timeout_ms"] == policy.ping_timeout_ms
    assert server["grpc.keepalive_permit_without_calls"] == 1
    assert server["grpc.http2.max_ping_strikes"] == PING_STRIKES >= 1
    for side in (client, server):
        assert side["grpc.max_send_message_length"] == side["grpc.max_receive_message_length"]


def test_verst_pings_less_often_than_the_deadlines_it_keeps() -> None:
    assert KEEPALIVE.ping_interval_ms == 20_000 and KEEPALIVE.ping_timeout_ms < KEEPALIVE.ping_interval_ms


def test_a_policy_needs_positive_intervals() -> None:
    with pytest.raises(ValueError):
        KeepAlive(1, 1)
