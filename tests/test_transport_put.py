"""One-sided writes, the push data plane's building blocks: UCX puts into memory a peer mapped
with remote write, and same-host ``process_vm_writev``, between real processes.

A target process maps a sentinel-filled buffer (`transport_helpers.put_target`); this process
writes scattered runs of seeded bytes into it, then has the target dump its buffer: it must be
the sentinel with exactly those runs written, once the puts' flush completed (UCX's remote
completion: the bytes are in the target's memory, not merely sent).
"""

from __future__ import annotations

import base64
import time

import numpy as np
import pytest
import torch
from helper_processes import read_ready_line, spawn, stop

from kvtransfer.transport.direct_read import DirectWriter, plan_direct
from kvtransfer.transport.errors import PeerUnreachable
from kvtransfer.transport.ucp_rma import Puts, destroy_key, unpack_key
from kvtransfer.transport.ucx import UcxLoop

pytestmark = pytest.mark.integration

TARGET_BYTES = 1 << 16
SENTINEL = 0xA5
WAIT_S = 20.0
# (offset in the target, length): scattered, unsorted, one crossing 4 KiB pages.
RUNS = ((40_000, 3000), (128, 512), (9000, 4096), (65_000, 536))


class Target:
    def __init__(self, read_only: bool = False) -> None:
        args = ["--bytes", str(TARGET_BYTES)] + (["--read-only"] if read_only else [])
        self.process = spawn("transport_helpers.put_target", *args)
        ready = read_ready_line(self.process, 30, "put target")
        self.pid = int(ready["pid"])
        self.address = int(ready["address"])
        self.key = base64.b64decode(ready["key"])
        self.worker = base64.b64decode(ready["worker"])

    def dump(self) -> torch.Tensor:
        assert self.process.stdin is not None
        self.process.stdin.write("dump\n")
        self.process.stdin.flush()
        data = read_ready_line(self.process, 30, "put target")["bytes"]
        return torch.frombuffer(bytearray(base64.b64decode(data)), dtype=torch.uint8)

    def close(self) -> None:
        stop(self.process, 30)


@pytest.fixture
def target():
    t = Target()
    try:
        yield t
    finally:
        t.close()


def _source() -> torch.Tensor:
    generator = torch.Generator().manual_seed(7)
    return torch.randint(0, 256, (TARGET_BYTES,), generator=generator, dtype=torch.uint8)


def _expected(source: torch.Tensor) -> torch.Tensor:
    want = torch.full((TARGET_BYTES,), SENTINEL, dtype=torch.uint8)
    for offset, length in RUNS:
        # The source run at offset x goes to the target at the same offset.
        want[offset : offset + length] = source[offset : offset + length]
    return want


def _arrays(source: torch.Tensor, target: Target) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    local = np.array([source.data_ptr() + o for o, _ in RUNS], dtype=np.int64)
    remote = np.array([target.address + o for o, _ in RUNS], dtype=np.int64)
    lengths = np.array([n for _, n in RUNS], dtype=np.int64)
    return local, remote, lengths


def test_puts_are_in_the_targets_memory_once_their_flush_completed(target):
    source = _source()
    loop = UcxLoop(name="put-writer", shared_memory=False)
    try:
        loop.call(lambda: loop.endpoint(target.worker)).result(WAIT_S)
        endpoint = loop.endpoint_handle(target.worker)
        assert endpoint is not None
        rkey = unpack_key(endpoint, target.key)
        try:
            local, remote, lengths = _arrays(source, target)
            puts = Puts(loop.worker_handle, endpoint)
            puts.post_many(local.tolist(), lengths.tolist(), remote.tolist(), [rkey] * len(RUNS))
            puts.flush()
            deadline = time.monotonic() + WAIT_S
            while not puts.poll():
                assert time.monotonic() < deadline, "the puts' flush did not complete"
            assert puts.posted == len(RUNS)
        finally:
            destroy_key(rkey)
        assert torch.equal(target.dump(), _expected(source))
    finally:
        loop.close()


def test_same_host_writes_land_directly_and_a_gone_target_fails_typed(target):
    source = _source()
    writer = DirectWriter(target.pid)
    assert writer.probe(target.address, bytes([SENTINEL]) * 16)
    local, remote, lengths = _arrays(source, target)
    writer.run(plan_direct(local, remote, lengths))
    assert (writer.reads, writer.bytes_read) == (1, sum(n for _, n in RUNS))
    assert torch.equal(target.dump(), _expected(source))
    target.process.kill()
    target.process.wait()
    with pytest.raises(PeerUnreachable, match=rf"writing process {target.pid} failed: the process"):
        writer.run(plan_direct(local, remote, lengths))
