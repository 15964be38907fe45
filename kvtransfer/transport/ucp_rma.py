"""One-sided UCX (RMA) through ctypes, on the libucp that ucxx already loaded.

ucxx's Python API has no RMA, but its context, worker and endpoint objects expose their raw UCX
handles, and the ``libucx`` wheel's ``libucp.so`` exports the calls. Nothing here needs a
compiler: ``ctypes`` only. The structures declared here are prefixes of UCX's own (UCX only
grows them at their end and reads only the fields named in ``field_mask``/``op_attr_mask``).

The worker ucxx creates is ``UCS_THREAD_MODE_MULTI`` (checked by `worker_is_thread_safe`), so
these calls may run on any thread: a reader posts its gets and progresses the worker from its
own thread, with no hand-off to the loop thread.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import threading
from dataclasses import dataclass

from kvtransfer.transport.ucp_query import WorkerAttr, libucp

# ucp_mem_map_params_t.field_mask
_MAP_ADDRESS = 1 << 0
_MAP_LENGTH = 1 << 1
_MAP_PROT = 1 << 3
_MAP_MEMORY_TYPE = 1 << 4
# Remote read, or (`MappedRegion.map`'s ``remote_write``) remote write only: a peer with a read
# key can never write our cache, nor one with a write key read it.
_PROT_LOCAL_READ = 1 << 0
_PROT_LOCAL_WRITE = 1 << 1
_PROT_REMOTE_READ = 1 << 8
_PROT_REMOTE_WRITE = 1 << 9
# ucp_request_param_t.op_attr_mask
_OP_MEMORY_TYPE = 1 << 6
# ucs_memory_type_t
MEMORY_HOST = 0
MEMORY_CUDA = 1
# ucs_thread_mode_t
_THREAD_MODE_MULTI = 2
_WORKER_ATTR_THREAD_MODE = 1 << 0

logger = logging.getLogger(__name__)

UCS_OK = 0
UCS_INPROGRESS = 1
# Status pointers: the last 100 addresses are error codes (UCS_PTR_IS_ERR).
_ERR_LAST = 100


class _MemMapParams(ctypes.Structure):
    _fields_ = [
        ("field_mask", ctypes.c_uint64),
        ("address", ctypes.c_void_p),
        ("length", ctypes.c_size_t),
        ("flags", ctypes.c_uint),
        ("prot", ctypes.c_uint),
        ("memory_type", ctypes.c_int),
        ("exported_memh_buffer", ctypes.c_void_p),
    ]


class RequestParam(ctypes.Structure):
    """``ucp_request_param_t``; all zero means: no callback, return a request to poll."""

    _fields_ = [
        ("op_attr_mask", ctypes.c_uint32),
        ("flags", ctypes.c_uint32),
        ("request", ctypes.c_void_p),
        ("cb", ctypes.c_void_p),
        ("datatype", ctypes.c_uint64),
        ("user_data", ctypes.c_void_p),
        ("reply_buffer", ctypes.c_void_p),
        ("memory_type", ctypes.c_int),
        ("recv_info", ctypes.c_void_p),
        ("memh", ctypes.c_void_p),
    ]


@functools.cache
def _bind() -> ctypes.CDLL:
    lib = libucp()
    p, vp, sz = ctypes.POINTER, ctypes.c_void_p, ctypes.c_size_t
    signatures = {
        "ucp_mem_map": ([vp, p(_MemMapParams), p(vp)], ctypes.c_int),
        "ucp_mem_unmap": ([vp, vp], ctypes.c_int),
        "ucp_rkey_pack": ([vp, vp, p(vp), p(sz)], ctypes.c_int),
        "ucp_rkey_buffer_release": ([vp], None),
        "ucp_ep_rkey_unpack": ([vp, ctypes.c_char_p, p(vp)], ctypes.c_int),
        "ucp_rkey_destroy": ([vp], None),
        "ucp_get_nbx": ([vp, vp, sz, ctypes.c_uint64, vp, p(RequestParam)], ctypes.c_size_t),
        "ucp_put_nbx": ([vp, vp, sz, ctypes.c_uint64, vp, p(RequestParam)], ctypes.c_size_t),
        "ucp_ep_flush_nbx": ([vp, p(RequestParam)], ctypes.c_size_t),
        "ucp_request_check_status": ([vp], ctypes.c_int),
        "ucp_request_query": ([vp, p(_RequestAttr)], ctypes.c_int),
        "ucp_request_free": ([vp], None),
        "ucp_worker_progress": ([vp], ctypes.c_uint),
        "ucs_status_string": ([ctypes.c_int], ctypes.c_char_p),
    }
    for name, (args, result) in signatures.items():
        function = getattr(lib, name)
        function.argtypes = args
        function.restype = result
    return lib


class UcxStatusError(RuntimeError):
    """A UCX call failed; ``status`` is its ``ucs_status_t``."""

    def __init__(self, what: str, status: int) -> None:
        self.status = status
        text = _bind().ucs_status_string(status)
        super().__init__(f"{what} failed: {text.decode() if text else status} ({status})")


def _check(what: str, status: int) -> None:
    if status != UCS_OK:
        raise UcxStatusError(what, status)


def worker_is_thread_safe(worker: int) -> bool:
    """Whether the ``ucp_worker_h`` may be called from several threads at once."""
    attr = WorkerAttr(field_mask=_WORKER_ATTR_THREAD_MODE)
    _check("ucp_worker_query", libucp().ucp_worker_query(vp(worker), ctypes.byref(attr)))
    return attr.thread_mode == _THREAD_MODE_MULTI


def vp(handle: int) -> ctypes.c_void_p:
    return ctypes.c_void_p(handle)


@dataclass
class MappedRegion:
    """Memory registered with a UCX context for remote reads (and writes, when mapped with
    ``remote_write``), and its packed remote key."""

    context: int
    address: int
    length: int
    memory_type: int
    memh: int
    packed_key: bytes

    @classmethod
    def map(
        cls,
        context: int,
        address: int,
        length: int,
        memory_type: int,
        *,
        remote_write: bool = False,
    ) -> MappedRegion:
        lib = _bind()
        # A write mapping (a push's) is write only: its key must not also read the cache.
        remote = _PROT_REMOTE_WRITE if remote_write else _PROT_REMOTE_READ
        params = _MemMapParams(
            field_mask=_MAP_ADDRESS | _MAP_LENGTH | _MAP_PROT | _MAP_MEMORY_TYPE,
            address=address,
            length=length,
            prot=_PROT_LOCAL_READ | _PROT_LOCAL_WRITE | remote,
            memory_type=memory_type,
        )
        memh = ctypes.c_void_p()
        _check(
            "ucp_mem_map", lib.ucp_mem_map(vp(context), ctypes.byref(params), ctypes.byref(memh))
        )
        buffer, size = ctypes.c_void_p(), ctypes.c_size_t()
        try:
            _check(
                "ucp_rkey_pack",
                lib.ucp_rkey_pack(vp(context), memh, ctypes.byref(buffer), ctypes.byref(size)),
            )
        except UcxStatusError:
            lib.ucp_mem_unmap(vp(context), memh)
            raise
        try:
            packed = ctypes.string_at(buffer, size.value)
        finally:
            lib.ucp_rkey_buffer_release(buffer)
        return cls(context, address, length, memory_type, memh.value or 0, packed)

    def unmap(self) -> None:
        if self.memh:
            memh, self.memh = self.memh, 0
            _bind().ucp_mem_unmap(vp(self.context), vp(memh))


def unpack_key(endpoint: int, packed: bytes) -> int:
    """A remote key (``ucp_rkey_h``) usable on ``endpoint``; destroy it before the endpoint."""
    rkey = ctypes.c_void_p()
    _check(
        "ucp_ep_rkey_unpack",
        _bind().ucp_ep_rkey_unpack(vp(endpoint), packed, ctypes.byref(rkey)),
    )
    return rkey.value or 0


def destroy_key(rkey: int) -> None:
    _bind().ucp_rkey_destroy(vp(rkey))


def _is_error(pointer: int) -> bool:
    return pointer >= (1 << 64) - _ERR_LAST


def _as_status(pointer: int) -> int:
    return pointer - (1 << 64)


class _RequestAttr(ctypes.Structure):
    """``ucp_request_attr_t``."""

    _fields_ = [
        ("field_mask", ctypes.c_uint64),
        ("debug_string", ctypes.c_char_p),
        ("debug_string_size", ctypes.c_size_t),
        ("status", ctypes.c_int),
        ("mem_type", ctypes.c_int),
    ]


_REQUEST_ATTR_INFO_STRING = 1 << 0
_REQUEST_ATTR_INFO_STRING_SIZE = 1 << 1
_INFO_BYTES = 512
# Operations smaller (a lease-row check: 256 bytes) take another protocol than KV does.
_PROTOCOL_MIN_BYTES = 1024
# The protocol UCX picked for the first operation of each (kind, memory type) in this process
# that did not complete at once: "get cuda" -> UCX's own description (`picked_protocols`).
_PICKED: dict[str, str] = {}
_PICKED_LOCK = threading.Lock()
_MEMORY_NAMES = {MEMORY_HOST: "host", MEMORY_CUDA: "cuda"}


def picked_protocols() -> dict[str, str]:
    """What UCX said it picked for one-sided operations so far, per "get host", "put cuda",
    ...: the transports and protocol of the first such operation of this process (of 1 KiB
    or more) that UCX did not complete at once (same-host reads and writes we make ourselves
    are not UCX's). ``{proto|init} get into cuda memory length 1048576 zero-copy
    cuda_ipc/cuda ...`` is what a GPU read should say; "software emulation" is the slow path
    issue 36 measured."""
    with _PICKED_LOCK:
        return dict(_PICKED)


def _note_protocol(what: str, request: int) -> None:
    """Record (and log once) UCX's description of ``request``'s protocol as ``what``'s."""
    buffer = ctypes.create_string_buffer(_INFO_BYTES)
    attr = _RequestAttr(
        field_mask=_REQUEST_ATTR_INFO_STRING | _REQUEST_ATTR_INFO_STRING_SIZE,
        debug_string=ctypes.cast(buffer, ctypes.c_char_p),
        debug_string_size=_INFO_BYTES,
    )
    status = _bind().ucp_request_query(vp(request), ctypes.byref(attr))
    text = buffer.value.decode(errors="replace").strip() if status == UCS_OK else ""
    with _PICKED_LOCK:
        if what in _PICKED:
            return
        _PICKED[what] = text or f"not reported (ucp_request_query status {status})"
    logger.info("one-sided %s: UCX picked %s", what, _PICKED[what])


class Gets:
    """Gets posted on one endpoint, completed together by a flush (see `post` and `poll`)."""

    _OP = "ucp_get_nbx"
    _WHAT = "reading remote memory"
    _KIND = "get"

    def __init__(self, worker: int, endpoint: int, memory_type: int = MEMORY_HOST) -> None:
        self._lib = _bind()
        self._post = getattr(self._lib, self._OP)
        self._memory_type = memory_type
        self._worker = vp(worker)
        self._endpoint = vp(endpoint)
        self._param = RequestParam()
        if memory_type != MEMORY_HOST:
            self._param.op_attr_mask = _OP_MEMORY_TYPE
            self._param.memory_type = memory_type
        self._flush_param = RequestParam()
        self._flush: int | None = None
        self.posted = 0

    def post_many(
        self, local: list[int], lengths: list[int], remote: list[int], rkeys: list[int]
    ) -> None:
        """Read ``lengths[i]`` bytes at remote address ``remote[i]`` (key ``rkeys[i]``) into
        local address ``local[i]`` (`Puts`: write them there from it); completion is learnt
        from `flush` and `poll`."""
        post, free, endpoint, param = (
            self._post,
            self._lib.ucp_request_free,
            self._endpoint,
            ctypes.byref(self._param),
        )
        limit = (1 << 64) - _ERR_LAST
        what = f"{self._KIND} {_MEMORY_NAMES.get(self._memory_type, self._memory_type)}"
        for here, length, there, rkey in zip(local, lengths, remote, rkeys, strict=True):
            request = post(endpoint, here, length, there, rkey, param)
            if request:
                if request >= limit:
                    raise UcxStatusError(self._OP, _as_status(request))
                if length >= _PROTOCOL_MIN_BYTES and what not in _PICKED:
                    _note_protocol(what, request)
                # Released by UCX once complete; the flush says when that is.
                free(request)
        self.posted += len(lengths)

    def flush(self) -> None:
        """Ask to be told when every get posted so far has completed (`poll`)."""
        request = self._lib.ucp_ep_flush_nbx(self._endpoint, ctypes.byref(self._flush_param))
        if request and _is_error(request):
            raise UcxStatusError("ucp_ep_flush_nbx", _as_status(request))
        self._flush = request or None

    def poll(self) -> bool:
        """Progress the worker once; True when the flush completed (raises if it failed)."""
        if self._flush is None:
            return True
        self._lib.ucp_worker_progress(self._worker)
        status = self._lib.ucp_request_check_status(vp(self._flush))
        if status == UCS_INPROGRESS:
            return False
        self._lib.ucp_request_free(vp(self._flush))
        self._flush = None
        _check(self._WHAT, status)
        return True

    def abandon(self) -> None:
        """Stop tracking an unfinished flush (its endpoint is being closed, which ends it)."""
        if self._flush is not None:
            self._lib.ucp_request_free(vp(self._flush))
            self._flush = None


class Puts(Gets):
    """Puts posted on one endpoint: `post_many` writes local runs into the peer's memory (a key
    of a region mapped with ``remote_write``). A completed flush means UCX completed them at
    the peer: the bytes are in its memory, not merely sent."""

    _OP = "ucp_put_nbx"
    _WHAT = "writing remote memory"
    _KIND = "put"
