"""Figures of bench records (matplotlib, Agg backend): the SmartSpec figure, mean latency vs request
rate, one line per policy, one panel per workload; one figure per proposer. Closed-loop records
give mean latency vs concurrency the same way."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

STYLE = {"none": ("black", "o"), "fixed:1": ("tab:blue", "v"), "fixed:3": ("tab:cyan", "^"),
         "fixed:5": ("tab:purple", "s"), "table": ("tab:olive", "D"), "heuristic": ("tab:brown", "x"),
         "goodput": ("tab:red", "*"), "goodput-per-request": ("tab:orange", "P")}


def plot_records(records: list[dict], out_dir: str | Path, prefix: str = "bench") -> list[str]:
    """Write `{prefix}_latency_{proposer}.png` per proposer; returns the paths."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    records = [r for r in records if "mean_latency_s" in r]
    xkey = "rate" if any(r.get("mode") == "open" for r in records) else "concurrency"
    paths = []
    for proposer in sorted({r["proposer"] for r in records}):
        rows = [r for r in records if r["proposer"] == proposer]
        workloads = list(dict.fromkeys(r["workload"] for r in rows))
        fig, axes = plt.subplots(1, len(workloads), figsize=(3.6 * len(workloads), 3.2), squeeze=False)
        for ax, w in zip(axes[0], workloads):
            for policy in dict.fromkeys(r["policy"] for r in rows if r["workload"] == w):
                pts = sorted((r[xkey], r["mean_latency_s"]) for r in rows
                             if r["workload"] == w and r["policy"] == policy)
                color, marker = STYLE.get(policy, (None, "."))
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker=marker, color=color, label=policy,
                        linewidth=2.2 if policy.startswith("goodput") else 1.2)
            ax.set_title(w)
            ax.set_xlabel("request rate (req/s)" if xkey == "rate" else "concurrency")
            ax.grid(alpha=0.3)
        axes[0][0].set_ylabel("mean latency (s)")
        axes[0][-1].legend(fontsize=7)
        fig.suptitle(f"mean latency vs {'request rate' if xkey == 'rate' else 'concurrency'} — proposer {proposer}")
        fig.tight_layout()
        path = out_dir / f"{prefix}_latency_{proposer}.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(str(path))
    return paths
