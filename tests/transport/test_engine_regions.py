"""What an endpoint registers with its engine: each entry's span once, and one region over entries that
overlap (vLLM overlays its KV cache groups: a full-attention layer and a sliding-window layer over the same
bytes; NIXL crashed deregistering such memory twice)."""

from kvplan.planner.contract.batch import Attention, Entry, KVLayout, SideMemory, StateComponent, StateKind
from kvplan.transport.decode import engine_regions


def test_overlapping_entries_are_one_region_and_separate_ones_stay_apart():
    kv = (Entry(0x10000, 256, 4), Entry(0x20000, 256, 4))  # two layers of 1 KiB each
    window = StateComponent(StateKind.SWA, (Entry(0x10000, 256, 4), Entry(0x20100, 256, 4)), window=8,
                            slot_map=[0])  # the first layer's bytes again, and a span that overlaps the second's
    aux = (Entry(0x30000, 64, 2), Entry(0x40000, 64, 0))  # (an empty one registers nothing)
    side = SideMemory(KVLayout(Attention.MHA_PACKED, 4, kv), (window,), aux)
    assert engine_regions(side) == [(0x10000, 1024), (0x20000, 0x100 + 1024), (0x30000, 128)]
