"""Index arrays for NIXL prepared lists: values, order, and the int32 guard."""

import numpy as np
import pytest

from kvplan.errors import LayoutError
from kvplan.planner.contract.batch import Attention, Batch, Entry, KVLayout, SideMemory
from kvplan.planner.device.prepared import AUX, KV, prepared_indices_reference, prepared_slots
from kvplan.planner.reference.oracle import plan_reference
from tests.planner.builders import last_transfer, mha_side, table_with


def test_indices_are_entry_major_per_page():
    table = table_with({1: [3, 4, 9]}, page_size=1)
    aux = (Entry(0x5000000, 8, 16),)
    src = SideMemory(mha_side(0x1000000, table=table).kv, aux=aux, req_to_token=table)
    dst = SideMemory(mha_side(0x9000000).kv, aux=(Entry(0xA000000, 8, 32),))
    batch = Batch(src, (dst,), (last_transfer(length=3, dst_pages=[10, 11, 12], aux_src=2, aux_dst=5),))
    ind = prepared_indices_reference(batch, plan_reference(batch))
    # 4 entries x 64 slots: entry e, page p -> e * 64 + p
    assert ind.src.dtype == np.int32 and ind.dst.dtype == np.int32
    assert ind.src.tolist() == [e * 64 + p for e in range(4) for p in (3, 4, 9)] + [2]
    assert ind.dst.tolist() == [e * 64 + p for e in range(4) for p in (10, 11, 12)] + [5]
    assert ind.section_offsets.tolist() == [0, 12, 13]
    assert ind.section_role.tolist() == [KV, AUX] and ind.section_transfer.tolist() == [0, 0]


def test_int32_overflow_is_refused_not_wrapped():
    big = KVLayout(Attention.MHA, 64, tuple(Entry(i << 40, 16384, 1 << 26) for i in range(160)))
    with pytest.raises(LayoutError, match="overflow int32"):
        prepared_slots(SideMemory(big), SideMemory(big))
    fits = KVLayout(Attention.MHA, 64, tuple(Entry(i << 40, 16384, (1 << 31) // 160) for i in range(160)))
    assert prepared_slots(SideMemory(fits), SideMemory(fits))[KV][1] == (1 << 31) // 160
