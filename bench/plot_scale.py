"""Draws bench/results/RESULTS-scale.png from the scale sweep's JSON (`bench/results/scale-results/LABEL.json`).

    python bench/plot_scale.py bench/results/scale-results/final.json [OTHER.json=AFTER_LABEL[,BEFORE_LABEL] ...]
    (needs matplotlib: not a rolloutd dependency; any venv that has it)

Three panels against the node count: rollouts/s (and the load offered), controller cores, and the
worst p99 of the node calls, one line per variant (before/after the fixes; a further file's "after"
points are drawn as LABEL).
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def main(*files: str) -> None:
    points = []
    for spec in files:
        path, _, labels = spec.partition("=")  # FILE=AFTER[,BEFORE]: its variants drawn under those labels
        after, _, before = labels.partition(",")
        names = {"after": after or "after", "before": before or "before"}
        for p in json.loads(Path(path).read_text())["points"]:
            variant = p.get("variant", "before")  # the first run (before.json) had one variant
            points.append({**p, "variant": names.get(variant, variant)})
    variants = list(dict.fromkeys(p["variant"] for p in points))
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.4))
    for variant, style in zip(variants, ("o--", "s:", "D-", "^-", "v-", "P-", "x:", "*-")):
        ps = sorted((p for p in points if p["variant"] == variant), key=lambda p: p["nodes"])
        n = [p["nodes"] for p in ps]
        axes[0].plot(n, [p["rollouts_per_s"] for p in ps], style, label=variant)
        axes[1].plot(n, [p["ctl_cores"] for p in ps], style, label=variant)
        axes[2].plot(n, [max(v for v in p["p99_ms"].values() if v == v) for p in ps], style, label=variant)  # not nan
    ps = sorted({p["nodes"]: p for p in points}.values(), key=lambda p: p["nodes"])
    axes[0].plot([p["nodes"] for p in ps], [p["offered_per_s"] for p in ps], "-", color="grey", lw=0.8, label="offered")
    axes[0].axhline(1000, color="red", lw=0.8, label="goal ≥ 1000/s at 1000 nodes")
    axes[1].axhline(1, color="red", lw=0.8, label="goal < 1 core")
    axes[2].axhline(50, color="red", lw=0.8, label="goal p99 ≤ 50 ms")
    for ax, title in zip(axes, ("rollouts/s sustained", "controller CPU (cores)", "worst p99 of lease/beat/results (ms)")):
        ax.set_xscale("log")
        ax.set_xlabel("simulated nodes × 64 slots")
        ax.set_title(title)
        ax.legend(fontsize=7)
        ax.grid(alpha=0.3)
    axes[0].set_yscale("log")
    axes[2].set_yscale("log")
    fig.tight_layout()
    out = Path(__file__).parent / "results" / "RESULTS-scale.png"
    fig.savefig(out, dpi=100)
    print(f"wrote {out}")


if __name__ == "__main__":
    main(*sys.argv[1:])
