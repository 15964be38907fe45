"""A process whose buffer peers may write one-sided: it maps ``--bytes`` of host memory (filled
with 0xA5) with UCX remote write, prints one JSON line (its pid, the buffer's address and
packed remote key, its UCX worker address), then answers "dump" on stdin with the buffer's
bytes (base64) until its stdin closes.

    python -m transport_helpers.put_target --bytes 65536
"""

from __future__ import annotations

import argparse
import base64
import json
import sys

import torch

from kvtransfer.transport.ucp_rma import MEMORY_HOST, MappedRegion
from kvtransfer.transport.ucx import UcxLoop

SENTINEL = 0xA5


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--bytes", type=int, required=True)
    parser.add_argument("--read-only", action="store_true", help="map without remote write")
    args = parser.parse_args()
    buffer = torch.full((args.bytes,), SENTINEL, dtype=torch.uint8)
    loop = UcxLoop(name="put-target")
    region = MappedRegion.map(
        loop.context_handle,
        buffer.data_ptr(),
        buffer.numel(),
        MEMORY_HOST,
        remote_write=not args.read_only,
    )
    ready = {
        "pid": __import__("os").getpid(),
        "address": buffer.data_ptr(),
        "key": base64.b64encode(region.packed_key).decode(),
        "worker": base64.b64encode(loop.address).decode(),
    }
    print(json.dumps(ready), flush=True)
    for line in sys.stdin:
        if line.strip() == "dump":
            print(json.dumps({"bytes": base64.b64encode(buffer.numpy().tobytes()).decode()}),
                  flush=True)  # fmt: skip
    region.unmap()
    loop.close()


if __name__ == "__main__":
    main()
