"""A plan split by layer group (docs/layerwise.md §1): every descriptor in exactly one group, each
in the group of the layer whose memory it reads, and a receiver counting layers completes a
request only once every group has landed."""

from __future__ import annotations

import numpy as np
import pytest

from kvplan.errors import LayoutError
from kvplan.planner.device.destinations import Expectation
from kvplan.planner.contract.layer_groups import LayerGroups, group_sections
from kvplan.planner.contract.batch import KVLayout, StateComponent, StateKind
from kvplan.planner.contract.pairing import pair_sides
from kvplan.planner.contract.plan import AUX_ROLE
from kvplan.planner.reference.oracle import plan_reference
from kvplan.tools.scenarios import PRESETS, build_batch, paired_ranks
from kvplan.transport.completion import CompletionTracker, decode_notification, encode_notification
from tests.planner.builders import entries, mha_side

LAYERS = 6
SCENARIOS = ("llama70b-tp8-p64", "llama70b-tp4to8-p64", "gptoss-swa-p16", "gptoss-swa-tp4to8-p16", "dsv32-mla-dsa-p64",
             "qwen3next-mamba-p64", "qwen3next-mamba-tp4to8-p64")


def _batch(name: str, seed: int):
    shape = PRESETS[name].scaled(layers=LAYERS)
    src_rank, dst_rank = paired_ranks(shape.src_tp, shape.dst_tp) if shape.src_tp != shape.dst_tp else (0, 0)
    return build_batch(shape, requests=3, prompt_len=[300, 77, 190], chunks=2, seed=seed, src_rank=src_rank,
                       dst_rank=dst_rank)


def _random_groups(rng) -> LayerGroups:
    count = int(rng.integers(1, LAYERS + 1))
    inner = np.sort(rng.choice(np.arange(1, LAYERS), count - 1, replace=False)) if count > 1 else []
    return LayerGroups((0, *[int(b) for b in inner], LAYERS))


