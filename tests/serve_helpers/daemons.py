"""Real daemons (and the router) as child processes on 127.0.0.1, plus the colocated reference."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from kvtransfer.clients.control import AdminClient
from kvtransfer.engine.config import EngineConfig
from kvtransfer.engine.llm import LLM
from kvtransfer.engine.sampling_params import SamplingParams
from kvtransfer.serve.launcher import ServiceProcess, daemon_command, router_command

BLOCK_SIZE = 16
NUM_KV_BLOCKS = 96
COMMON_FLAGS = (
    "--port",
    "0",
    "--block-size",
    str(BLOCK_SIZE),
    "--num-kv-blocks",
    str(NUM_KV_BLOCKS),
    "--metrics-port",
    "0",
)

PROMPTS = [
    "Hi",
    "The quick brown fox jumps over the lazy dog, again and again and again.",
    "Disaggregated serving moves the prompt's KV cache from prefill to decode. " * 3,
]


def start_daemon(
    role: str,
    log_dir: Path,
    *flags: str,
    kv: dict[str, Any] | None = None,
    name: str | None = None,
    env: dict[str, str] | None = None,
) -> ServiceProcess:
    # Every prompt streams (the default leaves short ones out): the tests' prompts are short.
    config = {"kv_port": 0, "kv_connector_extra_config": {"kv_stream_min_tokens": 0}, **(kv or {})}
    argv = daemon_command(role, *COMMON_FLAGS, "--kv-transfer-config", json.dumps(config), *flags)
    name = name or role
    return ServiceProcess.start(name, argv, log_dir / f"{name}.log", env=env)


def stream_flags(flags: Sequence[str]) -> tuple[str, ...]:
    """``--kv-stream always`` unless ``flags`` choose: the tests' daemons share this machine's
    cores (network namespaces too), where the router's default, auto, would not stream."""
    if any(flag.startswith(("--kv-stream", "--no-kv-stream")) for flag in flags):
        return ()
    return ("--kv-stream", "always")


def start_router(
    log_dir: Path,
    prefills: Sequence[ServiceProcess],
    decodes: Sequence[ServiceProcess],
    *extra: str,
    name: str = "router",
) -> ServiceProcess:
    flags = ["--port", "0", *stream_flags(extra), *extra]
    for daemon in prefills:
        flags += ["--prefill", daemon.address]
    for daemon in decodes:
        flags += ["--decode", daemon.address]
    return ServiceProcess.start(name, router_command(*flags), log_dir / f"{name}.log")


@contextlib.contextmanager
def running(*processes: ServiceProcess) -> Iterator[None]:
    try:
        yield
    finally:
        for process in processes:
            process.terminate()


@contextlib.contextmanager
def daemon_pair(
    log_dir: Path,
    prefill_flags: Sequence[str],
    decode_flags: Sequence[str],
    kv: dict[str, Any] | None = None,
) -> Iterator[tuple[ServiceProcess, ServiceProcess]]:
    """A prefill and a decode daemon (``kv``: both sides' KV transfer config, as
    `start_daemon`); both must stop with no KV block in use."""
    prefill = start_daemon("prefill", log_dir, *prefill_flags, kv=kv)
    try:
        decode = start_daemon("decode", log_dir, *decode_flags, kv=kv)
    except BaseException:
        prefill.terminate()
        raise
    with running(decode, prefill):
        yield prefill, decode
    assert exit_used_blocks(prefill) == 0
    assert exit_used_blocks(decode) == 0


def colocated(
    prompts: Sequence[str | list[int]],
    max_tokens: int,
    *,
    sampling: Mapping[str, Any] | None = None,
    **engine: Any,
) -> list[list[int]]:
    """The reference: the same engine, one process, no transfer (``sampling``: temperature,
    seed and the like)."""
    config = EngineConfig(block_size=BLOCK_SIZE, num_kv_blocks=NUM_KV_BLOCKS, **engine)
    params = SamplingParams(max_tokens=max_tokens, **(sampling or {}))
    with LLM(config) as llm:
        outputs = llm.generate(list(prompts), params)
    return [o.token_ids for o in outputs]


def admin(address: str, method: str, *args: Any, **client: Any) -> Any:
    async def call() -> Any:
        admin_client = AdminClient(address, **client)
        try:
            return await getattr(admin_client, method)(*args)
        finally:
            await admin_client.close()

    return asyncio.run(call())


def exit_used_blocks(process: ServiceProcess) -> int | None:
    """The daemon's last words: how many KV blocks were still in use when it stopped."""
    return process.blocks_in_use_at_exit()
