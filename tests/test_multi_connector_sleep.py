"""`MultiConnector` forwards the engine's sleep hooks: `unregister_kv_caches` and
`restore_kv_caches` reach every child in order (even after one raised), repeats are forwarded,
and `supports_sleep_mode` is True only if every child says so (asked with the config the child
gets). Scripted children record every call; the last tests sleep and wake real engines whose
MultiConnector hosts a real `UcxConnector`, and load after the wake-up."""

from __future__ import annotations

import logging
import socket
from typing import Any

import pytest
from multi_children import ScriptedConnector, multi

from kvtransfer import KVConnectorFactory, KVConnectorRole, KVTransferConfig
from kvtransfer.connectors.multi import MultiConnector
from kvtransfer.testing import make_kv_caches

# (child name, hook) in the order the children saw them, across all children of a test.
journal: list[tuple[str, str]] = []
# (child name, engine_id, kv_role) of every supports_sleep_mode question.
asked: list[tuple[str, str, str]] = []
MODULE = __name__


class SleepyConnector(ScriptedConnector):
    """A child that follows a sleep (unless ``sleeps`` is false): it knows whether it holds a
    registration, and raises where its script says so."""

    @classmethod
    def supports_sleep_mode(cls, kv_transfer_config: KVTransferConfig) -> bool:
        script = kv_transfer_config.kv_connector_extra_config
        asked.append(
            (script.get("name", "child"), kv_transfer_config.engine_id, kv_transfer_config.kv_role)
        )
        return script.get("sleeps", True)

    def __init__(self, config, role, kv_cache_config=None):
        super().__init__(config, role, kv_cache_config)
        self.registered = False

    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        super().register_kv_caches(kv_caches)
        self.registered = True

    def unregister_kv_caches(self) -> None:
        self._hook("unregister_kv_caches")
        self.registered = False

    def restore_kv_caches(self) -> None:
        self._hook("restore_kv_caches")
        self.registered = bool(self.layer_names)

    def _hook(self, hook: str) -> None:
        self._record(hook)
        journal.append((self.name, hook))
        failures = self.script.get(f"{hook}_raises", 0)
        if failures:
            self.script[f"{hook}_raises"] = failures - 1
            raise RuntimeError(f"{self.name}: {hook} failed")


def sleepy(name: str, **script: Any) -> dict:
    """A child's config: a `SleepyConnector` loaded from this module."""
    return {
        "kv_connector": "SleepyConnector",
        "kv_connector_module_path": MODULE,
        "kv_connector_extra_config": {"name": name, **script},
    }


def scripted(name: str) -> dict:
    """A child that keeps the base class's answer (does not follow a sleep)."""
    return {
        "kv_connector": "ScriptedConnector",
        "kv_connector_module_path": "multi_children",
        "kv_connector_extra_config": {"name": name},
    }


def multi_config(*children: dict, **fields: Any) -> KVTransferConfig:
    return KVTransferConfig(
        kv_connector="MultiConnector",
        kv_connector_extra_config={"connectors": list(children)},
        **{"kv_role": "kv_both", "engine_id": "engine-m", **fields},
    )


@pytest.fixture(autouse=True)
def _fresh_journal():
    journal.clear()
    asked.clear()
    yield
    journal.clear()
    asked.clear()


def registered_worker(*children: dict) -> MultiConnector:
    worker = multi(*children, role=KVConnectorRole.WORKER)
    worker.register_kv_caches(make_kv_caches(num_layers=2))
    assert all(getattr(child, "registered", True) for child in worker.connectors)
    return worker


def sleep_hooks(child: SleepyConnector) -> list[str]:
    return [hook for hook in child.hooks_called() if hook.endswith("_kv_caches")]


# ------------------------------------------------------------------ the hooks reach every child


@pytest.mark.unit
def test_unregister_then_restore_reach_every_child_in_order():
    worker = registered_worker(sleepy("a"), sleepy("b"), sleepy("c"))
    worker.unregister_kv_caches()
    assert journal == [(n, "unregister_kv_caches") for n in "abc"]
    assert not any(child.registered for child in worker.connectors)
    worker.restore_kv_caches()
    assert journal[3:] == [(n, "restore_kv_caches") for n in "abc"]
    assert all(child.registered for child in worker.connectors)
    for child in worker.connectors:
        # Restored, not registered anew: register_kv_caches ran once, before the sleep.
        assert sleep_hooks(child) == [
            "register_kv_caches",
            "unregister_kv_caches",
            "restore_kv_caches",
        ]


