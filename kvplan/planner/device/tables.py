"""What a :class:`~kvplan.planner.device.planner.Planner` keeps from batch to batch: the side
pairings and the device tables built from them once (entries, destinations, components, head slices,
claim regions, prepared slots), and the host tables a plan's expansion on the host reads.

Example::

    tables = StaticTables(src, [dst], prepared=False)
    tables.K                     # segments per transfer: KV, each state component, aux
"""

from __future__ import annotations

from math import gcd
from typing import Sequence

import numpy as np
import torch

from ...errors import LayoutError
from ...kernels import batch_layout as kl
from ...kernels import expand as kx
from ..contract.batch import SideMemory
from ..contract.pairing import SidePairing, pair_sides
from ..contract.rules import check_token_table
from ..contract.state_kinds import rules_of
from ..reference.expand import scaled_tables
from ..reference.page_mapping import unit_tables
from .lists import as_device_tensor, require_same_device
from .prepared import AUX, KV, prepared_slots, require_prepared_form

__all__ = ["MAX_MAPS", "StaticTables", "pairing_tables", "token_table"]

MAX_MAPS = 4


def token_table(side: SideMemory) -> torch.Tensor:
    check_token_table(side.req_to_token)
    table = side.req_to_token
    return torch.from_numpy(table) if isinstance(table, np.ndarray) else table


def pairing_tables(pairing: SidePairing, k: int, K: int) -> tuple[np.ndarray, np.ndarray]:
    if k == 0:
        return pairing.kv_src, pairing.kv_dst
    if k == K - 1:
        return pairing.aux_src, pairing.aux_dst
    return pairing.state_src[k - 1], pairing.state_dst[k - 1]


