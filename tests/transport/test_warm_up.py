"""The warm start on the CPU: what ``warm_up`` does that can be seen without a GPU
(the connection opened by a write into each new decode's staging share, once, of as much as both
staging buffers hold, and nothing else of the decode's touched), and that a batch after it still lands. Its GPU side (planners
captured, kernels compiled: the first batch within 2x of a steady one) is measured in
benchmarks/RESULTS.md and tests/planner/device/test_graphs.py. Real Mooncake (TCP), both endpoints in
a child process of its own (tests.isolated: in pytest's process, after the rest of a full run, its bound
control channel twice never saw its in-process peer connect; the cause is not located)."""

import logging
import uuid

import pytest
import torch

from kvplan.planner.device.destinations import PreallocatedRequest
from kvplan.tools.load import Arrival, LoadConfig
from kvplan.tools.load_pools import Pools
from kvplan.transport.control import ControlChannel
from tests.transport.pairing import pair
from kvplan.transport.endpoints import Chunk, DecodeEndpoint, PrefillEndpoint
from kvplan.transport.engines import make_engine
from tests.isolated import run_isolated

pytestmark = pytest.mark.engines

CONFIG = LoadConfig(layers=2, token_bytes=32, prompt_max=256, rows=4, device="cpu")


def test_warm_up_opens_each_new_connection_once_and_a_batch_after_it_lands():
    pytest.importorskip("mooncake.engine")
    run_isolated(_warm_up_then_a_batch, timeout=120)


def _warm_up_then_a_batch() -> None:
    src, dst = Pools(CONFIG, "cpu", CONFIG.rows), Pools(CONFIG, "cpu", CONFIG.rows)
    name = uuid.uuid4().hex[:8]
    channel = ControlChannel(host="127.0.0.1")
    decode_staging, prefill_staging = torch.zeros(8192, dtype=torch.uint8), torch.zeros(4096, dtype=torch.uint8)
    decode = DecodeEndpoint(dst.side, make_engine("mooncake", f"decode-{name}", local_hostname="127.0.0.1"), channel,
                            decode_staging)
    prefill = PrefillEndpoint(src.side, make_engine("mooncake", f"prefill-{name}", local_hostname="127.0.0.1"),
                              ControlChannel(channel.port, host="127.0.0.1"), prefill_staging)
    try:
        pair([lambda: decode.register(timeout=10)], [lambda: prefill.accept(timeout=10)])
        assert set(decode.warm_up(timeout=10)) == {"pairing"}  # (a CPU staging buffer: nothing compiled or captured)
        with pytest.raises(ValueError, match="at least one transfer"):
            prefill.warm_up(max_transfers=0)
        pattern = torch.arange(4096, dtype=torch.int64).remainder(251).add(1).to(torch.uint8)
        prefill_staging.copy_(pattern)
        took = prefill.warm_up(max_transfers=8, max_prompt_len=256, timeout=10)
        assert set(took) == {"kernels", "planners", "connections"}
        assert torch.equal(decode_staging[:4096], pattern)  # the write that opened the connection: all the prefill holds
        assert not decode_staging[4096:].any()  # and nothing else
        dropped = _Warnings()
        logging.getLogger("kvplan").addHandler(dropped)
        for _ in range(20):  # the write's notification reaches the decode, which drops it as a warm-up's
            decode.poll()
        logging.getLogger("kvplan").removeHandler(dropped)
        assert not dropped.messages, dropped.messages
        prefill_staging.fill_(0xEE)
        prefill.warm_up(max_transfers=8, max_prompt_len=256, timeout=10)  # again: a run may be in that share now
        assert torch.equal(decode_staging[:4096], pattern)

        a = Arrival(0, "after-warm-up", 0.0, 200, 0, 0, None)
        s_row, d_row = src.take(a.prompt_len)[0], dst.take(a.prompt_len)[0]
        dst.flush()
        decode.publish([PreallocatedRequest(a.request, d_row, a.prompt_len, 0, aux_index=d_row)], timeout=30)
        prefill.receive_requests(1, timeout=10)
        src.write(a, s_row, 0, a.prompt_len)
        src.aux[s_row] = a.index % 251 + 1  # (what check() expects of the aux row)
        chunk = Chunk(a.request, s_row, 0, a.prompt_len + 1, a.prompt_len, True, s_row)
        assert prefill.send([prefill.transfer(chunk)], mode="direct", timeout=30) == {a.request: None}
        assert decode.wait() == {a.request: "complete"}
        assert dst.check(a, d_row)
    finally:
        for closing in (decode.engine, prefill.engine, channel, prefill.channel):
            closing.close()


class _Warnings(logging.Handler):
    """The warnings kvplan logs while attached."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the destination-list kernels load on a GPU")
def test_a_decode_warm_up_loads_the_list_kernels_and_publishes_or_tracks_nothing():
    from kvplan.planner.contract.batch import Attention, Entry, KVLayout, SideMemory
    from tests.planner.builders import table_with
    from tests.transport.fakes import FakeChannel, FakeEngine

    pool = torch.zeros(16 * 256, dtype=torch.uint8, device="cuda")
    table = torch.from_numpy(table_with({0: [3, 4]}, 4, max_ctx=16)).cuda()
    side = SideMemory(KVLayout(Attention.MLA, 4, (Entry(pool.data_ptr(), 256, 16),)), req_to_token=table)
    mine, theirs = FakeChannel.pair()
    decode = DecodeEndpoint(side, FakeEngine(), mine)
    assert set(decode.warm_up(timeout=1)) == {"lists"}
    assert len(decode.tracker) == 0 and theirs.try_recv() is None
