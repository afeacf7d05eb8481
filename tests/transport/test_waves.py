"""Staged mode's waves and run announcements: how a batch is cut into waves, and which announced
runs a receiver refuses before a byte is written."""

import numpy as np
import pytest

from kvplan.errors import PeerError
from kvplan.planner.contract.plan import KV_ROLE, Section
from kvplan.transport.senders.planned import split_descriptors
from kvplan.transport.waves import check_run, plan_waves, run_message


def test_waves_tile_the_batch_in_as_few_near_equal_waves_as_the_slot_allows():
    sizes = np.full(1000, 4096, np.int64)  # 4,096,000 bytes
    waves = plan_waves(sizes, [], slot_bytes=1 << 20, slots=2)
    assert len(waves) == 4  # ceil(4,096,000 / 1 MiB)
    assert [w.lo for w in waves[1:]] == [w.hi for w in waves[:-1]] and waves[0].lo == 0 and waves[-1].hi == 1000
    assert all(w.nbytes <= 1 << 20 for w in waves)
    assert max(w.nbytes for w in waves) - min(w.nbytes for w in waves) <= 4096  # no wave of a few bytes
    assert [w.slot for w in waves] == [0, 1, 0, 1]
    assert sum(w.nbytes for w in waves) == int(sizes.sum())


def test_a_batch_that_fits_one_slot_is_one_wave_and_a_descriptor_larger_than_a_slot_is_refused():
    assert len(plan_waves(np.full(10, 64, np.int64), [], slot_bytes=640, slots=4)) == 1
    with pytest.raises(ValueError, match="does not fit"):
        plan_waves(np.array([64, 2048]), [], slot_bytes=1024, slots=2)


def test_waves_from_the_caller_s_running_sums_are_the_waves_from_the_sizes():
    rng = np.random.default_rng(7)
    sizes = rng.integers(1, 9, 5000).astype(np.int64) * 64
    sections = [Section(0, "r1", KV_ROLE, "kv", 0, 1234, 1), Section(1, "r2", KV_ROLE, "kv", 1234, 5000, 1)]
    for slot_bytes in (512, 4096, 100_000, 1 << 30):
        plain = plan_waves(sizes, sections, slot_bytes, 3)
        assert plain == plan_waves(sizes, sections, slot_bytes, 3, ends=np.cumsum(sizes))
    with pytest.raises(ValueError, match="does not fit"):
        plan_waves(None, [], 1024, 2, ends=np.cumsum([64, 2048]))


def test_descriptors_larger_than_a_slot_are_cut_into_pieces_and_the_others_kept():
    descs = np.array([[0, 1000, 64], [64, 2000, 300], [400, 3000, 32]], np.uint64)
    same, first = split_descriptors(descs, 512)
    assert same is descs and first is None
    pieces, first = split_descriptors(descs, 128)
    assert first.tolist() == [0, 1, 4, 5]
    assert pieces.tolist() == [[0, 1000, 64], [64, 2000, 128], [192, 2128, 128], [320, 2256, 44], [400, 3000, 32]]


def test_a_section_completes_with_the_wave_holding_its_last_descriptor():
    sections = [Section(0, "r1", KV_ROLE, "kv", 0, 6, 3), Section(1, "r2", KV_ROLE, "kv", 6, 8, 1)]
    waves = plan_waves(np.full(8, 100, np.int64), sections, slot_bytes=400, slots=2)
    assert [[s.request for s in w.sections] for w in waves] == [[], ["r1", "r2"]]


def _run(rows, spans, waves_bytes, slot_bytes=1 << 20):
    descs = np.zeros((len(rows), 3), np.uint64)
    descs[:, 1:] = np.array(rows, np.uint64)
    waves = plan_waves(descs[:, 2].astype(np.int64), [], slot_bytes, 2)
    header, table = run_message("p0", 10, waves, slot_bytes, 16, spans, descs)
    return header, np.frombuffer(table, np.uint64).reshape(-1, 2)


def test_a_sound_run_passes_and_names_every_wave_once():
    header, rows = _run([[0x1000, 256], [0x2000, 256]], [("r1", 0, 1), ("r2", 1, 2)], None)
    check_run(rows, header["requests"], header["waves"], 16, 1 << 20)
    assert [w[0] for w in header["waves"]] == [10]


@pytest.mark.parametrize("change, why", [
    (lambda h, r: h["requests"].__setitem__(1, ["r2", 0, 2]), "do not follow"),
    (lambda h, r: h["requests"].pop(), "cover 1 of the table's 2 rows"),
    (lambda h, r: h["waves"][0].__setitem__(4, 1024), "claims 1024 bytes"),
    (lambda h, r: h["waves"][0].__setitem__(1, (1 << 20) - 256), "staging buffer holds"),
    (lambda h, r: h["waves"][0].__setitem__(1, 8), "not aligned"),
    (lambda h, r: r.__setitem__((1, 0), 0x2008), "rows are not aligned"),
    # a size near 2**64 read as int64 is negative, and the wave's sums still matched
    (lambda h, r: (r.__setitem__((1, 1), (1 << 64) - 256), h["waves"][0].__setitem__(4, 0)), "claims 18446744073709551360"),
])
def test_an_unsound_run_is_refused_with_the_reason(change, why):
    header, rows = _run([[0x1000, 256], [0x2000, 256]], [("r1", 0, 1), ("r2", 1, 2)], None)
    rows = rows.copy()
    change(header, rows)
    with pytest.raises(PeerError, match=why):
        check_run(rows, header["requests"], header["waves"], 16, 1 << 20)
