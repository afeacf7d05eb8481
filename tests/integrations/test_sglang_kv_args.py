"""SGLang's ``KVArgs`` state as kvplan components (``state_from_kv_args``), without SGLang installed:
the lists of lists map entry by entry, Mamba's dims, outer counts and GDN groups become shards that
plan a TP 4 -> 8 slice, and what cannot map is refused with a message naming it. The round trip
through SGLang's own ``KVArgs`` is in test_sglang_differential.py."""

from types import SimpleNamespace

import numpy as np
import pytest

from kvplan.errors import LayoutError
from kvplan.integrations.sglang import side_from_kv_args, state_from_kv_args
from kvplan.planner.contract.batch import StateKind, TensorShard
from kvplan.planner.contract.pairing import pair_sides


def kv_args(rank: int, tp: int, *, types=("swa", "mamba"), dims=None, outer=None, groups=None):
    """A gpt-oss-like SWA pool and a GDN layer's Mamba conv and temporal state on TP ``tp``."""
    conv, temporal = 32 // tp * 6, 8 // tp * 64
    mamba = ([0x5000_0000, 0x6000_0000], [conv * 16, temporal * 16], [conv, temporal],
             dims if dims is not None else [32 // tp, 8 // tp], outer if outer is not None else [1, 1],
             groups if groups is not None else [[8, 8, 16], None])
    other = ([0x4000_0000], [1 << 16], [1024 // tp], [], [], [])  # an SWA pool (or a type kvplan lacks)
    columns = list(zip(*(mamba if t == "mamba" else other for t in types)))
    return SimpleNamespace(
        kv_data_ptrs=[0x1000_0000, 0x2000_0000], kv_data_lens=[1 << 16] * 2, kv_item_lens=[1024 // tp] * 2,
        page_size=4, engine_rank=rank, kv_head_num=max(1, 8 // tp), total_kv_head_num=8, prefill_start_layer=0,
        aux_data_ptrs=[0x3000_0000], aux_data_lens=[1024], aux_item_lens=[64], state_types=list(types),
        **{name: list(column) for name, column in zip(
            ("state_data_ptrs", "state_data_lens", "state_item_lens", "state_dim_per_tensor",
             "state_slice_outer_counts", "state_conv_shard_groups"), columns)},
    )


def test_components_map_entry_by_entry_with_their_shards_and_the_params_kvargs_lack():
    swa, mamba = state_from_kv_args(kv_args(1, 4), [{"window": 128, "name": "swa"}, {"slot_map": np.arange(4)}])
    assert (swa.kind, swa.window, swa.name, swa.shards) == (StateKind.SWA, 128, "swa", ())
    assert [(e.base_ptr, e.item_len, e.num_items) for e in mamba.entries] == [(0x5000_0000, 48, 16),
                                                                              (0x6000_0000, 128, 16)]
    assert mamba.shards == (TensorShard(8, 1, (8, 8, 16)), TensorShard(2))
    assert mamba.slot_map.tolist() == [0, 1, 2, 3]


def test_sides_read_from_kvargs_pair_a_tp_slice():
    src = side_from_kv_args(kv_args(1, 4, types=("mamba",)), mla=False, attn_tp_size=4,
                            state_params=[{"slot_map": np.arange(4)}])
    dst = side_from_kv_args(kv_args(3, 8, types=("mamba",)), mla=False, attn_tp_size=8)
    pairing = pair_sides(src, dst)
    # golden vectors I of docs/tp_state.md §5, in 6-byte channels and 64-byte heads
    assert pairing.component_bytes(0).tolist() == [6, 6, 12, 64]
    assert (pairing.state_src[0][:, 0] - np.uint64(0x5000_0000)).tolist()[:3] == [6, 18, 36]


def test_an_explicit_state_still_wins():
    assert side_from_kv_args(kv_args(0, 1), mla=False, state=()).state == ()


@pytest.mark.parametrize("change, match", [
    ({"types": ("swa", "qsa_pending")}, r"state component 1: kvplan does not plan state type 'qsa_pending'"),
    ({"dims": [4]}, r"state component 1 \(mamba\): 2 entries, 1 dims, 2 outer counts and 2 shard groups"),
])
def test_what_cannot_map_is_refused_naming_it(change, match):
    with pytest.raises(LayoutError, match=match):
        state_from_kv_args(kv_args(0, 4, **change), [{"window": 8}])


def test_more_params_than_components_are_refused():
    with pytest.raises(LayoutError, match="3 state_params for 2 state components"):
        state_from_kv_args(kv_args(0, 4), [{"window": 8}, {}, {}])
