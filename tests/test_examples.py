"""The scripts in examples/ run as a user would run them."""

import os
import pathlib
import subprocess
import sys

import pytest

EXAMPLES = pathlib.Path(__file__).resolve().parents[1] / "examples"


def run(name: str) -> str:
    done = subprocess.run([sys.executable, str(EXAMPLES / name)], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


def test_plan_a_batch():
    assert "equal to the reference" in run("plan_a_batch.py")


@pytest.mark.engines
def test_handoff_in_process():
    assert "every byte matches" in run("handoff_in_process.py")


@pytest.mark.engines
@pytest.mark.sglang
def test_sglang_integration():
    """Run as an SGLang deployment would, with SGLang 0.5.23 importable (tests/sglang_real.py)."""
    pytest.importorskip("sglang")
    script = EXAMPLES / "sglang_integration.py"
    # the command its docstring prints for the CPU environment of make setup-sglang
    done = subprocess.run([sys.executable, "-m", "tests.sglang_real", str(script.relative_to(EXAMPLES.parent))],
                          capture_output=True, text=True, timeout=600, cwd=EXAMPLES.parent,
                          env={**os.environ, "UCX_NET_DEVICES": "lo", "TRITON_INTERPRET": "1"})
    assert done.returncode == 0, done.stdout + done.stderr
    assert "every byte matches" in done.stdout, done.stdout


def _fake_engine(answer):
    """An HTTP server on 127.0.0.1 standing in for a vLLM engine: records each request's path and body,
    answers ``answer(body)`` as JSON."""
    import json
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    seen = []

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            seen.append((self.path, body))
            data = json.dumps(answer(body)).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, f"http://127.0.0.1:{server.server_port}", seen


def test_the_vllm_proxy_sends_a_request_to_a_prefill_then_its_kv_transfer_params_to_a_decode():
    import json
    import threading
    import urllib.error
    import urllib.request

    sys.path.insert(0, str(EXAMPLES))
    try:
        import vllm_proxy
    finally:
        sys.path.remove(str(EXAMPLES))
    params = {"do_remote_prefill": True, "remote_block_ids": [[3, 4]], "remote_engine_id": "p0",
              "remote_host": "127.0.0.1", "remote_port": 17500}
    prefill, prefill_url, prefill_seen = _fake_engine(lambda body: {"choices": [{"text": "x"}], "kv_transfer_params": params})
    decodes = [_fake_engine(lambda body, n=n: {"choices": [{"text": f"decoded by {n}"}]}) for n in range(2)]
    bare, bare_url, _ = _fake_engine(lambda body: {"choices": [{"text": "x"}]})  # (a prefill without kvplan)
    proxy = vllm_proxy.serve("127.0.0.1", 0, [prefill_url], [url for _, url, _ in decodes], timeout_s=10)
    threading.Thread(target=proxy.serve_forever, daemon=True).start()
    try:
        def post(path, body, port=proxy.server_port):
            request = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=json.dumps(body).encode(),
                                             headers={"Content-Type": "application/json"}, method="POST")
            try:
                with urllib.request.urlopen(request, timeout=10) as answer:
                    return answer.status, json.loads(answer.read())
            except urllib.error.HTTPError as err:
                return err.code, json.loads(err.read())

        asked = {"model": "m", "prompt": "hello", "max_tokens": 32, "stream": False}
        assert post("/v1/completions", asked) == (200, {"choices": [{"text": "decoded by 0"}]})
        assert post("/v1/chat/completions", dict(asked, max_completion_tokens=32)) == \
            (200, {"choices": [{"text": "decoded by 1"}]})
        (path, first), (_, second) = prefill_seen
        assert path == "/v1/completions" and first["max_tokens"] == 1 and first["stream"] is False
        assert first["kv_transfer_params"] == {"do_remote_decode": True} and first["prompt"] == "hello"
        assert second["max_completion_tokens"] == 1
        assert decodes[0][2] == [("/v1/completions", dict(asked, kv_transfer_params=params))]
        assert decodes[1][2][0][0] == "/v1/chat/completions" and decodes[1][2][0][1]["max_completion_tokens"] == 32
        assert post("/v1/embeddings", asked)[0] == 404
        no_params = vllm_proxy.serve("127.0.0.1", 0, [bare_url], [decodes[0][1]], timeout_s=10)
        threading.Thread(target=no_params.serve_forever, daemon=True).start()
        status, body = post("/v1/completions", asked, port=no_params.server_port)
        assert status == 502 and "no kv_transfer_params" in body["error"], body
        no_params.shutdown()
    finally:
        proxy.shutdown()
        for server in (prefill, bare, *(s for s, _, _ in decodes)):
            server.shutdown()
