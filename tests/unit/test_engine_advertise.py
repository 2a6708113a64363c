"""Where an engine tells the router to dial it: VERST_ENGINE_ADVERTISE_ADDRESS (host:port, empty,
or auto: this container's own IP address, so that scaled compose replicas differ)."""

from __future__ import annotations

import socket
from typing import Any

import pytest
from pydantic import ValidationError

from services.rollout.config import EngineSettings
from services.rollout.server import advertised_address, own_ip_address


def fake_resolver(
    monkeypatch: pytest.MonkeyPatch, hostname: str, addresses: dict[str, str]
) -> list[tuple[str, int]]:
    """gethostname() says ``hostname``; getaddrinfo answers from ``addresses``; returns its calls."""
    calls: list[tuple[str, int]] = []

    def getaddrinfo(name: str, port: int, family: int, kind: int) -> list[tuple[Any, ...]]:
        calls.append((name, family))
        if name not in addresses:
            raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")
        return [(family, kind, 6, "", (addresses[name], port))]

    monkeypatch.setattr(socket, "gethostname", lambda: hostname)
    monkeypatch.setattr(socket, "getaddrinfo", getaddrinfo)
    return calls


def settings(**values: object) -> EngineSettings:
    return EngineSettings(port=50052, **values)  # type: ignore[arg-type]


def test_auto_on_every_interface_is_the_hostnames_address(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = fake_resolver(monkeypatch, "3f2a9c1d0b7e", {"3f2a9c1d0b7e": "172.18.0.7"})
    assert advertised_address(settings(host="0.0.0.0", advertise_address="auto")) == "172.18.0.7:50052"
    assert calls == [("3f2a9c1d0b7e", socket.AF_INET)]


def test_auto_on_one_interface_is_that_address(monkeypatch: pytest.MonkeyPatch) -> None:
    fake_resolver(monkeypatch, "box", {"127.0.0.9": "127.0.0.9", "engine.lan": "10.1.2.3"})
    assert advertised_address(settings(host="127.0.0.9", advertise_address="auto")) == "127.0.0.9:50052"
    assert advertised_address(settings(host="engine.lan", advertise_address="auto")) == "10.1.2.3:50052"


def test_auto_ipv6_is_bracketed(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = fake_resolver(monkeypatch, "box6", {"box6": "fd00::17"})
    assert own_ip_address("::", 50052) == "[fd00::17]:50052"
    assert calls == [("box6", socket.AF_INET6)]


def test_auto_that_cannot_resolve_names_the_setting(monkeypatch: pytest.MonkeyPatch) -> None:
    fake_resolver(monkeypatch, "nowhere", {})
    with pytest.raises(ValueError, match="VERST_ENGINE_ADVERTISE_ADDRESS=auto: cannot resolve 'nowhere'"):
        advertised_address(settings(host="0.0.0.0", advertise_address="auto"))


def test_a_loopback_answer_is_used_and_warned_about(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    fake_resolver(monkeypatch, "laptop", {"laptop": "127.0.1.1"})
    assert own_ip_address("0.0.0.0", 50052) == "127.0.1.1:50052"
    assert "only this host reaches it" in caplog.text


def test_explicit_and_empty_are_unchanged(monkeypatch: pytest.MonkeyPatch) -> None:
    fake_resolver(monkeypatch, "3f2a9c1d0b7e", {})
    assert advertised_address(settings(host="0.0.0.0", advertise_address="engine:50052")) == "engine:50052"
    assert advertised_address(settings(host="0.0.0.0")) == "3f2a9c1d0b7e:50052"  # the hostname itself
    assert advertised_address(settings(host="10.0.0.5")) == "10.0.0.5:50052"


@pytest.mark.parametrize("value", ["automatic", "engine", "engine:port", "auto auto"])
def test_other_words_are_refused(value: str) -> None:
    with pytest.raises(ValidationError, match="advertise_address"):
        settings(advertise_address=value)
