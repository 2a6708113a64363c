"""An engine's end of a weight group in a process of its own, for test_weight_broadcast.py:
``python -m tests.unit.broadcast_peer ENGINE_ID HANDLE_FILE OUT_FILE`` receives the round the
serialized CheckpointHandle names, saves the tensors as safetensors and prints a JSON result."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from safetensors.torch import save_file

from services.common.pb import common_pb2
from services.rollout.transport import BroadcastReceiver


def main() -> None:
    engine_id, handle_file, out = sys.argv[1:4]
    handle = common_pb2.CheckpointHandle.FromString(Path(handle_file).read_bytes())
    receiver = BroadcastReceiver(engine_id, "127.0.0.1")
    started = time.monotonic()
    try:
        state = receiver.receive(handle)
        save_file({name: tensor.clone() for name, tensor in state.items()}, out)
        result: dict[str, object] = {"ok": True}
    except Exception as err:
        result = {"ok": False, "error": f"{type(err).__name__}: {err}"}
    result["seconds"] = time.monotonic() - started
    receiver.leave()
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