class StaticTables:
    """What does not change from batch to batch: the source's token table (checked), the pairings and
    the device tables built from them."""

    def __init__(self, src: SideMemory, dsts: Sequence[SideMemory], prepared: bool):
        self.table = token_table(src)
        device = self.device = self.table.device
        require_same_device(src, device)
        self.pairings: list[SidePairing] = [pair_sides(src, d) for d in dsts]
        ps = src.kv.page_size
        # docs/page_sizes.md: with a destination of another page size, KV moves in units of gcd tokens
        # (each pairing's kv_units and state_units say how many per page on each side)
        self.units = any(p.in_units for p in self.pairings)
        if self.units and prepared:
            raise LayoutError(f"page sizes differ (source {ps}, destinations {[d.kv.page_size for d in dsts]}): "
                              "NIXL prepared lists index whole pages of one size on each side; plan descriptors "
                              "(docs/page_sizes.md §5)")
        C = self.C = len(src.state)
        K = self.K = 2 + C
        D = len(dsts)
        blocks, count = [], 0
        dest_meta = np.zeros((max(1, D), int(kl.DEST_FIELDS_BASE) + 2 * K + 4 * C), np.int64)
        heads = np.zeros((max(1, D) * K, int(kx.HEAD_FIELDS)), np.int64)  # per destination and slot
        for d, (p, side) in enumerate(zip(self.pairings, dsts)):
            kv_tables = unit_tables(p, ps, side.kv.page_size) if p.kv_units != (1, 1) else (p.kv_src, p.kv_dst)
            comp_tables = [scaled_tables(st, dt, c.pages_of(ps), dc.pages_of(side.kv.page_size))
                           if p.state_units[i] != (1, 1) else (st, dt)
                           for i, (st, dt, c, dc) in enumerate(zip(p.state_src, p.state_dst, src.state, side.state))]
            tables = [kv_tables, *comp_tables, (p.aux_src, p.aux_dst)]
            moved = [None, *(p.component_bytes(c) for c in range(C)), None]  # bytes per item, when not whole
            for k, (src_t, dst_t) in enumerate(tables):
                block = np.zeros((len(src_t), int(kx.ENTRY_FIELDS)), dtype=np.uint64)
                block[:, 0], block[:, 1], block[:, 2], block[:, 3] = src_t[:, 0], dst_t[:, 0], src_t[:, 1], dst_t[:, 1]
                block[:, 4] = src_t[:, 1] if moved[k] is None else moved[k]
                blocks.append(block)
                dest_meta[d, 3 + 2 * k : 5 + 2 * k] = count, len(block)
                count += len(block)
            dest_meta[d, 0] = side.kv.num_pages
            dest_meta[d, 1] = min((e.num_items for e in side.aux), default=0)
            dest_meta[d, 2] = p.sliced_tokens
            dest_meta[d, 3 + 2 * K : 3 + 2 * K + C] = [c.num_items for c in side.state]
            for i, c in enumerate(side.state):
                cps_d = c.pages_of(side.kv.page_size)
                dest_meta[d, 3 + 2 * K + C + 2 * i : 5 + 2 * K + C + 2 * i] = cps_d, gcd(cps_d, src.state[i].pages_of(ps))
            unit = p.unit_tokens
            dest_meta[d, -3:] = side.kv.page_size, unit, ps * side.kv.page_size // unit
            # head slices (planning.md §5; docs/tp_state.md): KV's in slot 0, each head-sliced component's in its slot
            for k, h in enumerate([p.heads, *(p.component_heads(c) for c in range(C))]):
                if h is not None:
                    heads[d * K + k] = (h.src_token_bytes, h.dst_token_bytes, h.src_head * h.bytes_per_head,
                                        h.dst_head * h.bytes_per_head, h.nbytes)
            dest_meta[d, 3 + 2 * K + 3 * C : 3 + 2 * K + 4 * C] = p.state_sliced_tokens
        self.entry_span = dest_meta[:, 3 : 3 + 2 * K].reshape(-1, K, 2).copy()  # per dest and slot
        # claims (planning.md §6.1): per dest and slot, the first bit and the item count of its bitmap region
        own = np.zeros((max(1, D) * K, 2), np.int64)
        own[:, 1] = np.concatenate([[m[0], *m[3 + 2 * K : 3 + 2 * K + C], m[1]] for m in dest_meta]) if D else 0
        own[:, 0] = np.cumsum(own[:, 1]) - own[:, 1]
        self.claim_words = int(own[:, 1].sum()) // 32 + 1
        self.entries_host = np.concatenate(blocks) if blocks else np.zeros((0, int(kx.ENTRY_FIELDS)), np.uint64)
        self.maps: list[torch.Tensor] = []
        comp_meta = np.zeros((max(1, C), int(kl.COMP_FIELDS)), np.int64)
        for c, comp in enumerate(src.state):
            rules = rules_of(comp.kind)
            rules.require_map(comp)
            map_slot, map_len = -1, 0
            if rules.needs_map:
                if len(self.maps) == MAX_MAPS:
                    raise LayoutError(f"at most {MAX_MAPS} state components with slot maps are supported")
                slot_map = as_device_tensor(comp.slot_map, device, f"slot_map of component {comp.name}", torch.int64)
                map_slot, map_len = len(self.maps), slot_map.numel()
                self.maps.append(slot_map.reshape(-1))
            comp_meta[c] = (rules.layout_code, comp.window, comp.pages_of(src.kv.page_size), max(1, comp.ring_size),
                            comp.num_items, map_slot, map_len, rules.always_strict, comp.from_prefix)
        slots = np.zeros((max(1, D) * K, 2), np.int64)
        if prepared:
            require_prepared_form(src, dsts)
            for d, side in enumerate(dsts):
                for role, (_, s_slots, d_slots) in prepared_slots(src, side).items():
                    k = 0 if role == KV else K - 1 if role == AUX else 1 + role
                    slots[d * K + k] = s_slots, d_slots
        multiplier = [1]
        for d, p in enumerate(self.pairings):
            kv_entries = int(dest_meta[d, 4])
            multiplier.append(kv_entries * max(1, p.sliced_tokens))
            multiplier += [int(dest_meta[d, 4 + 2 * k]) * max(1, int(dest_meta[d, 3 + 2 * K + 3 * C + k - 1]))
                           for k in range(1, K - 1)]
        self.per_element = max(multiplier)
        # list elements per destination-list entry at most (a destination page holds this many units)
        self.units_per_entry = max([p.kv_units[1] for p in self.pairings] + [r[1] for p in self.pairings for r in p.state_units]
                                   + [1])
        self.aux_entries = len(src.aux)
        to = lambda a: torch.from_numpy(np.ascontiguousarray(a).view(np.int64)).to(device)  # noqa: E731
        self.entries, self.dest_meta, self.heads, self.comp_meta, self.slots, self.own = (
            to(self.entries_host), to(dest_meta), to(heads), to(comp_meta), to(slots), to(own))
        if not self.maps:
            self.maps = [self.entries]
