"""`KVConnectorContract`: the behaviour every connector owes the engine, as pytest tests.

Subclass it in a test module (the class name must start with ``Test``) and provide a
``kv_transfer_config`` fixture; optionally override ``kv_caches``. Each test builds fresh
connector instances through `KVConnectorFactory`, exactly as the engine does, and shuts them
down afterwards.
"""

from __future__ import annotations

import json
import pickle
from collections.abc import Iterator

import pytest
import torch

from kvtransfer.connector.base import KVConnectorBase_V1
from kvtransfer.connector.config import KVTransferConfig
from kvtransfer.connector.factory import KVConnectorFactory
from kvtransfer.connector.metadata import (
    KVConnectorHandshakeMetadata,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorStats,
)
from kvtransfer.connector.serving import KVControlEndpoint, KVTransferTotals
from kvtransfer.testing.builders import ContractSchedulerOutput, make_kv_caches, make_request

PP_REJECTION = "does not support PP-disaggregated KV transfer"


def _is_id_set(value: object) -> bool:
    return value is None or (isinstance(value, set) and all(isinstance(i, str) for i in value))


class KVConnectorContract:
    @pytest.fixture
    def kv_transfer_config(self) -> KVTransferConfig:
        raise NotImplementedError("provide a kv_transfer_config fixture for your connector")

    @pytest.fixture
    def kv_caches(self) -> dict[str, torch.Tensor]:
        return make_kv_caches()

    @pytest.fixture
    def scheduler(self, kv_transfer_config: KVTransferConfig) -> Iterator[KVConnectorBase_V1]:
        connector = KVConnectorFactory.create_connector(
            kv_transfer_config, KVConnectorRole.SCHEDULER
        )
        yield connector
        connector.shutdown()

    @pytest.fixture
    def worker(
        self, kv_transfer_config: KVTransferConfig, kv_caches: dict[str, torch.Tensor]
    ) -> Iterator[KVConnectorBase_V1]:
        connector = KVConnectorFactory.create_connector(kv_transfer_config, KVConnectorRole.WORKER)
        connector.register_kv_caches(kv_caches)
        yield connector
        connector.shutdown()

    def test_factory_builds_both_roles(self, scheduler, worker):
        assert isinstance(scheduler, KVConnectorBase_V1)
        assert scheduler.role is KVConnectorRole.SCHEDULER
        assert worker.role is KVConnectorRole.WORKER
        assert type(scheduler) is type(worker)

    def test_step_without_forward(self, scheduler, worker):
        metadata = scheduler.build_connector_meta(ContractSchedulerOutput())
        assert isinstance(metadata, KVConnectorMetadata)
        metadata = pickle.loads(pickle.dumps(metadata))  # it crosses into worker processes
        worker.clear_connector_metadata()  # clearing with nothing bound is allowed
        worker.bind_connector_metadata(metadata)
        assert worker.has_connector_metadata()
        sending, recving, failed = worker.get_transfer_results(set())
        assert _is_id_set(sending) and _is_id_set(recving) and _is_id_set(failed)
        assert set(failed or ()) <= set(recving or ())
        worker.clear_connector_metadata()
        assert not worker.has_connector_metadata()

    def test_step_with_forward_touches_no_kv(self, scheduler, worker, kv_caches):
        before = {name: t.clone() for name, t in kv_caches.items()}
        scheduler_output = ContractSchedulerOutput(num_scheduled_tokens={"req-0": 4})
        worker.bind_connector_metadata(scheduler.build_connector_meta(scheduler_output))
        worker.start_load_kv(None)
        for name, tensor in kv_caches.items():
            worker.wait_for_layer_load(name)
            worker.save_kv_layer(name, tensor, None)
        worker.wait_for_save()
        worker.get_transfer_results(set())
        worker.clear_connector_metadata()
        for name, tensor in kv_caches.items():
            assert torch.equal(tensor, before[name]), f"{name} changed by a step with no loads"

    def test_plain_request_lifecycle(self, scheduler):
        request = make_request("contract-req", num_prompt_tokens=20)
        num_tokens, load_async = scheduler.get_num_new_matched_tokens(request, 0)
        assert num_tokens is None or 0 <= num_tokens <= request.num_tokens
        assert isinstance(load_async, bool)
        scheduler.update_state_after_alloc(request, [0, 1], 0)
        scheduler.build_connector_meta(ContractSchedulerOutput())
        delay_free, params = scheduler.request_finished(request, [0, 1])
        assert isinstance(delay_free, bool)
        assert params is None or isinstance(params, dict)
        json.dumps(params)  # kv_transfer_params travel back to the client as JSON

    def test_get_block_ids_with_load_errors_is_a_set_of_ints(self, worker):
        errors = worker.get_block_ids_with_load_errors()
        assert isinstance(errors, set) and all(isinstance(b, int) for b in errors)

    def test_handshake_metadata_round_trips(self, worker):
        metadata = worker.get_handshake_metadata()
        if metadata is None:
            return
        assert isinstance(metadata, KVConnectorHandshakeMetadata)
        decoded = type(worker).handshake_metadata_cls.decode(metadata.encode())
        assert decoded == metadata

    def test_pp_aware_handshake(self, scheduler, worker):
        metadata = worker.get_handshake_metadata() or KVConnectorHandshakeMetadata()
        scheduler.set_xfer_handshake_metadata_pp_aware({(0, 0): metadata, (0, 1): metadata})
        overrides = (
            type(scheduler).set_xfer_handshake_metadata_pp_aware
            is not KVConnectorBase_V1.set_xfer_handshake_metadata_pp_aware
        )
        if overrides:
            scheduler.set_xfer_handshake_metadata_pp_aware({(0, 0): metadata, (1, 0): metadata})
        else:
            with pytest.raises(ValueError, match=PP_REJECTION):
                scheduler.set_xfer_handshake_metadata_pp_aware({(1, 0): metadata})

    def test_finished_count_and_stats(self, scheduler, worker):
        count = scheduler.get_finished_count()
        assert count is None or (isinstance(count, int) and count >= 1)
        stats = worker.get_kv_connector_stats()
        assert stats is None or isinstance(stats, KVConnectorStats)
        if stats is not None:
            assert all(isinstance(v, float) for v in stats.reduce().values())
        assert list(scheduler.take_events()) == []  # nothing happened, nothing to publish

    def test_what_a_host_reads(self, scheduler, worker):
        # Observing hooks: typed answers on the scheduler, nothing (not an error) on a worker.
        endpoint = scheduler.get_control_endpoint()
        assert endpoint is None or isinstance(endpoint, KVControlEndpoint)
        totals = scheduler.get_transfer_totals()
        assert totals is None or isinstance(totals, KVTransferTotals)
        assert worker.get_control_endpoint() is None
        assert worker.get_transfer_totals() is None

    def test_shutdown_is_idempotent(self, kv_transfer_config):
        for role in KVConnectorRole:
            connector = KVConnectorFactory.create_connector(kv_transfer_config, role)
            connector.shutdown()
            connector.shutdown()
