"""The HTTP calls to vLLM servers: one request id on both calls, the servers' own API key, the
request's deadline; a call that gets no answer ejects the instance."""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

import aiohttp
import grpc

from kvtransfer.router.config import RouterConfig
from kvtransfer.router.errors import UpstreamError
from kvtransfer.router.fleet.fleet import Fleet
from kvtransfer.router.fleet.instance import Instance
from kvtransfer.router.vllm_flow.answers import endpoint_of, read_bounded
from kvtransfer.router.vllm_flow.failures import deadline_error
from kvtransfer.router.vllm_flow.request import VllmCall

REQUEST_ID_HEADER = "X-Request-Id"


class VllmCalls:
    """Calls the instances of ``fleet`` (whose channels are `VllmEndpoint` s)."""

    def __init__(self, config: RouterConfig, fleet: Fleet) -> None:
        self.config = config
        self.fleet = fleet

    async def prefill(
        self, call: VllmCall, instance: Instance, body: dict[str, Any]
    ) -> tuple[int, bytes, Mapping[str, str]]:
        """The prefill's status, body (at most ``max_request_bytes``: its params go into the
        decode's body) and headers."""
        endpoint = endpoint_of(instance)
        try:
            async with endpoint.session.post(
                endpoint.url(call.path),
                json=body,
                headers=self.headers(call),
                timeout=self.timeout(call),
                allow_redirects=False,
            ) as response:
                raw = await read_bounded(response, instance, self.config.max_request_bytes)
                return response.status, raw, response.headers
        except TimeoutError:  # an OSError too: first
            raise self._silent(instance) from None
        except (aiohttp.ClientError, OSError) as exc:
            raise self._unreachable(instance, exc) from None

    async def decode(
        self, call: VllmCall, instance: Instance, body: dict[str, Any]
    ) -> aiohttp.ClientResponse:
        """The decode's response, its body still to read (the caller enters it)."""
        endpoint = endpoint_of(instance)
        try:
            return await endpoint.session.post(
                endpoint.url(call.path),
                json=body,
                headers=self.headers(call),
                timeout=self.timeout(call),
                allow_redirects=False,
            )
        except TimeoutError:  # an OSError too: first
            raise self._silent(instance) from None
        except (aiohttp.ClientError, OSError) as exc:
            raise self._unreachable(instance, exc) from None

    def headers(self, call: VllmCall) -> dict[str, str]:
        """One request id on both calls; the servers' own API key, never the client's."""
        headers = {REQUEST_ID_HEADER: call.request_id}
        if self.config.vllm_api_key is not None:
            headers["Authorization"] = f"Bearer {self.config.vllm_api_key}"
        return headers

    def timeout(self, call: VllmCall) -> aiohttp.ClientTimeout:
        return aiohttp.ClientTimeout(total=max(0.001, call.deadline - time.monotonic()))

    def _silent(self, instance: Instance) -> UpstreamError:
        """Nothing came back within the request's deadline: as for a daemon (`fleet`), the
        instance leaves the pool until a health check finds it serving, so a wedged server is
        not picked again meanwhile."""
        self.fleet.eject(instance, grpc.StatusCode.DEADLINE_EXCEEDED, "no answer in time")
        return deadline_error(instance)

    def _unreachable(self, instance: Instance, exc: BaseException) -> UpstreamError:
        """No answer at all: the instance leaves the pool until a health check finds it."""
        detail = str(exc) or type(exc).__name__
        self.fleet.eject(instance, grpc.StatusCode.UNAVAILABLE, detail)
        instance.failed()
        return UpstreamError(503, f"unreachable: {detail}", instance.role, instance.address)
