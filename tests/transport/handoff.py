"""Small model shapes for the two-process hand-off tests (the processes are kvplan.tools.demo's)."""

from kvplan.planner.contract.batch import Attention, StateKind
from kvplan.tools.scenarios import ComponentShape, ModelShape, ShardedTensor

HYBRID = ModelShape(
    "hybrid-test", Attention.MHA, 2, 32, 4,
    state=(ComponentShape(StateKind.SWA, 2, 96, window=10), ComponentShape(StateKind.DSA, 1, 80),
           ComponentShape(StateKind.SWA_RING, 2, 48, window=6, ring_size=8), ComponentShape(StateKind.MAMBA, 3, 144)),
    num_kv_heads=2, aux_items=(16, 64),
)
HEAD_SLICED = ModelShape("tp2to4-test", Attention.MHA, 2, 64, 4, num_kv_heads=4, src_tp=2, dst_tp=4)
# KV and aux only, for sides of different page sizes (docs/page_sizes.md): the source page size is
# in the name, the destination's is the demo's ``dst_page_size``
KV1, KV16, KV64 = (ModelShape(f"kv-p{ps}-test", Attention.MHA, 2, 32, ps, num_kv_heads=2, aux_items=(16,))
                   for ps in (1, 16, 64))
# state whose lists do not depend on the page size (docs/page_sizes.md §6), for a destination of another
RING_MAMBA = ModelShape(
    "ring-mamba-test", Attention.MHA, 2, 32, 4,
    state=(ComponentShape(StateKind.SWA_RING, 2, 48, window=6, ring_size=8), ComponentShape(StateKind.MAMBA, 3, 144)),
    num_kv_heads=2, aux_items=(16,),
)
# a sparse-attention indexer (DSA) whose pages follow each side's page size: moved in units
DSA1, DSA16, DSA64 = (ModelShape(f"dsa-p{ps}-test", Attention.MLA, 2, 32, ps,
                                 state=(ComponentShape(StateKind.DSA, 1, ps * 8),), aux_items=(16,))
                      for ps in (1, 16, 64))
# sliding-window state (gpt-oss-like) whose SWA pages follow each side's page size
SWA1, SWA16, SWA64 = (ModelShape(f"swa-p{ps}-test", Attention.MHA, 2, 32, ps,
                                 state=(ComponentShape(StateKind.SWA, 2, 32 * ps, window=24),), num_kv_heads=2,
                                 aux_items=(16,)) for ps in (1, 16, 64))
# gpt-oss-like SWA state between TP sizes (docs/tp_state.md): 8 KV heads, TP 4 -> 8, head-sliced
SWA_TP4TO8 = ModelShape("swa-tp4to8-test", Attention.MHA, 2, 16, 4, num_kv_heads=8, src_tp=4, dst_tp=8,
                        state=(ComponentShape(StateKind.SWA, 2, 16 * 4, window=10),), aux_items=(16,))
# Mamba state sliced between TP 4 and 8 (docs/tp_state.md §4): the four tensors of the golden vectors,
# a GDN conv in query | key | value groups, a temporal state, two outer rows, a replicated item
MAMBA_TENSORS = (ShardedTensor(32, 2, groups=(8, 8, 16)), ShardedTensor(8, 4), ShardedTensor(8, 1, outer=2),
                 ShardedTensor(0, 6))
MAMBA_TP4TO8 = ModelShape("mamba-tp4to8-test", Attention.MHA, 2, 16, 4, num_kv_heads=8, src_tp=4, dst_tp=8,
                          state=(ComponentShape(StateKind.MAMBA, 4, 0, tensors=MAMBA_TENSORS),), aux_items=(16,))
# the same gathered into rank 0 of TP 4 from ranks 0 and 1 of TP 8 (docs/tp_state.md §4), with a second
# component of replicated tensors only, which the group's second source rank does not write
REPLICATED_ONLY = ComponentShape(StateKind.MAMBA, 2, 0, tensors=(ShardedTensor(0, 6),), name="mamba-replicated")
MAMBA_TP8TO4 = ModelShape("mamba-tp8to4-test", Attention.MHA, 2, 16, 4, num_kv_heads=8, src_tp=8, dst_tp=4,
                          state=MAMBA_TP4TO8.state + (REPLICATED_ONLY,), aux_items=(16,))
SHAPES = {"hybrid": HYBRID, "head_sliced": HEAD_SLICED, "kv1": KV1, "kv16": KV16, "kv64": KV64,
          "ring_mamba": RING_MAMBA, "dsa1": DSA1, "dsa16": DSA16, "dsa64": DSA64, "swa1": SWA1, "swa16": SWA16,
          "swa64": SWA64, "swa_tp4to8": SWA_TP4TO8, "mamba_tp4to8": MAMBA_TP4TO8,
          "mamba_tp8to4": MAMBA_TP8TO4}
LENGTHS = (100, 37, 64)
