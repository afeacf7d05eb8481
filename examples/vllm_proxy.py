"""A proxy in front of vLLM prefill and decode engines that run kvplan's connector (docs/vllm.md, "Deploying").

Each OpenAI completion or chat request goes first to a prefill engine, with ``max_tokens: 1`` and
``kv_transfer_params: {"do_remote_decode": true}``: the prefill computes the prompt's KV and keeps its
blocks. The ``kv_transfer_params`` its answer carries (its blocks, engine id, and where its workers
listen) then go with the original request to a decode engine, whose connector has kvplan move the
blocks before it generates. Several prefills and decodes are taken in turn. Standard library only: this
shows the protocol; a production router adds retries, health checks and load-aware choice.

Run::

    python examples/vllm_proxy.py --prefill http://10.0.0.3:8100 --decode http://10.0.0.4:8200 --port 8000
    curl http://127.0.0.1:8000/v1/completions -H 'Content-Type: application/json' \\
        -d '{"model": "MODEL", "prompt": "Hello", "max_tokens": 32}'
"""

from __future__ import annotations

import argparse
import itertools
import json
import logging
import threading
import urllib.error
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Iterator

log = logging.getLogger("vllm_proxy")

ROUTES = ("/v1/completions", "/v1/chat/completions")


class Upstreams:
    """The prefill and decode engines' base URLs, each list taken in turn (thread-safe)."""

    def __init__(self, prefills: list[str], decodes: list[str]):
        self._prefills, self._decodes = itertools.cycle(prefills), itertools.cycle(decodes)
        self._lock = threading.Lock()

    def next(self) -> tuple[str, str]:
        with self._lock:
            return next(self._prefills), next(self._decodes)


def prefill_request(body: dict[str, Any]) -> dict[str, Any]:
    """What the prefill engine is asked: the same request, one token, no stream, and the connector told
    that a decode engine continues it."""
    asked = dict(body, max_tokens=1, stream=False, kv_transfer_params={"do_remote_decode": True})
    asked.pop("stream_options", None)
    asked.pop("min_tokens", None)
    if "max_completion_tokens" in asked:
        asked["max_completion_tokens"] = 1
    return asked


def decode_request(body: dict[str, Any], prefill_answer: dict[str, Any]) -> dict[str, Any]:
    """What the decode engine is asked: the original request with the prefill's ``kv_transfer_params``."""
    params = prefill_answer.get("kv_transfer_params")
    if not isinstance(params, dict):
        raise ValueError("the prefill's answer has no kv_transfer_params: is its connector kvplan's, kv_role "
                         "kv_producer or kv_both?")
    return dict(body, kv_transfer_params=params)


def _post(url: str, body: dict[str, Any], headers: dict[str, str], timeout: float):
    request = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                     headers={**headers, "Content-Type": "application/json"})
    return urllib.request.urlopen(request, timeout=timeout)  # noqa: S310 - the operator's own engines


class ProxyHandler(BaseHTTPRequestHandler):
    upstreams: Upstreams
    timeout_s: float = 600.0

    def do_POST(self) -> None:  # noqa: N802 - http.server's name
        if self.path not in ROUTES:
            self._answer(404, {"error": f"no route {self.path}; this proxy serves {list(ROUTES)}"})
            return
        try:
            body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")
        except json.JSONDecodeError as err:
            self._answer(400, {"error": f"the request is not JSON: {err}"})
            return
        headers = {k: v for k, v in self.headers.items() if k.lower() in ("authorization", "x-request-id")}
        prefill, decode = self.upstreams.next()
        try:
            with _post(prefill + self.path, prefill_request(body), headers, self.timeout_s) as answer:
                forward = decode_request(body, json.loads(answer.read()))
            with _post(decode + self.path, forward, headers, self.timeout_s) as answer:
                self.send_response(answer.status)
                self.send_header("Content-Type", answer.headers.get("Content-Type", "application/json"))
                self.end_headers()
                for chunk in _chunks(answer):  # (a streamed answer passes through as it comes)
                    self.wfile.write(chunk)
                    self.wfile.flush()
        except urllib.error.HTTPError as err:
            self._answer(err.code, {"error": f"{err.url}: {err.read().decode(errors='replace')[:2000]}"})
        except (urllib.error.URLError, OSError, ValueError) as err:
            self._answer(502, {"error": f"{type(err).__name__}: {err}"})

    def _answer(self, status: int, body: dict[str, Any]) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - http.server's signature
        log.info("%s %s", self.address_string(), format % args)


def _chunks(answer, size: int = 1 << 14) -> Iterator[bytes]:
    while chunk := answer.read1(size) if hasattr(answer, "read1") else answer.read(size):
        yield chunk


def serve(host: str, port: int, prefills: list[str], decodes: list[str], timeout_s: float = 600.0) -> ThreadingHTTPServer:
    """The proxy's server, bound (``port`` 0: a free one, in ``server.server_port``); call ``serve_forever``."""
    handler = type("Handler", (ProxyHandler,), {"upstreams": Upstreams(prefills, decodes), "timeout_s": timeout_s})
    return ThreadingHTTPServer((host, port), handler)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prefill", action="append", required=True, help="a prefill engine's base URL (repeatable)")
    parser.add_argument("--decode", action="append", required=True, help="a decode engine's base URL (repeatable)")
    parser.add_argument("--host", default="127.0.0.1", help="the address the proxy binds (default: 127.0.0.1)")
    parser.add_argument("--port", type=int, default=8000, help="the port the proxy listens at (default: 8000)")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds each engine may take to answer")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    server = serve(args.host, args.port, args.prefill, args.decode, args.timeout)
    log.info("proxy at http://%s:%d: prefills %s, decodes %s", args.host, server.server_port, args.prefill, args.decode)
    server.serve_forever()


if __name__ == "__main__":
    main()