def _source_layers(side):
    """(base, end, layer or None) of every source entry: what a descriptor's source address reads."""
    out = [(e.base_ptr, e.base_ptr + e.item_len * e.num_items, layer)
           for e, layer in zip(side.kv.entries, side.kv.model_layers * (len(side.kv.entries) // side.kv.num_layers))]
    for c in side.state:
        out += [(e.base_ptr, e.base_ptr + e.item_len * e.num_items, c.layers[i] if c.layers else None)
                for i, e in enumerate(c.entries)]
    out += [(e.base_ptr, e.base_ptr + e.item_len * e.num_items, None) for e in side.aux]
    return out


def _layer_read(regions, addr: int):
    hits = [layer for lo, hi, layer in regions if lo <= addr < hi]
    assert len(hits) == 1, f"address {addr:#x} is in {len(hits)} source entries"
    return hits[0]


@pytest.mark.parametrize("name", SCENARIOS)
@pytest.mark.parametrize("seed", [0, 1])
def test_every_descriptor_goes_with_the_group_of_the_layer_it_reads(name, seed):
    rng = np.random.default_rng(seed)
    batch = _batch(name, seed)
    plan = plan_reference(batch)
    descs, _ = plan.descriptors()
    groups = _random_groups(rng)
    per_group = group_sections(plan.sections(), [pair_sides(batch.src, d) for d in batch.dsts], batch.src,
                               [t.dest for t in batch.transfers], groups)
    assert len(per_group) == groups.count
    seen = np.zeros(len(descs), np.int64)
    regions = _source_layers(batch.src)
    for g, parts in enumerate(per_group):
        for part in parts:
            assert part.group == g
            rows = part.rows()
            seen[rows] += 1
            for src_addr in descs[rows, 0].tolist():
                layer = _layer_read(regions, src_addr)
                if layer is None:  # aux and components without layers: the last group, for every layer
                    assert g == groups.count - 1 and part.layers is None
                else:
                    assert groups.bounds[g] <= layer < groups.bounds[g + 1]
                    assert part.layers[0] <= layer < part.layers[1]
    in_sections = np.zeros(len(descs), np.int64)
    for s in plan.sections():
        in_sections[s.lo:s.hi] += 1
    np.testing.assert_array_equal(seen, in_sections)  # each sectioned descriptor exactly once
    assert in_sections.all()


@pytest.mark.parametrize("name", SCENARIOS)
def test_a_receiver_counting_layers_completes_only_when_every_group_has_landed(name):
    batch = _batch(name, 0)
    plan = plan_reference(batch)
    groups = LayerGroups.even(LAYERS, 3)
    per_group = group_sections(plan.sections(), [pair_sides(batch.src, d) for d in batch.dsts], batch.src,
                               [t.dest for t in batch.transfers], groups)
    tracker = CompletionTracker(batch.dsts[0])
    requests = {}
    for t in plan.transfers:
        pages, last = requests.get(t.request, (0, None))
        requests[t.request] = (pages + (len(t.dst_pages) if t.sent else 0), t if t.last else last)
    for request, (pages, last) in requests.items():
        tracker.expect(Expectation(request, pages, bool(len(last.aux_descs)), last.expected_components), 1e18)
    order = [p for parts in per_group for p in parts]
    for i, part in enumerate(order):
        assert tracker.pending(), f"complete before part {i} of {len(order)} landed"
        tracker.on_section(decode_notification(encode_notification(part)))
        if i < len(order) - 1:  # what is still to land keeps its request pending
            assert all(tracker.state(p.request) == "pending" for p in order[i + 1:])
    assert tracker.states() == {r: "complete" for r in requests}


def test_one_group_twice_and_another_missing_never_completes():
    batch = _batch("gptoss-swa-p16", 0)
    plan = plan_reference(batch)
    per_group = group_sections(plan.sections(), [pair_sides(batch.src, d) for d in batch.dsts], batch.src,
                               [t.dest for t in batch.transfers], LayerGroups.even(LAYERS, 2))
    tracker = CompletionTracker(batch.dsts[0])
    request = plan.transfers[-1].request
    last = plan.transfers[-1]
    pages = sum(len(t.dst_pages) for t in plan.transfers if t.request == request and t.sent)
    tracker.expect(Expectation(request, pages, True, last.expected_components), 1e18)
    mine = [p for p in per_group[0] + per_group[0] + [q for q in per_group[1] if q.role == AUX_ROLE]
            if p.request == request]
    for part in mine:
        tracker.on_section(decode_notification(encode_notification(part)))
    assert tracker.state(request) == "failed"  # the first group's pages counted twice: too many for a layer


def test_kv_of_layers_this_side_does_not_hold_fails_the_request():
    tracker = CompletionTracker(mha_side(0, layers=2))
    tracker.expect(Expectation("r", 4, False, ()), 1e18)
    tracker.on_section(decode_notification(b'["r", -1, "kv", 4, 7, 9]'))
    assert tracker.state("r") == "failed" and "does not hold" in tracker.failure("r")


def test_notifications_without_layers_cover_every_layer():
    side = mha_side(0, layers=3, state=[StateComponent(StateKind.DSA, entries(1 << 40, 3, 64), layers=(0, 1, 2))])
    tracker = CompletionTracker(side)
    tracker.expect(Expectation("r", 2, False, ("dsa",)), 1e18)
    tracker.on_section(decode_notification(b'["r", -1, "kv", 2]'))
    tracker.on_section(decode_notification(b'["r", 0, "dsa", 1, 0, 2]'))
    assert tracker.state("r") == "pending"  # layer 2 of the component is still missing
    tracker.on_section(decode_notification(b'["r", 0, "dsa", 1, 2, 3]'))
    assert tracker.state("r") == "complete"


def test_layer_groups_are_checked():
    with pytest.raises(LayoutError, match="increasing"):
        LayerGroups((0, 4, 4))
    with pytest.raises(LayoutError, match="cannot split"):
        LayerGroups.even(2, 3)
    assert LayerGroups.even(80, 3).bounds == (0, 26, 53, 80)
    with pytest.raises(LayoutError, match="layer 9 is outside"):
        LayerGroups((0, 4, 8)).group_of(np.array([1, 9]))


def test_tapered_groups_shrink_by_halves_to_the_last_and_cover_every_layer_once():
    assert LayerGroups.tapered(80, 8).bounds == (0, 13, 26, 39, 52, 66, 74, 78, 80)
    assert LayerGroups.tapered(80, 8, last=1).bounds == (0, 16, 32, 49, 65, 73, 77, 79, 80)
    assert LayerGroups.tapered(18, 6).sizes == [3, 3, 3, 3, 4, 2]
    assert LayerGroups.tapered(18, 6, last=1).sizes == [3, 4, 4, 4, 2, 1]
    assert LayerGroups.tapered(80, 8, first_layer=3).bounds == tuple(b + 3 for b in LayerGroups.tapered(80, 8).bounds)
    assert LayerGroups.tapered(10, 1).bounds == (0, 10)
    with pytest.raises(LayoutError, match="cannot split"):
        LayerGroups.tapered(2, 3)
    with pytest.raises(LayoutError, match="at least one layer"):
        LayerGroups.tapered(8, 2, last=0)
    for last in (1, 2, 3):
        for layers in range(1, 70):
            for count in range(1, layers + 1):
                sizes = LayerGroups.tapered(layers, count, last=last).sizes
                assert sum(sizes) == layers and len(sizes) == count and min(sizes) >= 1
                # the tail halves down to `last`, and the head before it is even
                tail = 0
                while tail < count - 1 and sizes[count - 1 - tail] == last << tail:
                    tail += 1
                head = sizes[: count - tail]
                assert max(head) <= min(head) + 1
                # it stopped where the next size would have outgrown an even share of what was left
                assert tail == count - 1 or (last << tail) * len(head) > sum(head)


def test_a_layer_outside_the_groups_is_refused():
    batch = _batch("llama70b-tp8-p64", 0)
    plan = plan_reference(batch)
    with pytest.raises(LayoutError, match="outside the layer groups"):
        group_sections(plan.sections(), [pair_sides(batch.src, batch.dsts[0])], batch.src,
                       [0] * len(plan.transfers), LayerGroups((0, LAYERS - 1)))


def test_sides_must_agree_on_layers():
    comp = lambda layers: StateComponent(StateKind.DSA, entries(1 << 40, 2, 64), layers=layers)  # noqa: E731
    with pytest.raises(LayoutError, match="layers differ"):
        pair_sides(mha_side(0, state=[comp((0, 1))]), mha_side(1 << 50, state=[comp((1, 1))]))
    with pytest.raises(LayoutError, match="model-wide id differs"):
        pair_sides(mha_side(0, layer_ids=(3, 7)), mha_side(1 << 50))
    with pytest.raises(LayoutError, match="one per entry"):
        comp((0,))
    with pytest.raises(LayoutError, match="increasing order"):
        KVLayout("mha", 1, entries(0, 4, 64), layer_ids=(7, 3))
    sparse = mha_side(0, layer_ids=(3, 7))
    assert sparse.kv.model_layers == (3, 7) and mha_side(0, layers=2, first_layer=2).kv.model_layers == (2, 3)


def test_golden_split_of_docs_layerwise_section_1():
    """docs/layerwise.md §1: MHA over 4 layers (K_0..K_3, V_0..V_3, two runs each), a DSA component
    of layers 1 and 2 (two runs each), aux; groups [0, 1), [1, 3), [3, 4)."""
    from kvplan.planner.contract.plan import Section

    src = mha_side(0, layers=4, state=[StateComponent(StateKind.DSA, entries(1 << 40, 2, 64), layers=(1, 2))])
    dst = mha_side(1 << 50, layers=4, state=[StateComponent(StateKind.DSA, entries(1 << 41, 2, 64), layers=(1, 2))])
    sections = [Section(0, "r", -1, "kv", 0, 16, 5), Section(0, "r", 0, "dsa", 16, 20, 1),
                Section(0, "r", -2, "aux", 20, 21, 1)]
    split = group_sections(sections, [pair_sides(src, dst)], src, [0], LayerGroups((0, 1, 3, 4)))
    got = [[(p.name, p.layers, p.spans) for p in parts] for parts in split]
    assert got == [[("kv", (0, 1), ((0, 2), (8, 10)))],
                   [("kv", (1, 3), ((2, 6), (10, 14))), ("dsa", (1, 3), ((16, 20),))],
                   [("kv", (3, 4), ((6, 8), (14, 16))), ("aux", None, ((20, 21),))]]
