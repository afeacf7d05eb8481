"""The ``ipc`` engine's device path between two processes on one GPU: CUDA IPC handles of the
receiver's allocations, one launch of the translate-and-check and copy kernels over device descriptors,
the notifications after the launch's event. GPU tests: skipped without CUDA (the GPU suite runs them,
``python -m benchmarks ipc``)."""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch

from kvplan.tools.target_process import target_process
from kvplan.transport.engines import make_engine, wait_all
from tests.transport.one_write import serve

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA IPC needs a GPU")
SIZE = 8 << 20


def _receiver(conn) -> None:
    engine = make_engine("ipc", "gpu-receiver", "VRAM", 0)
    first = torch.zeros(SIZE, dtype=torch.uint8, device="cuda")
    second = torch.zeros(SIZE, dtype=torch.uint8, device="cuda")
    # a region inside each allocation, not at its start (the handle names the allocation; the offset travels)
    engine.register([(first.data_ptr() + 4096, SIZE - 8192), (second.data_ptr(), SIZE // 2)])
    conn.send((engine.metadata(), first.data_ptr(), second.data_ptr()))

    def snapshot():
        torch.cuda.synchronize()
        return first.cpu().numpy(), second.cpu().numpy()

    serve(conn, engine, snapshot, notes_wanted=2)


def test_one_launch_writes_another_process_s_gpu_memory_byte_for_byte_and_refuses_what_is_outside():
    with target_process(_receiver) as (conn, (metadata, first, second)):
        engine = make_engine("ipc", "gpu-sender", "VRAM", 0)
        src = torch.randint(0, 256, (SIZE,), dtype=torch.uint8, device="cuda")
        engine.register([(src.data_ptr(), SIZE)])
        peer = engine.connect(metadata)
        rng = np.random.default_rng()
        pages = rng.permutation(np.arange(1, (SIZE - 8192) // 4096))[:300]  # fragmented pages of the first region
        rows = [(src.data_ptr() + k * 4096, first + 4096 + int(p) * 4096, 4096) for k, p in enumerate(pages)]
        rows += [(src.data_ptr() + 7, second + 100, 1000)]                         # unaligned, in the second
        rows += [(src.data_ptr(), second + SIZE // 2 - 16, 64)]                    # past the second region's end
        descs = torch.tensor(rows, dtype=torch.int64, device="cuda")
        handles = engine.post_device(peer, descs, [b"kv", b"aux", b"bad"],
                                     [(0, 300), (300, 301), (301, 302)], alignment=1, typical_bytes=4096)
        outcome = wait_all(engine, handles, time.monotonic() + 30)
        assert outcome[handles[0]] is None and outcome[handles[1]] is None, outcome
        assert "outside the regions" in outcome[handles[2]]
        conn.send("notes")
        assert sorted(note for _, note in conn.recv()) == [b"aux", b"kv"]
        conn.send("bytes")
        got_first, got_second = conn.recv()
        want_first = np.zeros(SIZE, np.uint8)
        host = src.cpu().numpy()
        for k, p in enumerate(pages):
            want_first[4096 + int(p) * 4096 : 4096 + int(p) * 4096 + 4096] = host[k * 4096 : (k + 1) * 4096]
        np.testing.assert_array_equal(got_first, want_first)
        want_second = np.zeros(SIZE, np.uint8)
        want_second[100:1100] = host[7:1007]
        np.testing.assert_array_equal(got_second, want_second)  # (nothing of the refused descriptor)
        engine.disconnect(peer)  # every launch has ended: its mappings close
        assert engine.stats()["handles"] == 0
        engine.close()
