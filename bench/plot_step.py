#!/usr/bin/env python3
"""Plots bench/results/step.csv (written by `step_bench --csv`) as a PNG a user would rather look at
than read: per (H, q) panel, µs per step against batch rows for each context, fused (solid) against
the floor (dotted), the stock composition with our core (dashed) and with a stock attention
(dash-dot, where the sweep ran it). Needs matplotlib (present on the H200 image).

    python3 bench/plot_step.py bench/results/step.csv bench/results/step.png [DEVICE]

DEVICE (default "H200") names the GPU the CSV was measured on, in the title.
"""
import csv
import sys
from collections import defaultdict

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def main(csv_path: str, png_path: str, device: str = "H200") -> None:
    # Uniform-context rows only: a varlen row (step_bench --shape ...v) has no curve of its own here.
    rows = [r for r in csv.DictReader(open(csv_path)) if r.get("varlen", "0") in ("", "0")]
    panels = sorted({(int(r["heads"]), int(r["q"])) for r in rows})
    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 4.5), squeeze=False)
    colors = {4096: "tab:blue", 32768: "tab:orange", 131072: "tab:green"}
    for ax, (heads, q) in zip(axes[0], panels):
        series = defaultdict(list)
        for r in rows:
            if int(r["heads"]) == heads and int(r["q"]) == q:
                series[int(r["context"])].append(r)
        for context, points in sorted(series.items()):
            points.sort(key=lambda r: int(r["rows"]))
            x = [int(r["rows"]) for r in points]
            color = colors.get(context, None)
            label = f"{context // 1024}k"
            ax.plot(x, [float(r["fused_us"]) for r in points], "-o", color=color, label=f"fused {label}")
            ax.plot(x, [float(r["floor_us"]) for r in points], ":", color=color, label=f"floor {label}")
            ax.plot(x, [float(r["stock_us"]) for r in points], "--", color=color, alpha=0.6, label=f"stock {label}")
            # The stock composition with a stock attention, where the sweep ran it (older CSVs lack it).
            attention = [(int(r["rows"]), float(r["stock_attention_us"])) for r in points if r.get("stock_attention_us")]
            if attention:
                ax.plot([a for a, _ in attention], [b for _, b in attention], "-.", color=color, alpha=0.5,
                        label=f"stock attention {label}")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("batch rows")
        ax.set_ylabel("µs per decode step")
        ax.set_title(f"H = {heads}, q = {q}")
        ax.grid(True, which="both", alpha=0.3)
    axes[0][0].legend(fontsize=7, ncol=3)
    fig.suptitle(f"mla-decode whole step on one {device}: fused vs floor vs stock composition")
    fig.tight_layout()
    fig.savefig(png_path, dpi=110)


if __name__ == "__main__":
    if len(sys.argv) not in (3, 4):
        sys.exit("usage: plot_step.py STEP_CSV OUT_PNG [DEVICE]")
    main(*sys.argv[1:])
