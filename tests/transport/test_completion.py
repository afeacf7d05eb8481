"""The receiver's completion tracker: KV pages counted per layer, whether a note covers every layer or
names some (a streamed group's), and a staged wave's notes landed together exactly as one by one."""

import time
from types import SimpleNamespace

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvplan.planner.device.destinations import Expectation
from kvplan.planner.contract.plan import AUX_ROLE, KV_ROLE
from kvplan.transport.completion import CompletionTracker, SectionNote

LAYERS = (0, 1, 2, 3)


def _side(layers=LAYERS):
    """What the tracker reads of a side: its KV layers' model-wide ids and its state components."""
    return SimpleNamespace(kv=SimpleNamespace(model_layers=tuple(layers)), state=())


def _tracker(pages: int, aux: bool = False, layers=LAYERS) -> CompletionTracker:
    tracker = CompletionTracker(_side(layers))
    tracker.expect(Expectation("r", pages, aux, ()), time.monotonic() + 60)
    return tracker


def _kv(count: int, layers=None) -> SectionNote:
    return SectionNote("r", KV_ROLE, "kv", count, layers)


def test_notes_covering_every_layer_complete_the_request_once_they_add_up():
    tracker = _tracker(5)
    tracker.on_sections([_kv(2), _kv(2)])
    assert tracker.state("r") == "pending"
    tracker.on_section(_kv(1))
    assert tracker.state("r") == "complete"


def test_a_streamed_request_completes_only_once_every_group_has_landed():
    tracker = _tracker(3)
    tracker.on_sections([_kv(3, (0, 2))])
    assert tracker.state("r") == "pending"
    tracker.on_sections([_kv(3, (2, 4))])
    assert tracker.state("r") == "complete"


def test_all_layer_and_layered_notes_add_up_per_layer():
    tracker = _tracker(4)
    tracker.on_sections([_kv(1), _kv(3, (0, 2))])
    assert tracker.state("r") == "pending"  # layers 2 and 3 have one page of four
    tracker.on_sections([_kv(3, (2, 4))])
    assert tracker.state("r") == "complete"


@pytest.mark.parametrize("notes", [[_kv(3), _kv(2)], [_kv(1), _kv(4, (3, 4))], [_kv(5, (1, 2))]],
                         ids=["all-layers", "mixed", "one-layer"])
def test_more_pages_on_a_layer_than_published_fail_the_request(notes):
    tracker = _tracker(4)
    tracker.on_sections(notes)
    assert tracker.state("r") == "failed" and "KV pages of a layer, expected 4" in tracker.failure("r")


def test_a_side_without_kv_layers_needs_none():
    tracker = _tracker(0, aux=True, layers=())
    tracker.on_sections([SectionNote("r", AUX_ROLE, "aux", 1)])
    assert tracker.state("r") == "complete"


_NOTES = st.lists(st.tuples(st.sampled_from(["kv", "aux"]), st.integers(0, 4),
                            st.one_of(st.none(), st.tuples(st.integers(0, 3), st.integers(1, 4)))), max_size=12)


@settings(max_examples=200, deadline=None)
@given(pages=st.integers(0, 8), notes=_NOTES)
def test_a_waves_notes_landed_together_end_as_landed_one_by_one_and_as_counted_per_layer(pages, notes):
    made = [SectionNote("r", AUX_ROLE, "aux", 1) if kind == "aux" else
            _kv(count, None if layers is None or layers[0] >= layers[1] else layers)
            for kind, count, layers in notes]
    together, one_by_one = _tracker(pages, aux=True), _tracker(pages, aux=True)
    together.on_sections(made)
    for note in made:
        one_by_one.on_section(note)
    assert together.state("r") == one_by_one.state("r")
    assert together.failure("r") == one_by_one.failure("r")
    # the reference: pages per layer, a request failed from the first note that passes its count
    per_layer, failed, aux = np.zeros(len(LAYERS), np.int64), False, False
    for note in made:
        if note.role == AUX_ROLE:
            aux = True
            continue
        lo, hi = note.layers or (0, len(LAYERS))
        per_layer[lo:hi] += note.count
        failed = failed or bool((per_layer > pages).any())
    expected = "failed" if failed else "complete" if aux and (per_layer == pages).all() else "pending"
    assert together.state("r") == expected


def test_a_stray_aux_note_after_a_request_completed_leaves_it_complete():
    """An aux row the request was not published with, arriving after it completed and was reported, cannot
    turn it back to pending (it did: a completed request then waited for nothing until its deadline)."""
    tracker = _tracker(2)
    tracker.on_sections([_kv(2)])
    assert tracker.state("r") == "complete" and tracker.take_ended() == {"r": None}
    tracker.on_sections([SectionNote("r", AUX_ROLE, "aux", 1, None)])
    assert tracker.state("r") == "complete" and tracker.take_ended() == {}


def test_an_aux_row_a_request_was_not_published_with_fails_it():
    tracker = _tracker(2)
    tracker.on_sections([SectionNote("r", AUX_ROLE, "aux", 1, None)])
    assert tracker.state("r") == "failed" and "aux row" in tracker.failure("r")
