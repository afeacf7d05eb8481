"""kvplan inside SGLang: SGLang's ``KVArgs`` mapped onto kvplan's model (more to come, issue 12).

Example::

    from kvplan.integrations.sglang import side_from_kv_args

    side = side_from_kv_args(kv_args, mla=False, attn_tp_size=4, req_to_token=req_to_token)
    plan = gpu.plan(Batch(side, (peer_side,), transfers))
"""

from .kv_args import side_from_kv_args

__all__ = ["side_from_kv_args"]
