"""Bar chart of a bench result: eager, ours and the floor per case (log scale).

    python benchmarks/plot.py RESULT.json [OUT.png]
"""

from __future__ import annotations

import json
import sys


def plot(rows, path):
    # Profile summaries repeat timings of the cases they explain; they are not plotted.
    shown = [r for r in rows if r.get("eager_ms") and r.get("ours_ms")
             and not str(r.get("case", "")).startswith("profile_")]
    if not shown:
        return
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(max(6, 1.2 * len(shown)), 4.2))
    x = list(range(len(shown)))
    width = 0.27
    ax.bar([i - width for i in x], [r["eager_ms"] for r in shown], width, label="eager")
    ax.bar(x, [r["ours_ms"] for r in shown], width, label="plugin (graph)")
    ax.bar([i + width for i in x], [r["floor_ms"] or 0 for r in shown], width, label="floor")
    for i, r in enumerate(shown):
        ax.annotate(f"{r['speedup']:.2f}x", (i, r["ours_ms"]), ha="center", va="bottom",
                    fontsize=7)
    ax.set_xticks(x, [r["case"] for r in shown], rotation=25, ha="right", fontsize=7)
    ax.set_ylabel("ms (per token / per cached step)")
    ax.set_yscale("log")
    ax.set_title("H200, random weights at real layer shapes (bf16)", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    src = sys.argv[1]
    out = sys.argv[2] if len(sys.argv) > 2 else src.rsplit(".", 1)[0] + ".png"
    with open(src) as f:
        plot(json.load(f)["cases"], out)
    print(out)
