"""`verst up --port-base N`: every port of the stack from one layout, in range, none twice, and a
taken one named before anything starts."""

from __future__ import annotations

import signal
import socket
from pathlib import Path

import pytest

from services.cli import main, parser
from services.stack import Stack, StackConfig
from services.stack_ports import PortPlanError, check_free, port_layout, port_span

BASE = 21000


def test_the_layout_is_the_documented_one() -> None:
    layout = port_layout(BASE, engines=2, trainers=1)
    assert port_span(2, 1) == 19 and sorted(layout.values()) == list(range(BASE, BASE + 19))
    assert (layout["api"], layout["redis"], layout["router"], layout["router metrics"]) == (
        21000,
        21001,
        21002,
        21003,
    )
    assert (layout["controller"], layout["controller metrics"]) == (21008, 21009)
    assert (layout["trainer-0"], layout["trainer-0 metrics"], layout["trainer-0 weights"]) == (
        21010,
        21011,
        21012,
    )
    assert (layout["engine-0"], layout["engine-1"], layout["engine-1 sglang"]) == (21013, 21016, 21018)


@pytest.mark.parametrize("base", [0, 65535 - 15 + 1, 70000])
def test_a_base_whose_span_leaves_the_port_range_is_refused(base: int) -> None:
    with pytest.raises(PortPlanError, match=r"port_base \(--port-base\): .* use a base from 1 to 65520"):
        port_layout(base, engines=1, trainers=1)  # span 16
    assert port_layout(65520, engines=1, trainers=1)["engine-0 sglang"] == 65535


def test_every_child_gets_its_ports_from_the_base(tmp_path: Path) -> None:
    config = StackConfig(log_dir=tmp_path, engines=2, trainers=2, port_base=BASE, separate_controller=True)
    stack = Stack(config)
    stack.redis_url = "redis://127.0.0.1:1/0"  # planned only: nothing starts
    children = {child.name: child.env for child in stack._plan()}
    assert stack.api_url == f"http://127.0.0.1:{BASE}"
    span = range(BASE, BASE + port_span(2, 2))
    bound = [int(port) for env in children.values() for name, port in env.items()
             if name.startswith("VERST_") and name.endswith("_PORT")]  # fmt: skip
    assert all(port in span for port in bound) and len(bound) == len(set(bound)), bound
    assert children["trainer-1"]["VERST_TRAINER_WEIGHT_TRANSPORT_PORT"] == str(
        stack.ports["trainer-1 weights"]
    )
    assert children["engine-1"]["VERST_ENGINE_PORT"] == str(BASE + 10 + 3 * 2 + 3)
    assert children["runner"]["VERST_RUNNER_ROUTER_ADDRESS"] == f"127.0.0.1:{BASE + 2}"
    assert stack.metrics_ports["controller"] == BASE + 9


def test_a_taken_port_is_named_with_what_would_bind_it() -> None:
    ports = port_layout(BASE, engines=1, trainers=1)
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        taken = holder.getsockname()[1]
        ports["engine-0 metrics"] = taken
        with pytest.raises(PortPlanError, match=rf"^port {taken} \(engine-0 metrics\) is taken on 127.0.0.1"):
            check_free(ports, "127.0.0.1")
    check_free({"engine-0 metrics": taken}, "127.0.0.1")  # free again once its holder closed


def test_verst_up_refuses_a_taken_port_before_starting_anything(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.delenv("REDIS_URL", raising=False)
    monkeypatch.setattr(signal, "signal", lambda *_: None)  # `verst up` would take this process's SIGTERM
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        base = holder.getsockname()[1]  # the api's port, N+0
        if base + port_span(1, 1) > 65535:
            pytest.skip("the kernel's port sits too near the top of the range")
        code = main(["up", "--port-base", str(base), "--log-dir", str(tmp_path / "logs"),
                     "--redis-dir", str(tmp_path / "redis")])  # fmt: skip
    assert code == 2
    err = capsys.readouterr().err
    assert err.startswith(f"verst: port {base} (api) is taken on 127.0.0.1") and err.count("\n") == 1
    assert not (tmp_path / "redis").exists(), "nothing started"


def test_verst_up_takes_a_port_base(capsys: pytest.CaptureFixture[str]) -> None:
    assert parser().parse_args(["up", "--port-base", "30000"]).port_base == 30000
    assert parser().parse_args(["up"]).port_base is None
    with pytest.raises(SystemExit):
        parser().parse_args(["up", "--port-base", "70000"])
    assert "must be a port from 1 to 65535, not 70000" in capsys.readouterr().err
