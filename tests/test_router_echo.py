"""What the router's messages repeat of others' text: an error quoting a client's field quotes
at most `echo.ECHO_CHARS` of it (an 8 MiB model name is not answered, logged and shown with
8 MiB), and an instance's address is a host of hostname or IP characters, of a hostname's
length at most, or it is refused with a typed error naming what is wrong (flags, config and the
admin API alike)."""

from __future__ import annotations

import asyncio
import json
import re
from typing import Any

import pytest
from aiohttp.test_utils import make_mocked_request

from kvtransfer.router.config import (
    MAX_HOST_CHARS,
    InvalidAddress,
    RouterConfig,
    check_address,
    check_target,
    parse_dns,
)
from kvtransfer.router.echo import ECHO_CHARS, clipped, echo
from kvtransfer.router.openai.requests import (
    InvalidRequest,
    parse_chat_request,
    parse_json_body,
)
from kvtransfer.router.web.admin_api import AdminApi

pytestmark = pytest.mark.unit

HOSTILE = "<img src=x onerror=alert(1)>"
HUGE = "x" * (8 << 20)
QUOTED_HUGE = "'" + "x" * ECHO_CHARS + "'…"


def test_echo_quotes_at_most_its_limit():
    assert echo("gpt-9") == "'gpt-9'"
    assert echo(HUGE) == QUOTED_HUGE
    assert echo(None) == "None"
    assert echo(["a", ["b", ["c"]]]) == "['a', ['b', [...]]]"
    assert echo(list(range(1000))) == "[0, 1, 2, 3, ...]"
    assert echo({"k": HUGE}).endswith("…") and len(echo({"k": HUGE})) == ECHO_CHARS + 1
    assert clipped("abc", 3) == "abc"
    assert clipped("abcd", 3) == "abc…"
    with pytest.raises(ValueError, match=re.escape("limit must be >= 0, got -1")):
        clipped("abc", -1)


def chat_refusal(body: dict[str, Any]) -> str:
    with pytest.raises(InvalidRequest) as refused:
        parse_chat_request(body)
    return str(refused.value)


def test_request_errors_quote_the_clients_fields_cut():
    user = {"role": "user", "content": "hi"}
    assert chat_refusal({"messages": [user], "response_format": {"type": HUGE}}) == (
        f"response_format: type {QUOTED_HUGE} is not supported (only 'text')"
    )
    assert chat_refusal({"messages": [user], "response_format": {"type": "json_object"}}) == (
        "response_format: type 'json_object' is not supported (only 'text')"
    )
    assert chat_refusal({"messages": [{"role": HUGE, "content": "hi"}]}) == (
        f"messages[0].role: must be one of assistant, developer, system, user, got {QUOTED_HUGE}"
    )
    parts = [{"type": HUGE, "image_url": "x"}]
    assert chat_refusal({"messages": [{"role": "user", "content": parts}]}) == (
        "messages[0].content[0]: only text parts are supported (text-only model), "
        f"got type {QUOTED_HUGE}"
    )
    # A lone surrogate under a huge key: the path names it cut.
    with pytest.raises(InvalidRequest) as refused:
        parse_json_body(json.dumps({"user": {HUGE: "\ud800"}}).encode())
    assert str(refused.value) == (
        f"user.{'x' * (ECHO_CHARS - 5)}…: a string holds a lone surrogate (\\ud800), which is "
        "not valid Unicode"
    )


# ---------------------------------------------------------------------- addresses


@pytest.mark.parametrize(
    "address",
    ["127.0.0.1:5", "[::1]:5", "[fe80::1%eth0]:50051", "decode-0.svc_a.local:65535", "h:1"],
)
def test_good_addresses_pass_unchanged(address: str):
    assert check_address(address) == address
    assert check_target(address) == address


