"""Small hand-made sides and transfers for planner tests."""

from __future__ import annotations

import numpy as np

from kvplan.planner.contract.batch import Attention, Entry, KVLayout, SideMemory, StateComponent, Transfer


def entries(base: int, count: int, item_len: int, num_items: int = 64) -> tuple[Entry, ...]:
    return tuple(Entry(base + i * (1 << 24), item_len, num_items) for i in range(count))


def table_with(rows: dict[int, list[int]], page_size: int, max_ctx: int = 256, num_rows: int = 4) -> np.ndarray:
    """A token table where row ``r`` holds the given pages, in order, fully."""
    table = np.zeros((num_rows, max_ctx), np.int32)
    for r, pages in rows.items():
        slots = (np.array(pages)[:, None] * page_size + np.arange(page_size)).reshape(-1)
        table[r, : slots.size] = slots
    return table


def mha_side(base: int, layers: int = 2, page_size: int = 1, item_len: int = 4096, table=None, state=(), aux=(),
             **kv) -> SideMemory:
    return SideMemory(KVLayout(Attention.MHA, page_size, entries(base, 2 * layers, item_len), **kv),
                      tuple(state), tuple(aux), table)


def last_transfer(request="r1", row=1, length=4, dst_pages=(), **kw) -> Transfer:
    kw.setdefault("fill_len", length + 1)
    return Transfer(request, src_row=row, start=kw.pop("start", 0), prompt_len=length, last=kw.pop("last", True),
                    dst_pages=np.array(dst_pages, dtype=np.int64), **kw)


def swa(base: int, slot_map: np.ndarray, window: int, item_len: int = 512, count: int = 2) -> StateComponent:
    from kvplan.planner.contract.batch import StateKind

    return StateComponent(StateKind.SWA, entries(base, count, item_len), window=window, slot_map=slot_map)


def assert_device_matches_reference(batch, device):
    """The device planner's plan, descriptors (with offsets) and sections equal the reference's; the
    reference's plan."""
    import numpy as np

    from kvplan.planner.device import eager
    from kvplan.planner.reference.oracle import plan_reference

    expected = plan_reference(batch)
    pending = eager.plan(batch.to(device))
    pending.result().assert_equal(expected)
    descs, offsets = pending.descriptors()
    want, want_offsets = expected.descriptors()
    assert np.array_equal(descs, want) and np.array_equal(offsets, want_offsets)
    assert pending.sections() == expected.sections()
    return expected
