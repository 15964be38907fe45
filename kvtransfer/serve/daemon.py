"""`Daemon`: what the prefill and decode daemons share, an engine behind one gRPC port.

Life cycle of a daemon:

1. Settings are merged (defaults, ``--config``, ``KVTRANSFER_*``, flags) and validated; a bad
   one exits 2 naming it.
2. The engine starts: model, workers (one process per TP x PP rank beyond the first), the KV
   block pool and the connector. A prefill daemon's UcxConnector starts serving its handshake
   and release notices on ``kv_ip:kv_port``. With ``--kv-events-endpoint`` the block pool's
   prefix-cache changes are published from then on (`kvtransfer.serve.kv_events`).
3. One gRPC server on ``--port`` serves Generation, KVAdmin, grpc.health.v1 and reflection
   (and KVHandshake from the book of the connector's control endpoint, a prefill's UCX book,
   the same as on ``kv_port``); status counters come from its transfer totals. Metrics go to
   ``--metrics-port``. A ``ready`` line with the bound addresses goes to stdout. The server
   takes messages of ``--max-request-bytes`` plus headroom (`kvtransfer.clients.limits`), the
   router's body limit when both keep the default.
4. Requests flow through `GenerationService` and the engine thread (see its module).
5. SIGTERM or KVAdmin ``Drain``: health turns NOT_SERVING and new Generate calls get
   UNAVAILABLE; requests in flight run to the end; a prefill daemon keeps the KV it holds until
   consumers pulled it or its lease ran out. After ``--drain-timeout-s`` whatever still runs is
   aborted (each stream ends with finish_reason "abort"), never dropped silently.
6. SIGTERM then stops the server, the engine and its workers, and exits 0.
"""

from __future__ import annotations

import asyncio
import json
import logging
import signal
import sys
import threading
import time
from collections.abc import Sequence
from typing import TextIO

from kvtransfer.clients.limits import grpc_message_options
from kvtransfer.connector.serving import KVControlEndpoint, KVTransferTotals
from kvtransfer.control import start_control_server
from kvtransfer.control.server import ControlServer
from kvtransfer.engine.engine_core import EngineCore
from kvtransfer.engine.llm import LLM
from kvtransfer.engine.model.chat_template import ChatTemplate
from kvtransfer.engine.runner.kv_cache import kv_bytes_per_block, resolve_dtype
from kvtransfer.logs import configure_logging
from kvtransfer.serve.admin_backend import EngineAdminBackend, connector_totals, held_kv
from kvtransfer.serve.engine_thread import EngineThread
from kvtransfer.serve.generation import GenerationService, ServiceContext
from kvtransfer.serve.kv_events import KVEventPublisher
from kvtransfer.serve.launcher import EXIT_BLOCKS_MARKER, EXIT_BLOCKS_PREFIX
from kvtransfer.serve.ledger import ServingLedger
from kvtransfer.serve.metrics import DaemonMetrics
from kvtransfer.serve.settings import DaemonSettings, Role, SettingsError, load_settings
from kvtransfer.v1 import generation_pb2, generation_pb2_grpc

logger = logging.getLogger("kvtransfer.serve")

GENERATION_SERVICE = generation_pb2.DESCRIPTOR.services_by_name["Generation"].full_name
_DRAIN_POLL_S = 0.05
_ABORT_SETTLE_S = 10.0


