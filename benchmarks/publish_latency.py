"""Decode-side publication latency: kvplan's batched lists against the SGLang-style path.

The SGLang-style path reads each list back with a ``.cpu().numpy()`` per request per list and
builds the message; kvplan computes every list of the batch on the GPU, copies them once and
builds the same messages. Both end with the wire messages of every request, checked equal.

Run on a GPU:  ``TRITON_INTERPRET=0 PYTHONPATH=. python -m benchmarks.publish_latency``
"""

from __future__ import annotations

import argparse
import json

import numpy as np
import torch

from kvplan.tools.bench import median_ms
from kvplan.compat.sglang import kv_to_page_indices, pack_int_lists
from kvplan.planner.device.destinations import PreallocatedRequest, plan_destinations
from kvplan.planner.contract.batch import SideMemory, StateKind
from kvplan.tools.scenarios import PRESETS, build_batch

PROMPT_LEN = 4096
PRESET_NAMES = ("llama70b-tp8-p64", "gptoss-swa-p16")


def decode_side(preset: str, requests: int, device: torch.device) -> tuple[SideMemory, list[PreallocatedRequest]]:
    batch = build_batch(PRESETS[preset], requests, PROMPT_LEN, seed=1)
    side = batch.dsts[0].to(device)
    reqs = [PreallocatedRequest(f"req{r}", r, PROMPT_LEN, 0, r) for r in range(1, requests + 1)]
    return side, reqs


def sglang_style_messages(side: SideMemory, requests: list[PreallocatedRequest]) -> list[bytes]:
    ps, table = side.kv.page_size, side.req_to_token
    out = []
    for r in requests:
        pages = kv_to_page_indices(table[r.row, r.prefix_len : r.prompt_len].cpu().numpy(), ps)
        state = []
        for comp in side.state:
            cps = comp.pages_of(ps)
            if comp.kind is StateKind.SWA:
                ws = (max(0, r.prompt_len - comp.window) // cps) * cps
                swa = comp.slot_map[table[r.row, ws : r.prompt_len].long()].cpu().numpy()
                state.append(kv_to_page_indices(swa, cps))
            elif comp.kind is StateKind.DSA:
                state.append(kv_to_page_indices(table[r.row, : r.prompt_len].cpu().numpy(), cps))
            elif comp.kind is StateKind.MAMBA:
                state.append(comp.slot_map[r.row : r.row + 1].cpu().numpy())
            else:
                lo = max(0, r.prompt_len - comp.window)
                state.append(r.row * comp.ring_size + np.arange(lo, r.prompt_len) % comp.ring_size)
        out.append(pack_int_lists([pages, *state, np.array([r.aux_index])], "i"))
    return out


def kvplan_messages(side: SideMemory, requests: list[PreallocatedRequest]) -> list[bytes]:
    return plan_destinations(side, requests).messages()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--json")
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    rows = []
    for preset in PRESET_NAMES:
        for n in (64, 256):
            side, reqs = decode_side(preset, n, device)
            assert kvplan_messages(side, reqs) == sglang_style_messages(side, reqs), f"{preset}: messages differ"
            ours = median_ms(lambda: kvplan_messages(side, reqs), args.runs)
            base = median_ms(lambda: sglang_style_messages(side, reqs), args.runs)
            rows.append({"preset": preset, "requests": n, "prompt_len": PROMPT_LEN, "baseline_ms": base,
                         "kvplan_ms": ours, "ratio": base / ours})
    card = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu (interpreter)"
    print(f"card: {card}; torch {torch.__version__}")
    print("| preset | requests | SGLang-style ms | kvplan ms | ratio |")
    print("|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['preset']} | {r['requests']} | {r['baseline_ms']:.2f} | {r['kvplan_ms']:.3f} | {r['ratio']:.1f}x |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"card": card, "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
