"""Plots for the cache bench: hit rate (as a fraction of the optimal) vs KV budget, per policy."""
from __future__ import annotations

from typing import Any

_MARKERS = ("o", "s", "^", "D", "v")
_STYLES = ("-", "--", ":", "-.")


def plot_hit_rates(rows: list[dict[str, Any]], path: str, title: str = "") -> None:
    """One panel per workload; x = KV budget (fraction of distinct tokens), y = hit rate, one line
    per policy and a dashed line at the workload's optimal hit rate."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    workloads = list(dict.fromkeys(r["workload"] for r in rows))
    policies = list(dict.fromkeys(r["policy"] for r in rows))
    num_cols = min(3, len(workloads))
    num_rows = -(-len(workloads) // num_cols)
    fig, axes = plt.subplots(num_rows, num_cols, figsize=(4.2 * num_cols, 3.3 * num_rows), squeeze=False)
    for ax, workload in zip(axes.flat, workloads):
        mine = [r for r in rows if r["workload"] == workload]
        for num, policy in enumerate(policies):
            pts = sorted((r["budget"], r["hit_rate"]) for r in mine if r["policy"] == policy)
            # Policies often coincide: distinct markers, dashes and a small x shift keep all visible.
            shift = 0.008 * (num - (len(policies) - 1) / 2)
            ax.plot([p[0] + shift for p in pts], [p[1] for p in pts], marker=_MARKERS[num % len(_MARKERS)],
                    linestyle=_STYLES[num % len(_STYLES)], markersize=6 - num, label=policy)
        optimal = max(r["optimal_hit_rate"] for r in mine)
        ax.axhline(optimal, linestyle="--", color="gray", linewidth=1, label="optimal")
        ax.set_title(workload)
        ax.set_xlabel("KV budget (fraction of distinct tokens)")
        ax.set_ylabel("hit rate")
        ax.set_ylim(0, 1.0)
        ax.set_xticks(sorted({r["budget"] for r in mine}))
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(workloads):]:
        ax.axis("off")
    axes.flat[0].legend(fontsize=8, loc="lower right")
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_agent_trace(rows: list[dict[str, Any]], path: str, title: str = "") -> None:
    """Two panels over the KV budget: excess recompute (sessions on, off, and the LRU, online and Bélády replays of
    the sessions-on runs) and p99 turn latency (sessions on and off); a line per KV dtype where rows have several."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    dtypes = list(dict.fromkeys(r.get("kv_cache_dtype", "auto") for r in rows))
    fig, (left, right) = plt.subplots(1, 2, figsize=(9.5, 3.6))
    for dnum, dtype in enumerate(dtypes):
        of = f", KV {dtype}" if len(dtypes) > 1 else ""
        on, off = (sorted((r for r in rows if r["sessions"] == sessions and r.get("kv_cache_dtype", "auto") == dtype),
                          key=lambda r: r["budget"]) for sessions in (True, False))
        series = [(f"sessions on{of}", on, lambda r: r["excess"], "-"),
                  (f"sessions off (LRU){of}", off, lambda r: r["excess"], "-"),
                  (f"LRU replay{of}", on, lambda r: r["sim"]["lru"], ":"),
                  (f"online replay{of}", on, lambda r: r["sim"]["online"], "-."),
                  (f"Bélády replay{of}", on, lambda r: r["sim"]["belady"], "--")]
        for num, (label, rs, value, style) in enumerate(s for s in series if s[1]):
            left.plot([r["budget"] for r in rs], [value(r) for r in rs], marker=_MARKERS[(num + dnum) % len(_MARKERS)],
                      linestyle=style, label=label)
        lines = ((f"sessions on{of}", on), (f"sessions off (LRU){of}", off))
        for num, (label, rs) in enumerate(s for s in lines if s[1]):
            right.plot([r["budget"] for r in rs], [r["turn_p99_s"] for r in rs],
                       marker=_MARKERS[(num + dnum) % len(_MARKERS)], linestyle=_STYLES[dnum % len(_STYLES)],
                       label=label)
    left.set_xlabel("KV budget (fraction of the working set)")
    left.set_ylabel("excess recompute (tokens)")
    left.legend(fontsize=8)
    right.set_xlabel("KV budget (fraction of the working set)")
    right.set_ylabel("p99 turn latency (s)")
    right.set_ylim(bottom=0)
    right.legend(fontsize=8)
    for ax in (left, right):
        ax.set_xticks(sorted({r["budget"] for r in rows}))
        ax.grid(alpha=0.3)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