@pytest.mark.unit
def test_each_hook_is_forwarded_once_per_call_with_nothing_else():
    worker = registered_worker(sleepy("a"), sleepy("b"))
    before = [list(child.calls) for child in worker.connectors]
    worker.unregister_kv_caches()
    for child, calls in zip(worker.connectors, before, strict=True):
        assert child.calls == [*calls, ("unregister_kv_caches", None)]


@pytest.mark.unit
def test_repeats_are_forwarded_every_time_and_a_second_cycle_works():
    worker = registered_worker(sleepy("a"), sleepy("b"))
    worker.unregister_kv_caches()
    worker.unregister_kv_caches()  # the host may repeat it (idempotent)
    assert not any(child.registered for child in worker.connectors)
    worker.restore_kv_caches()
    worker.restore_kv_caches()
    assert all(child.registered for child in worker.connectors)
    # Another sleep and wake-up after the repeats.
    worker.unregister_kv_caches()
    worker.restore_kv_caches()
    assert journal == [
        (n, hook)
        for hook in (
            "unregister_kv_caches",
            "unregister_kv_caches",
            "restore_kv_caches",
            "restore_kv_caches",
            "unregister_kv_caches",
            "restore_kv_caches",
        )
        for n in "ab"
    ]
    assert all(child.registered for child in worker.connectors)


@pytest.mark.unit
def test_restore_before_any_registration_is_forwarded_and_registers_nothing():
    worker = multi(sleepy("a"), sleepy("b"), role=KVConnectorRole.WORKER)
    worker.restore_kv_caches()
    worker.unregister_kv_caches()
    assert journal == [
        ("a", "restore_kv_caches"),
        ("b", "restore_kv_caches"),
        ("a", "unregister_kv_caches"),
        ("b", "unregister_kv_caches"),
    ]
    assert not any(child.registered for child in worker.connectors)


# ------------------------------------------------------------------ a child that raises


@pytest.mark.unit
@pytest.mark.parametrize("hook", ["unregister_kv_caches", "restore_kv_caches"])
def test_a_child_that_raises_does_not_keep_the_others_from_the_hook(hook):
    worker = registered_worker(sleepy("a"), sleepy("b", **{f"{hook}_raises": 1}), sleepy("c"))
    if hook == "restore_kv_caches":
        worker.unregister_kv_caches()
        journal.clear()
    with pytest.raises(RuntimeError, match=f"b: {hook} failed"):
        getattr(worker, hook)()
    # c was asked too: unregistered, it serves no memory the host frees next; restored, it
    # serves again.
    assert journal == [("a", hook), ("b", hook), ("c", hook)]
    a, _, c = worker.connectors
    awake = hook == "restore_kv_caches"
    assert a.registered is c.registered is awake
    # The host calls it again (it is idempotent): b's second attempt succeeds.
    getattr(worker, hook)()
    assert journal[3:] == [("a", hook), ("b", hook), ("c", hook)]
    assert all(child.registered is awake for child in worker.connectors)


@pytest.mark.unit
def test_several_children_raise_the_first_error_raises_the_others_are_logged(caplog):
    worker = registered_worker(
        sleepy("a", unregister_kv_caches_raises=1),
        sleepy("b"),
        sleepy("c", unregister_kv_caches_raises=1),
    )
    with (
        caplog.at_level(logging.ERROR, logger="kvtransfer.connectors.multi"),
        pytest.raises(RuntimeError, match="a: unregister_kv_caches failed"),
    ):
        worker.unregister_kv_caches()
    assert [n for n, _ in journal] == ["a", "b", "c"]
    logged = [r.getMessage() for r in caplog.records]
    assert logged == [
        "MultiConnector: unregister_kv_caches of child 2:SleepyConnector failed too: "
        "RuntimeError: c: unregister_kv_caches failed"
    ]


@pytest.mark.unit
def test_a_child_keeping_the_base_no_op_hooks_is_forwarded_to_without_error():
    # The base hooks do nothing: a child that keeps them (no registration) is forwarded to
    # without error, next to one that implements them.
    worker = registered_worker(scripted("plain"), sleepy("b"))
    worker.unregister_kv_caches()
    worker.restore_kv_caches()
    assert journal == [("b", "unregister_kv_caches"), ("b", "restore_kv_caches")]


# ------------------------------------------------------------------ supports_sleep_mode


