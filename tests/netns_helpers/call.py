"""One call from inside a test host, its answer printed as one JSON line (see
`services.http_call` and `services.generate_on`):

* ``http METHOD URL [--body JSON]``: ``{"status": 200, "body": ...}``, the body parsed as JSON
  when it is JSON, else its text (``/metrics``); status 0 when no HTTP answer came (the body
  then holds the exception's text). ``$NETNS_CALL_TOKEN``, when set, is sent as
  ``Authorization: Bearer`` (an environment variable: not in the process list).
* ``generate TARGET PROMPT MAX_TOKENS [--request-id ID] [--params JSON]``: a daemon's
  Generation service called directly (no router; ``--params``: its ``kv_transfer_params``):
  ``{"token_ids": [...], "finish_reason": ..., "error": ..., "num_prompt_tokens": N,
  "kv_transfer_params": {...}, "elapsed_s": S}`` (``elapsed_s``: the call alone, greedy).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import urllib.error
import urllib.request
from typing import Any

TOKEN_ENV = "NETNS_CALL_TOKEN"


def http(method: str, url: str, body: str | None, token: str | None) -> dict[str, Any]:
    headers = {"Content-Type": "application/json"}
    if token is not None:
        headers["Authorization"] = f"Bearer {token}"
    data = body.encode() if body is not None else None
    request = urllib.request.Request(url, data=data, headers=headers, method=method)
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return {"status": response.status, "body": _decode(response.read())}
    except urllib.error.HTTPError as exc:
        return {"status": exc.code, "body": _decode(exc.read())}
    except Exception as exc:
        return {"status": 0, "body": f"{type(exc).__name__}: {exc}"}


def _decode(raw: bytes) -> Any:
    try:
        return json.loads(raw)
    except ValueError:
        return raw.decode(errors="replace")


def generate(
    target: str,
    prompt: str,
    max_tokens: int,
    request_id: str = "direct",
    params: dict[str, Any] | None = None,
) -> dict[str, Any]:
    # Imported here: the http call stays stdlib-only (fast to start).
    import time

    from kvtransfer.clients.generation import GenerationClient, generate_request

    message = generate_request(
        request_id, prompt, max_tokens, temperature=0.0, kv_transfer_params=params
    )
    with GenerationClient(target) as client:
        started = time.monotonic()
        result = client.generate(message, timeout_s=60.0)
        elapsed_s = time.monotonic() - started
    return {
        "token_ids": list(result.token_ids),
        "finish_reason": result.finish_reason,
        "error": result.error,
        "num_prompt_tokens": result.num_prompt_tokens,
        "kv_transfer_params": dict(result.kv_transfer_params or {}),
        "elapsed_s": elapsed_s,
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    commands = parser.add_subparsers(dest="command", required=True)
    http_parser = commands.add_parser("http")
    http_parser.add_argument("method")
    http_parser.add_argument("url")
    http_parser.add_argument("--body")
    generate_parser = commands.add_parser("generate")
    generate_parser.add_argument("target")
    generate_parser.add_argument("prompt")
    generate_parser.add_argument("max_tokens", type=int)
    generate_parser.add_argument("--request-id", default="direct")
    generate_parser.add_argument("--params")
    args = parser.parse_args()
    if args.command == "http":
        answer = http(args.method, args.url, args.body, os.environ.get(TOKEN_ENV))
    else:
        params = None if args.params is None else json.loads(args.params)
        answer = generate(args.target, args.prompt, args.max_tokens, args.request_id, params)
    json.dump(answer, sys.stdout)
    print()


if __name__ == "__main__":
    main()