class Daemon:
    def __init__(self, settings: DaemonSettings) -> None:
        self.settings = settings
        self.engine_id = settings.resolved_engine_id()
        self.ledger = ServingLedger()
        self.metrics = DaemonMetrics(settings.role, self.engine_id)
        self._draining = threading.Event()
        self._llm: LLM | None = None
        self._engine: EngineThread | None = None
        self._server: ControlServer | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._totals_seen = KVTransferTotals()
        self._kv_events: KVEventPublisher | None = None
        self.metrics_port: int | None = None

    # ------------------------------------------------------------------ start

    async def start(self) -> None:
        settings = self.settings
        self._loop = asyncio.get_running_loop()
        # Before the engine: a bad template file fails the start at once, naming it.
        chat_template = ChatTemplate.for_model(settings.model, settings.chat_template)
        # Loading the model and spawning workers blocks for seconds: keep the loop free.
        self._llm = await asyncio.to_thread(LLM, settings.engine_config())
        core = self._llm.engine
        if settings.kv_events_endpoint is not None:
            self._kv_events = KVEventPublisher(
                settings.kv_events_endpoint,
                replay_endpoint=settings.kv_events_replay_endpoint,
                topic=settings.kv_events_topic,
            )
            self._kv_events.start()
            # Before the engine thread starts: from then on only that thread calls the sink.
            core.scheduler.block_manager.event_sink = self._kv_events
        self._engine = EngineThread(core, after_step=self._after_step)
        self._engine.start()
        bytes_per_block = kv_bytes_per_block(
            core.model_config, core.config.block_size, resolve_dtype(core.config)
        )
        context = ServiceContext(
            engine=self._engine,
            tokenizer=self._llm.tokenizer,
            chat_template=chat_template,
            vocab_size=core.model_config.vocab_size,
            ledger=self.ledger,
            metrics=self.metrics,
            bytes_per_block=bytes_per_block,
            is_admitting=lambda: not self._draining.is_set(),
        )
        admin = EngineAdminBackend(
            engine=self._engine,
            ledger=self.ledger,
            role=core.config.kv_transfer_config.kv_role or "",
            engine_id=self.engine_id,
            model=settings.model,
            bytes_per_block=bytes_per_block,
            begin_drain=self.begin_drain,
        )
        service = GenerationService(context)
        security: dict[str, object] = {}
        tls = settings.tls_files()
        if tls is not None:
            security["tls"] = tls
        if settings.admin_token:
            security["admin_token"] = settings.admin_token
        self._server = await start_control_server(
            settings.host,
            settings.port,
            book=endpoint.book if (endpoint := self.control_endpoint(core)) else None,
            admin=admin,
            options=grpc_message_options(settings.max_request_bytes),
            services=[
                (
                    GENERATION_SERVICE,
                    lambda server: generation_pb2_grpc.add_GenerationServicer_to_server(
                        service, server
                    ),
                )
            ],
            **security,
        )
        if settings.metrics_port is not None:
            self.metrics_port = self.metrics.serve(
                settings.metrics_host or settings.host, settings.metrics_port
            )

    @staticmethod
    def control_endpoint(core: EngineCore) -> KVControlEndpoint | None:
        """The connector's handshake (a producer's), served on the daemon port too."""
        return None if core.connector is None else core.connector.get_control_endpoint()

    @property
    def address(self) -> str:
        if self._server is None:
            raise RuntimeError("the daemon has not started")
        return self._server.address

    def ready_info(self) -> dict[str, object]:
        core = self._engine.core if self._engine is not None else None
        endpoint = self.control_endpoint(core) if core is not None else None
        return {
            "role": self.settings.role,
            "engine_id": self.engine_id,
            "grpc": self.address,
            "kv_handshake": endpoint.address if endpoint is not None else None,
            "metrics_port": self.metrics_port,
            "kv_events": self._kv_events.endpoint if self._kv_events else None,
            "kv_events_replay": self._kv_events.replay_endpoint if self._kv_events else None,
        }

    # ------------------------------------------------------------------ drain and stop

    def begin_drain(self) -> int:
        """Stop admitting (health NOT_SERVING); returns the requests and held KV in flight.
        Safe from any thread."""
        if not self._draining.is_set():
            self._draining.set()
            logger.info("draining: no new requests are admitted")
            if self._loop is not None and self._server is not None:
                asyncio.run_coroutine_threadsafe(self._server.set_serving(False), self._loop)
        engine = self._engine
        if engine is None or not engine.is_running:
            return 0
        return engine.num_running() + len(held_kv(engine, self.ledger))

    async def drain(self, timeout_s: float) -> bool:
        """`begin_drain`, then wait until the engine has nothing left (requests, held KV,
        loads); aborts what remains after ``timeout_s``. True if everything finished."""
        await asyncio.to_thread(self.begin_drain)
        engine = self._engine
        if engine is None or not engine.is_running:
            return True
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            pending = await asyncio.to_thread(engine.call, lambda core: core.has_pending_work())
            if not pending:
                logger.info("drained: nothing in flight")
                return True
            await asyncio.sleep(_DRAIN_POLL_S)
        aborted = await asyncio.to_thread(engine.abort_all)
        logger.warning(
            "drain timed out after %.1f s: aborted %d running request(s)", timeout_s, aborted
        )
        # Aborted loads hand their blocks back once their pulls stopped: a few steps more.
        deadline = time.monotonic() + _ABORT_SETTLE_S
        while time.monotonic() < deadline:
            if not await asyncio.to_thread(engine.call, lambda core: core.has_pending_work()):
                break
            await asyncio.sleep(_DRAIN_POLL_S)
        return False

    def num_used_blocks(self) -> int | None:
        engine = self._engine
        if engine is None or not engine.is_running:
            return None
        return engine.call(lambda core: core.scheduler.block_manager.num_used_blocks)

    async def stop(self) -> None:
        if self._server is not None:
            await self._server.stop(grace=2.0)
        if self._engine is not None:
            self._engine.stop()
        if self._llm is not None:
            await asyncio.to_thread(self._llm.shutdown)
        if self._kv_events is not None:
            await asyncio.to_thread(self._kv_events.close)
        self.metrics.close()

    # ------------------------------------------------------------------ per step

    def _after_step(self, core: EngineCore, outputs: list) -> None:
        blocks = core.scheduler.block_manager
        self.metrics.set_blocks(blocks.num_used_blocks, blocks.num_free_blocks)
        totals = connector_totals(core)
        if totals is None:
            return
        count = totals.handshakes - self._totals_seen.handshakes
        if count:
            total_ms = (totals.handshake_s - self._totals_seen.handshake_s) * 1e3
            self.metrics.record_handshakes(count, total_ms)
            self.ledger.set_handshake_latency(total_ms / count)
        expired = totals.leases_expired - self._totals_seen.leases_expired
        if expired > 0:
            self.metrics.leases_expired(expired)
        self._totals_seen = totals


