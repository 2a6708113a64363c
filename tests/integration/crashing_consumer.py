"""A consumer that takes a batch, commits part of it, then hangs until it is killed.

python tests/integration/crashing_consumer.py REDIS_URL STREAM GROUP DONE_FILE TAKE COMMIT
"""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

from services.common.bus import Bus
from services.common.pb import common_pb2


async def main(url: str, stream: str, group: str, done_file: str, take: int, commit: int) -> None:
    bus = Bus.from_url(url)
    batch = await bus.read(stream, group, "victim", common_pb2.Trajectory, count=take, block_ms=5000)
    committed = batch[:commit]
    # Commit the work first, then ack: the order that makes a crash lose nothing.
    Path(done_file).write_text("".join(f"{d.message.id}\n" for d in committed))
    await bus.ack(stream, group, [d.entry_id for d in committed])
    print(f"READY {len(batch)}", flush=True)
    await asyncio.sleep(120)  # "processing" the rest when the kill arrives


if __name__ == "__main__":
    url, stream, group, done_file, take, commit = sys.argv[1:7]
    asyncio.run(main(url, stream, group, done_file, int(take), int(commit)))
