"""SGLang 0.5.23's bootstrap server, spoken by kvplan (kvplan/integrations/sglang/bootstrap.py).

SGLang's own ``MooncakeKVBootstrapServer`` runs on 127.0.0.1. kvplan's prefill ranks register with it,
and what the server then answers is read by SGLang's own decode-side types (``PrefillServerInfo``,
``PrefillRankInfo``) and by kvplan's lookups alike. Until every rank has registered, the server
answers 503, which kvplan reports as not ready; answers of the wrong shape are refused, naming the
field."""

import dataclasses
import json
import threading
import urllib.request
from http.server import BaseHTTPRequestHandler, HTTPServer

import pytest

from kvplan.errors import PeerError
from kvplan.integrations.sglang.bootstrap import BootstrapNotReady, RankRoute, prefill_layout, prefill_rank, register_rank
from tests.sglang_real import sglang_module

pytestmark = pytest.mark.sglang


def _route(tp_rank: int, tp: int = 2) -> RankRoute:
    return RankRoute(rank_ip="127.0.0.1", rank_port=17000 + tp_rank, page_size=64, kv_cache_dtype="bfloat16",
                     attn_tp_size=tp, attn_tp_rank=tp_rank, prefill_http_port=30000)


def test_sglang_s_decode_finds_kvplan_s_prefill_ranks(server):
    register_rank("127.0.0.1", server, _route(0))
    with pytest.raises(BootstrapNotReady, match="not fully registered"):
        prefill_layout("127.0.0.1", server)  # one of two ranks so far
    register_rank("127.0.0.1", server, _route(1))
    common = sglang_module("srt.disaggregation.common.conn")
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    with opener.open(f"http://127.0.0.1:{server}/route?prefill_dp_rank=-1&prefill_cp_rank=-1&target_tp_rank=-1"
                     "&target_pp_rank=-1", timeout=5) as answer:
        info = common.PrefillServerInfo(**json.loads(answer.read()))  # as SGLang's decode reads it
    assert (info.attn_tp_size, info.attn_cp_size, info.dp_size, info.pp_size) == (2, 1, 1, 1)
    assert (info.page_size, info.kv_cache_dtype, info.follow_bootstrap_room, info.prefill_http_port) == \
        (64, "bfloat16", True, 30000)
    for tp_rank in (0, 1):
        with opener.open(f"http://127.0.0.1:{server}/route?prefill_dp_rank=0&prefill_cp_rank=0"
                         f"&target_tp_rank={tp_rank}&target_pp_rank=0", timeout=5) as answer:
            rank = common.PrefillRankInfo(**json.loads(answer.read()))
        assert (rank.rank_ip, rank.rank_port) == ("127.0.0.1", 17000 + tp_rank)
        assert prefill_rank("127.0.0.1", server, tp_rank=tp_rank) == ("127.0.0.1", 17000 + tp_rank)
    layout = prefill_layout("127.0.0.1", server)
    assert dataclasses.asdict(layout) == {
        "attn_tp_size": 2, "attn_cp_size": 1, "dp_size": 1, "pp_size": 1, "page_size": 64,
        "kv_cache_dtype": "bfloat16", "follow_bootstrap_room": True, "enable_dsa_cache_layer_split": False,
        "enable_kv_cache_sharding": False, "kv_layout": None, "prefill_http_port": 30000,
        "decode_allocation_policy": "early"}
    with pytest.raises(PeerError, match="404"):
        prefill_rank("127.0.0.1", server, tp_rank=5)


def test_a_refused_registration_is_an_error(server):
    register_rank("127.0.0.1", server, _route(0))
    with pytest.raises(PeerError, match="400"):  # another allocation policy than the first rank's
        register_rank("127.0.0.1", server, dataclasses.replace(_route(1), decode_allocation_policy="late"))


class _Answers(BaseHTTPRequestHandler):
    body = b"{}"

    def do_GET(self):  # noqa: N802 (http.server's name)
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.end_headers()
        self.wfile.write(self.body)

    def log_message(self, *args):
        pass


@pytest.mark.parametrize("body, field", [
    ({"rank_ip": "127.0.0.1"}, "rank_port"),
    ({"rank_ip": "127.0.0.1", "rank_port": "x"}, "rank_port"),
    ({"rank_ip": 7, "rank_port": 17000}, "rank_ip"),
    ({"rank_ip": "127.0.0.1", "rank_port": 70000}, "rank_port"),
    ([1, 2], "not a JSON object"),
])
def test_a_malformed_answer_is_refused_naming_the_field(body, field):
    handler = type("Handler", (_Answers,), {"body": json.dumps(body).encode()})
    httpd = HTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        with pytest.raises(PeerError, match=field):
            prefill_rank("127.0.0.1", httpd.server_address[1], tp_rank=0)
    finally:
        httpd.shutdown()
        thread.join(timeout=5)
        httpd.server_close()