@pytest.mark.unit
@pytest.mark.parametrize(
    ("answers", "expected"),
    [
        ((True,), True),
        ((True, True, True), True),
        ((False,), False),
        ((True, False), False),
        ((False, True), False),
        ((True, True, False), False),
    ],
)
def test_supports_sleep_mode_only_if_every_child_does(answers, expected):
    children = [sleepy(f"c{i}", sleeps=answer) for i, answer in enumerate(answers)]
    assert MultiConnector.supports_sleep_mode(multi_config(*children)) is expected
    # Asked through the factory's class lookup, as an engine asks before any instance exists.
    config = multi_config(*children)
    assert KVConnectorFactory.get_connector_class(config).supports_sleep_mode(config) is expected


@pytest.mark.unit
def test_a_child_keeping_the_base_answer_makes_the_multi_refuse():
    assert MultiConnector.supports_sleep_mode(multi_config(sleepy("a"), scripted("b"))) is False
    assert MultiConnector.supports_sleep_mode(multi_config(scripted("b"), sleepy("a"))) is False


@pytest.mark.unit
def test_each_child_is_asked_with_the_config_it_inherits():
    config = multi_config(
        sleepy("a"),
        {**sleepy("b"), "kv_role": "kv_consumer", "engine_id": "own"},
        kv_role="kv_producer",
        engine_id="parent",
    )
    assert MultiConnector.supports_sleep_mode(config) is True
    assert asked == [("a", "parent", "kv_producer"), ("b", "own", "kv_consumer")]


@pytest.mark.unit
@pytest.mark.parametrize("children", [None, [], ["not an object"], [sleepy("a"), 5]])
def test_a_malformed_child_list_does_not_follow_a_sleep(children):
    extra = {} if children is None else {"connectors": children}
    config = KVTransferConfig(kv_connector="MultiConnector", kv_connector_extra_config=extra)
    assert MultiConnector.supports_sleep_mode(config) is False


# ------------------------------------------------------------------ a real UcxConnector child


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _ucx_multi(role: str, engine_id: str, data_plane: str, **fields: Any) -> KVTransferConfig:
    ucx = {
        "kv_connector": "UcxConnector",
        "kv_connector_extra_config": {"kv_lease_s": 0.3, "data_plane": data_plane},
        **fields,
    }
    return multi_config(ucx, kv_role=role, engine_id=engine_id)


@pytest.mark.integration
@pytest.mark.parametrize("data_plane", ["rma", "tagged"])
def test_a_multi_hosting_ucx_sleeps_wakes_and_a_load_still_works(data_plane):
    from engine_helpers.builtin import PROMPTS, colocated, engine_config, finish, worker_caches
    from ucx_helpers.engines import pd_run, prefill

    from kvtransfer.connectors.ucx import UcxConnector
    from kvtransfer.engine.llm import LLM

    expected = [o.token_ids for o in colocated(PROMPTS[:3])]
    # A fixed port: after the wake-up only the generation says the handshake changed.
    producer_kv = _ucx_multi("kv_producer", "multi-sleeper", data_plane, kv_port=_free_port())
    consumer_kv = _ucx_multi("kv_consumer", "multi-decode", data_plane)
    with LLM(engine_config(producer_kv)) as producer, LLM(engine_config(consumer_kv)) as decode:
        core = producer.engine
        assert isinstance(core.connector, MultiConnector)
        (scheduler_ucx,) = core.connector.connectors
        (worker_ucx,) = core.executor._worker.kv_connector.connector.connectors
        assert isinstance(scheduler_ucx, UcxConnector) and isinstance(worker_ucx, UcxConnector)
        scheduler_half, worker_half = scheduler_ucx.scheduler_half, worker_ucx.worker_half

        assert pd_run(producer, decode, [PROMPTS[0]])[0].token_ids == expected[0]
        (stale,) = prefill(producer, [PROMPTS[1]])
        generation = scheduler_half.book.generation
        caches = worker_caches(core)

        core.sleep()  # drains: the unpulled request's lease runs out first
        assert core.is_sleeping and worker_half.agent is None
        assert all(cache.untyped_storage().nbytes() == 0 for cache in caches.values())
        core.executor._worker.kv_connector.unregister_kv_caches()  # a repeat: harmless
        assert worker_half.agent is None

        core.wake_up()
        assert not core.is_sleeping and worker_half.agent is not None
        agent = worker_half.agent
        core.executor._worker.kv_connector.restore_kv_caches()  # a repeat: the same agent
        assert worker_half.agent is agent
        # The Multi passed its child's new handshake on: a new generation is served.
        assert scheduler_half.book.generation != generation

        after = pd_run(producer, decode, [PROMPTS[2]])
        (refused,) = pd_run(producer, decode, [PROMPTS[1]], [stale.kv_transfer_params])
        finish(core, decode.engine)
    assert after[0].token_ids == expected[2]
    assert refused.error is not None and "StaleGenerationError" in refused.error
