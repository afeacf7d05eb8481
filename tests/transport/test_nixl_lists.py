"""NIXL's prepared lists in the strided form: one ``[n, 5]`` row per entry, numbered
by NIXL as the expanded ``[n, 3]`` list, so the planner's prepared indices (``e * slots + s``) name the
same bytes either way; a real NIXL (the CPU wheel of ``make test``) moves the same bytes through both."""

from __future__ import annotations

import os
import time
import uuid

import numpy as np
import pytest
import torch

from kvplan.transport.engines.nixl import NixlEngine, expanded_rows, nixl_api, strided_rows, takes_strided_lists

os.environ.setdefault("UCX_NET_DEVICES", "lo")
os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")


def _expand(rows: np.ndarray) -> np.ndarray:
    """The ``[n, 3]`` list a strided ``[n, 5]`` list stands for (NIXL's documented meaning)."""
    out = [(addr + k * stride, size, device) for addr, size, device, stride, count in rows.tolist()
           for k in range(count)]
    return np.array(out, dtype=np.uint64).reshape(-1, 3)


@pytest.mark.parametrize("sliced", [False, True])
def test_a_strided_list_stands_for_the_expanded_one_row_for_row(sliced):
    """Whole items, or a part of each (``nbytes``: a head slice of each page)."""
    rng = np.random.default_rng(5)
    items = np.stack([rng.integers(1, 1 << 40, 7) * 64, rng.integers(1, 64, 7) * 16, rng.integers(1, 50, 7)],
                     axis=1).astype(np.uint64)
    if sliced:
        items = np.concatenate([items, items[:, 1:2] // np.uint64(2)], axis=1)
    strided = strided_rows(items, device=3)
    assert strided.shape == (7, 5)
    expanded = expanded_rows(items, device=3)
    assert np.array_equal(_expand(strided), expanded)
    assert np.array_equal(np.unique(expanded[:, 1]), np.unique(items[:, 3 if sliced else 1]))


@pytest.mark.engines
@pytest.mark.parametrize("sliced", [False, True])
def test_a_prepared_write_moves_the_same_bytes_through_either_form(sliced):
    """Whole items, or the middle half of each (a list of head slices, one per page)."""
    pytest.importorskip("zmq")
    try:
        agent_class = nixl_api()[0]
    except ImportError:
        pytest.skip("no NIXL package")
    assert takes_strided_lists(agent_class), "the installed NIXL (1.5) documents the strided form"
    entries, slots, item = 6, 40, 64
    src = torch.arange(entries * slots * item, dtype=torch.int64).remainder(251).to(torch.uint8)
    picked = np.random.default_rng(9).choice(entries * slots, 50, replace=False).astype(np.int32)
    landed = {}
    for strided in (True, False):
        dst = torch.zeros_like(src)
        name = uuid.uuid4().hex[:6]
        sender, receiver = NixlEngine(f"s-{name}"), NixlEngine(f"r-{name}")
        sender.strided_lists = strided
        sender.register([(src.data_ptr(), src.numel())])
        receiver.register([(dst.data_ptr(), dst.numel())])
        peer = sender.connect(receiver.metadata())
        part = (item // 4, item // 2) if sliced else (0, item)
        bases = lambda t: np.array([[t.data_ptr() + e * slots * item + part[0], item, slots, part[1]]  # noqa: E731
                                    for e in range(entries)], np.uint64)
        sender.prepare(peer, "kv", bases(src), bases(dst))
        handle = sender.post_prepared(peer, "kv", picked, picked, b"")
        deadline = time.monotonic() + 30
        while sender.progress(handle) == "PROC" and time.monotonic() < deadline:
            time.sleep(0.001)
        assert handle.state == "DONE", handle.error
        landed[strided] = dst.clone()
    expected = torch.zeros_like(src).view(-1, item)
    rows, lo, hi = torch.from_numpy(picked.astype(np.int64)), part[0], part[0] + part[1]
    expected[rows, lo:hi] = src.view(-1, item)[rows, lo:hi]
    assert torch.equal(landed[True], expected.view(-1)) and torch.equal(landed[False], expected.view(-1))