async def serve(settings: DaemonSettings, ready_stream: TextIO = sys.stdout) -> int:
    """Run a daemon until SIGTERM/SIGINT; returns the exit code."""
    daemon = Daemon(settings)
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    try:
        await daemon.start()
    except Exception as exc:
        logger.error("start-up failed: %s: %s", type(exc).__name__, exc)
        await daemon.stop()
        print(f"error: start-up failed: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    print(f"kvtransfer-{settings.role} ready {json.dumps(daemon.ready_info())}", file=ready_stream)
    ready_stream.flush()
    await stop.wait()
    logger.info("signal received: draining (at most %.0f s)", settings.drain_timeout_s)
    await daemon.drain(settings.drain_timeout_s)
    used = await asyncio.to_thread(daemon.num_used_blocks)
    await daemon.stop()
    # Tests and operators read this line to check nothing was left behind.
    logger.info(
        "%s%s %s", EXIT_BLOCKS_PREFIX, "unknown" if used is None else used, EXIT_BLOCKS_MARKER
    )
    return 0


def main(role: Role, argv: Sequence[str] | None = None) -> int:
    try:
        settings = load_settings(role, argv)
    except SettingsError as exc:
        print(f"kvtransfer-{role}: error: {exc}", file=sys.stderr)
        return 2
    configure_logging(settings.log_level, settings.log_format)
    # The engine thread runs Python between its tensor operations (scheduling, the connector)
    # and holds the GIL for up to the switch interval each time another thread wants it; at
    # CPython's 5 ms a token sampled could wait that long for the gRPC loop to send it.
    sys.setswitchinterval(settings.switch_interval_ms / 1e3)
    return asyncio.run(serve(settings))
