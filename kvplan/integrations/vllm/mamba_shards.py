"""How vLLM's Mamba state is sharded across TP ranks, as kvplan's :class:`TensorShard` describes it.

vLLM keeps a Mamba layer's state of one block in one page: its conv state, then its temporal (SSM)
state, then padding to the attention page (``MambaSpec.shapes``, ``dtypes``, per rank). Each tensor is
sharded along one dimension across TP ranks (docs/tp_state.md §4):

* the conv state along its channels, in sub-projections each sharded on its own: Mamba1 ``x``, Mamba2
  ``x | B | C``, GDN ``Q | K | V``; vLLM lays it out ``(state_len, dim)`` (``SD``, its default) or
  ``(dim, state_len)`` (``DS``, ``VLLM_SSM_CONV_STATE_LAYOUT``);
* the temporal state along its first dimension (heads; Mamba1's channels).

:func:`mamba_shards` gives each tensor's shard, with its span of the page, so that kvplan's planner moves
a rank's part of each tensor into the ranks of a decode of another TP size, and only the tensors (not
the padding) between equal ones. A state kind it does not know the sharding of gets none: it moves whole
pages, between equal TP sizes only.

Example (Mamba2, TP 2: 4 heads of 4 x 8 and a conv of 16 + 8 + 8 channels in the model)::

    spec = MambaSpec(block_size=16, shapes=((3, 16), (2, 4, 8)), dtypes=(torch.bfloat16, torch.float32))
    conv, temporal = mamba_shards(spec, tp_size=2, dim_first=False)
    conv.groups, conv.outer, temporal.offset    # ((16, 8, 8), 3, 96)
"""

from __future__ import annotations

from math import prod
from typing import Any

import torch

from ...planner.contract.batch import TensorShard

__all__ = ["conv_dim_first", "mamba_shards"]


def conv_dim_first() -> bool:
    """Whether vLLM lays the conv state out ``(dim, state_len)`` (``VLLM_SSM_CONV_STATE_LAYOUT=DS``); its
    default, ``(state_len, dim)``, where this vLLM does not say."""
    try:
        from vllm.model_executor.layers.mamba.mamba_utils import is_conv_state_dim_first
    except ImportError:
        return False
    return bool(is_conv_state_dim_first())


def _itemsize(dtype: Any) -> int:
    return torch.empty((), dtype=dtype).element_size()


def _conv_groups(kind: str, conv_dim: int, temporal: tuple[int, ...], tp_size: int) -> tuple[int, ...] | None:
    """The conv state's sub-projections in the model (unsharded), in channel order, or None where the
    shapes do not decompose as ``kind``'s do."""
    full = conv_dim * tp_size
    if kind == "MAMBA1":
        return (full,) if temporal and temporal[0] == conv_dim else None
    if kind == "MAMBA2" and len(temporal) >= 2:
        x = temporal[0] * temporal[1] * tp_size  # heads x head_dim: the model's intermediate size
        rest = full - x
        return (x, rest // 2, rest // 2) if rest > 0 and rest % 2 == 0 else None
    if kind == "GDN_ATTN" and len(temporal) >= 2:
        value = temporal[0] * temporal[1] * tp_size  # value heads x value head size
        rest = full - value
        return (rest // 2, rest // 2, value) if rest > 0 and rest % 2 == 0 else None
    return None


def mamba_shards(spec: Any, tp_size: int, dim_first: bool) -> tuple[TensorShard, ...]:
    """Each of a ``MambaSpec``'s two tensors as a shard over its span of the page, for a rank of TP size
    ``tp_size`` (``dim_first``: the conv state is ``(dim, state_len)``), or ``()`` where kvplan does not
    know how the kind is sharded (it then moves whole pages, between equal TP sizes)."""
    shapes, dtypes = tuple(tuple(int(d) for d in s) for s in spec.shapes), tuple(spec.dtypes)
    if len(shapes) != 2 or len(dtypes) != 2 or len(shapes[0]) != 2:
        return ()
    sizes = [prod(shape) * _itemsize(dtype) for shape, dtype in zip(shapes, dtypes)]
    if getattr(spec, "tp_replicated", False):  # every rank holds the whole state
        return (TensorShard(0, nbytes=sizes[0]), TensorShard(0, offset=sizes[0], nbytes=sizes[1]))
    kind = getattr(spec.mamba_type, "name", str(spec.mamba_type)).upper()
    conv_dim, rows = (shapes[0][0], shapes[0][1]) if dim_first else (shapes[0][1], shapes[0][0])
    groups = _conv_groups(kind, conv_dim, shapes[1], tp_size)
    if groups is None or any(g % tp_size for g in groups):
        return ()
    conv = TensorShard(conv_dim, 1 if dim_first else rows, groups if len(groups) > 1 else (), 0, sizes[0])
    return conv, TensorShard(shapes[1][0], 1, (), sizes[0], sizes[1])
