"""The planning table's figure (benchmarks/RESULTS.md, "Planning"): plan latency against descriptor
count, kvplan's graph replay against the strongest host planner (``numpy-batch``) and the floor, from a
``kvplan bench --json`` file. Regenerate it with
``python -m benchmarks.plot benchmarks/results/2026-11-28-h200-final-session17-bench.json benchmarks/plan_latency.png "(one H200)"``
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
    ax.loglog(x, [r["kvplan_graph_ms"] for r in rows], "s-", label="kvplan (Planner, graph replay, descriptors on the host)")
    ax.loglog(x, [r["floor_ms"] for r in rows], "k:", label="floor: kernels + copy of the Nx3 output")
    for r in rows:
        ax.annotate(r["scenario"], (r["descriptors"], r["baselines"]["numpy-batch"]), fontsize=7, xytext=(4, 4),
                    textcoords="offset points")
    ax.set_xlabel("descriptors per batch")
    ax.set_ylabel("plan latency, ms (median)")
    ax.set_title(f"Planning a batch, kvplan against the strongest host planner {card}".strip())
    ax.grid(True, which="both", linewidth=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(target)


if __name__ == "__main__":
    main()