@pytest.mark.parametrize(
    ("address", "message"),
    [
        ("nohost", "'nohost' is not HOST:PORT"),
        ("h:0", "'h:0' is not HOST:PORT"),
        ("h:65536", "'h:65536' is not HOST:PORT"),
        ("h:²", "'h:²' is not HOST:PORT"),
        ("h:" + "9" * 5000, f"{echo('h:' + '9' * 5000)} is not HOST:PORT"),
        (
            f"{HOSTILE}:80",
            f"'{HOSTILE}:80' is not HOST:PORT: its host may hold only letters, digits, '.', "
            "'-' and '_', or be an IPv6 address in brackets",
        ),
        (
            "::1:80",
            "'::1:80' is not HOST:PORT: its host may hold only letters, digits, '.', '-' and "
            "'_', or be an IPv6 address in brackets",
        ),
        ("[zz]:80", "'[zz]:80' is not HOST:PORT: its host in brackets is not an IPv6 address"),
        (
            "a" * (MAX_HOST_CHARS + 1) + ":80",
            f"{echo('a' * 254 + ':80')} is not HOST:PORT: its host is 254 characters long, "
            "over 253",
        ),
        (
            f"{HUGE}:80",
            f"{QUOTED_HUGE} is not HOST:PORT: its host is {len(HUGE)} characters long, over 253",
        ),
    ],
)
def test_bad_addresses_are_refused_naming_the_problem(address: str, message: str):
    with pytest.raises(InvalidAddress) as refused:
        check_address(address)
    assert str(refused.value) == message
    as_target = message.replace("is not HOST:PORT", "is not HOST:PORT or dns:NAME:PORT")
    with pytest.raises(InvalidAddress) as refused:
        check_target(address)
    assert str(refused.value) == as_target
    with pytest.raises(InvalidAddress, match=re.escape(as_target)):
        RouterConfig(prefill=(address,), decode=("h:1",))


def test_dns_names_are_hostnames():
    assert parse_dns("dns:decode.svc.cluster.local:50051") == ("decode.svc.cluster.local", 50051)
    for target, message in [
        ("dns:svc", "'dns:svc' is not dns:NAME:PORT"),
        (
            f"dns:{HOSTILE}:5",
            f"'dns:{HOSTILE}:5' is not dns:NAME:PORT: its name may hold only letters, digits, "
            "'.', '-' and '_'",
        ),
        (
            "dns:" + "a" * 300 + ":5",
            f"{echo('dns:' + 'a' * 300 + ':5')} is not dns:NAME:PORT: its name is 300 "
            "characters long, over 253",
        ),
    ]:
        with pytest.raises(InvalidAddress) as refused:
            check_target(target)
        assert str(refused.value) == message


class Body:
    """A request body as aiohttp's request reads it (``make_mocked_request`` has none)."""

    def __init__(self, raw: bytes) -> None:
        self._raw = raw

    def set_read_chunk_size(self, size: int) -> None:
        pass

    async def readany(self) -> bytes:
        raw, self._raw = self._raw, b""
        return raw


def test_the_admin_api_answers_an_address_problem_400():
    def no_fleet() -> Any:
        raise AssertionError("a refused body reaches no fleet")

    api = AdminApi("t0ken", no_fleet)

    async def add(body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        request = make_mocked_request(
            "POST",
            "/workers",
            headers={"Authorization": "Bearer t0ken"},
            client_max_size=64 << 20,
            payload=Body(json.dumps(body).encode()),
        )
        response = await api.add_worker(request)
        assert isinstance(response.body, bytes)
        return response.status, json.loads(response.body)["error"]

    async def scenario() -> list[tuple[int, dict[str, Any]]]:
        return [
            await add({"address": f"{HOSTILE}:80", "role": "prefill"}),
            await add({"address": f"{HUGE}:80", "role": "decode"}),
            await add({"address": "h:1", "role": HUGE}),
            await add({"address": "h:1", "role": "decode", HUGE: 1}),
        ]

    hostile, huge, role, unknown = asyncio.run(scenario())
    assert hostile == (
        400,
        {
            "message": f"address: '{HOSTILE}:80' is not HOST:PORT: its host may hold only "
            "letters, digits, '.', '-' and '_', or be an IPv6 address in brackets",
            "type": "invalid_request_error",
            "param": "address",
            "code": None,
        },
    )
    assert huge[1]["message"] == (
        f"address: {QUOTED_HUGE} is not HOST:PORT: its host is {len(HUGE)} characters long, "
        "over 253"
    )
    assert role[1]["message"] == (
        f"role: must be 'prefill', 'decode' or 'aggregated', got {QUOTED_HUGE}"
    )
    assert len(unknown[1]["message"]) < 300 and len(unknown[1]["param"]) == ECHO_CHARS + 1
