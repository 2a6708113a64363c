"""Secrets from files: ``X_FILE`` stands for ``X`` (Docker secrets), and VERST_REDIS_PASSWORD goes
into REDIS_URL; the compose files depend on both."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import redis

from services.api.config import ApiSettings
from services.common.settings import load_settings, require_redis_url
from services.rollout.config import EngineSettings

TOKEN = "t0ken-from-a-secret-file"


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("REDIS_URL", "VERST_API_TOKEN", "VERST_REDIS_PASSWORD", "VERST_ENGINE_PORT"):
        monkeypatch.delenv(name, raising=False)
        monkeypatch.delenv(name + "_FILE", raising=False)


def secret(tmp_path: Path, name: str, text: str) -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def test_a_file_stands_for_an_unset_variable(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VERST_API_TOKEN_FILE", secret(tmp_path, "token", TOKEN + "\n"))
    monkeypatch.setenv("REDIS_URL_FILE", secret(tmp_path, "url", "redis://cache:6380/2\n"))
    monkeypatch.setenv("VERST_ENGINE_PORT_FILE", secret(tmp_path, "port", "50099"))
    settings = ApiSettings()
    assert settings.token is not None and settings.token.get_secret_value() == TOKEN  # newline dropped
    assert settings.redis_url == "redis://cache:6380/2"  # a field read through its alias
    assert EngineSettings().port == 50099  # any field, validated as from the variable


def test_the_password_goes_into_the_url(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("REDIS_URL", "redis://redis:6379/0")
    monkeypatch.setenv("VERST_REDIS_PASSWORD_FILE", secret(tmp_path, "pw", "p@ss/w:rd %x\n"))
    url = require_redis_url(ApiSettings())
    assert url == "redis://:p%40ss%2Fw%3Ard%20%25x@redis:6379/0"
    assert redis.connection.parse_url(url)["password"] == "p@ss/w:rd %x"  # redis-py reads it back

    monkeypatch.setenv("REDIS_URL", "redis://worker@redis:6379/0")
    assert require_redis_url(ApiSettings()) == "redis://worker:p%40ss%2Fw%3Ard%20%25x@redis:6379/0"


def test_no_password_leaves_the_url_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("REDIS_URL", "redis://:inline@redis:6379/0")
    assert require_redis_url(ApiSettings()) == "redis://:inline@redis:6379/0"


def test_two_passwords_are_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("REDIS_URL", "redis://:inline@redis:6379/0")
    monkeypatch.setenv("VERST_REDIS_PASSWORD", "other")
    with pytest.raises(SystemExit, match="REDIS_URL carries a password and VERST_REDIS_PASSWORD"):
        require_redis_url(ApiSettings())


@pytest.mark.parametrize(
    ("setup", "message"),
    [
        ("both", "VERST_API_TOKEN and VERST_API_TOKEN_FILE are both set"),
        ("missing", "VERST_API_TOKEN_FILE: cannot read"),
        ("empty", "VERST_API_TOKEN_FILE: .* is empty"),
        ("binary", "VERST_API_TOKEN_FILE: .* is not UTF-8"),
        ("huge", "VERST_API_TOKEN_FILE: .* is longer than 65536 bytes"),
    ],
)
def test_a_bad_file_stops_the_process_naming_the_variable(
    setup: str,
    message: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    contents = {"both": TOKEN, "empty": "\n", "binary": "", "huge": "x" * 70_000}
    path = tmp_path / "token"
    if setup == "binary":
        path.write_bytes(b"\xff\xfe" + TOKEN.encode())
    elif setup != "missing":
        path.write_text(contents[setup])
    monkeypatch.setenv("VERST_API_TOKEN_FILE", str(path))
    if setup == "both":
        monkeypatch.setenv("VERST_API_TOKEN", TOKEN)
    with pytest.raises(SystemExit) as stop:
        load_settings(ApiSettings)
    assert stop.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("api: invalid setting VERST_API_TOKEN")
    assert re.search(message, err), err
    assert TOKEN not in err  # a secret is never echoed


def test_a_file_value_is_validated_like_the_variable(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VERST_API_TOKEN_FILE", secret(tmp_path, "token", "short"))
    with pytest.raises(SystemExit):
        load_settings(ApiSettings)  # min_length 16, as for VERST_API_TOKEN itself
