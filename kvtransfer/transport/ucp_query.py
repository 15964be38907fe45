"""A UCX worker's network-only address, which ucxx does not expose: ``ucp_worker_query`` with
``UCP_WORKER_ADDRESS_FLAG_NET_ONLY`` through ctypes, on the libucp ucxx already loaded.

A peer given this address can only choose network transports (TCP, or RDMA where UCX has it):
the shared-memory and loopback-only entries are simply not in it. ``ucp_worker_attr_t`` only
ever grows at its end and UCX writes only the fields named in ``field_mask``, so the prefix
declared here is the stable part of the ABI (UCX 1.10 onwards).
"""

from __future__ import annotations

import ctypes
import functools
import os
from typing import Any

_LIBUCP = "libucp.so.0"
_ATTR_FIELD_ADDRESS = 1 << 1
_ATTR_FIELD_ADDRESS_FLAGS = 1 << 2
_ADDRESS_FLAG_NET_ONLY = 1 << 0
# UCP_ENTITY_NAME_MAX in ucp.h.
_NAME_MAX = 32


class WorkerAttr(ctypes.Structure):
    _fields_ = [
        ("field_mask", ctypes.c_uint64),
        ("thread_mode", ctypes.c_int),
        ("address_flags", ctypes.c_uint32),
        ("address", ctypes.c_void_p),
        ("address_length", ctypes.c_size_t),
        ("max_am_header", ctypes.c_size_t),
        ("name", ctypes.c_char * _NAME_MAX),
        ("max_debug_string", ctypes.c_size_t),
    ]


@functools.cache
def libucp() -> Any:
    """The libucp ucxx loaded (`RuntimeError` if none is)."""
    # RTLD_NOLOAD: the library ucxx loaded, never a second copy (its handles would not match).
    try:
        lib = ctypes.CDLL(_LIBUCP, mode=os.RTLD_NOLOAD)
    except OSError as exc:
        raise RuntimeError(f"{_LIBUCP} is not loaded in this process: {exc}") from None
    lib.ucp_worker_query.argtypes = [ctypes.c_void_p, ctypes.POINTER(WorkerAttr)]
    lib.ucp_worker_query.restype = ctypes.c_int
    lib.ucp_worker_release_address.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
    lib.ucp_worker_release_address.restype = None
    return lib


def net_only_address(worker_handle: int) -> bytes:
    """The packed address of the ``ucp_worker_h`` ``worker_handle`` with network devices only.

    Call it from the thread that owns the worker (UCX workers are single-threaded here).
    """
    lib = libucp()
    attr = WorkerAttr(
        field_mask=_ATTR_FIELD_ADDRESS | _ATTR_FIELD_ADDRESS_FLAGS,
        address_flags=_ADDRESS_FLAG_NET_ONLY,
    )
    worker = ctypes.c_void_p(worker_handle)
    status = lib.ucp_worker_query(worker, ctypes.byref(attr))
    if status != 0:
        raise RuntimeError(f"ucp_worker_query(NET_ONLY) failed with UCS status {status}")
    try:
        return ctypes.string_at(attr.address, attr.address_length)
    finally:
        lib.ucp_worker_release_address(worker, attr.address)
