"""Plot plan latency against descriptor count, kvplan and the SGLang-style baseline, from a
``kvplan bench --json`` file:  ``python -m benchmarks.plot results/X.json plan_latency.png "H200"``
(needs matplotlib, which kvplan itself does not)."""

from __future__ import annotations

import json
import sys


def main() -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    source, target, card = sys.argv[1], sys.argv[2], sys.argv[3] if len(sys.argv) > 3 else ""
    rows = sorted(json.load(open(source)), key=lambda r: r["descriptors"])
    fig, ax = plt.subplots(figsize=(7, 4.5), dpi=120)
    x = [r["descriptors"] for r in rows]
    ax.loglog(x, [r["baselines"]["numpy-batch"] for r in rows], "o-", label="numpy-batch (strongest host planner)")
    ax.loglog(x, [r["kvplan_ms"] for r in rows], "s-", label="kvplan (GPU, to descriptors in host memory)")
    if all(r.get("kvplan_graph_ms") for r in rows):
        ax.loglog(x, [r["kvplan_graph_ms"] for r in rows], "^--", label="kvplan, CUDA-graph replay (Planner)")
        ax.loglog(x, [r["floor_ms"] for r in rows], "k:", label="floor: kernels + copy of the Nx3 output")
    for r in rows:
        ax.annotate(r["scenario"], (r["descriptors"], r["baselines"]["numpy-batch"]), fontsize=7, xytext=(4, 4),
                    textcoords="offset points")
    ax.axhline(0.2, color="grey", linestyle=":", linewidth=1)
    ax.text(x[0], 0.21, "200 us target", fontsize=7, color="grey")
    ax.set_xlabel("descriptors per batch")
    ax.set_ylabel("plan latency, ms (median)")
    ax.set_title(f"Plan latency, benchmarks.md scenarios {card}".strip())
    ax.grid(True, which="both", linewidth=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(target)


if __name__ == "__main__":
    main()
