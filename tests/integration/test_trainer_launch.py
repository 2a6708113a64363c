"""Two StatefulSet pods' launches (services/trainer/launch.py: ordinals 0 and 1 of a two-node
trainer, meeting at "127.0.0.1" over gloo on loopback) train exactly as one process does, as
two torchrun ranks on one node do in test_trainer_distributed.py."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from services.common.redis_server import free_port
from tests.helpers import assert_trained_as_one_process
from tests.integration.test_trainer_distributed import RUN_TIMEOUT_S, SCRIPT, model_dir, pipes

__all__ = ["model_dir"]  # the fixture, shared with test_trainer_distributed.py

pytestmark = pytest.mark.slow


def pod_env(base: dict[str, str], index: int, port: int) -> dict[str, str]:
    """What the chart sets on pod ``index`` of a two-node trainer, the rendezvous on loopback."""
    return base | {
        "VERST_TRAINER_POD_INDEX": str(index),
        "VERST_TRAINER_NODES": "2",
        "VERST_TRAINER_PROCS_PER_NODE": "1",
        "VERST_TRAINER_RENDEZVOUS_HOST_TEMPLATE": "127.0.0.1",
        "VERST_TRAINER_RENDEZVOUS_PORT": str(port),
        "VERST_TRAINER_RENDEZVOUS_TIMEOUT_S": "60",
        "GLOO_SOCKET_IFNAME": "lo",
    }


def test_two_pods_of_a_two_node_trainer_train_as_one_process_does(
    model_dir: Path, tmp_path: Path, python: str, python_env: dict[str, str]
) -> None:
    script = [str(SCRIPT), "--model", str(model_dir), "--zero-stage", "2", "--steps", "2"]
    port = free_port()
    launch = [python, "-m", "services.trainer.launch", *script, "--out", str(tmp_path / "pods.json")]
    runs = {
        "one process": subprocess.Popen(
            [python, *script, "--out", str(tmp_path / "one.json")], **pipes(python_env)
        ),
        "pod 0": subprocess.Popen(launch, **pipes(pod_env(python_env, 0, port))),
        "pod 1": subprocess.Popen(launch, **pipes(pod_env(python_env, 1, port))),
    }
    outputs = {}
    try:
        for name, proc in runs.items():
            outputs[name], _ = proc.communicate(timeout=RUN_TIMEOUT_S)
            assert proc.returncode == 0, f"{name}:\n{outputs[name]}"
    finally:
        for proc in runs.values():
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
    assert "node 0 of 2 in trainer group 0" in outputs["pod 0"], outputs["pod 0"]
    assert "node 1 of 2 in trainer group 0" in outputs["pod 1"], outputs["pod 1"]
    one, pods = (json.loads((tmp_path / f"{name}.json").read_text()) for name in ("one", "pods"))
    assert_trained_as_one_process(one, pods, world=2)
