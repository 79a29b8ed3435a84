"""What ``build-trees`` shows of its choice: a PNG of each bin's frontier and the printed summary table."""
from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from vllm_entmtp.calibrate.search import BinChoice
from vllm_entmtp.calibrate.signals import SIGNAL_LABEL, SIGNAL_UNIT
from vllm_entmtp.trees import NO_DRAFT_ID


def plot_frontiers(choices: list[BinChoice], path: Path, title: str = "") -> None:
    """PNG: per bin, expected tokens per step (bonus included) against measured cost for every budget's tree,
    the Pareto frontier as a line, the chosen tree starred (a hollow star: no tree beats plain decoding and this
    is the one scheduled anyway), "no drafting" at (1, 1) and the speed-up-1 line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(choices), figsize=(4.6 * len(choices), 4.2), squeeze=False)
    for ax, b in zip(axes[0], choices):
        xs = [c.cost for c in b.candidates]
        ys = [c.tokens_per_step for c in b.candidates]
        ax.scatter(xs, ys, color="0.55", s=18, label="greedy tree per budget")
        for c in b.candidates:
            ax.annotate(str(c.num_nodes), (c.cost, c.tokens_per_step), fontsize=7, xytext=(3, 2),
                        textcoords="offset points")
        fx = [1.0] + [c.cost for c in b.frontier]
        fy = [1.0] + [c.tokens_per_step for c in b.frontier]
        ax.plot(fx, fy, "-o", color="tab:blue", ms=4, label="Pareto frontier")
        ax.scatter([1.0], [1.0], marker="s", color="black", zorder=3, label="no drafting")
        top = max([1.0, *xs, *ys]) * 1.05
        ax.plot([0, top], [0, top], ":", color="tab:red", lw=1, label="speed-up 1")
        c = b.scheduled
        ax.scatter([c.cost], [c.tokens_per_step], marker="*", s=180, zorder=4,
                   color="tab:orange" if b.chosen is not None else "none", edgecolors="tab:orange",
                   label=(f"chosen: {c.num_nodes} nodes, x{c.speedup:.2f}" if b.chosen is not None else
                          f"scheduled, below 1: {c.num_nodes} nodes, x{c.speedup:.2f}"))
        ax.set_xlim(0.9, max([1.0, *xs]) * 1.05)
        ax.set_ylim(0.9, max([1.0, *ys]) * 1.05 + 0.05)
        ax.set_xlabel("cost per step (plain decode step = 1)")
        ax.set_ylabel("expected tokens per step (incl. bonus)")
        ax.set_title(f"bin {b.stats.index}: {SIGNAL_LABEL[b.stats.signal]} in {b.stats.range_str()} "
                     f"({SIGNAL_UNIT[b.stats.signal]}), {b.stats.positions} pos.", fontsize=9)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, loc="lower right")
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def summary_table(choices: list[BinChoice], bin_ids: Sequence[str]) -> str:
    """The printed summary: one row per bin (``bin_ids``: the tree id each bin is scheduled to)."""
    signal = choices[0].stats.signal if choices else "entropy"
    label = "entropy (nats)" if signal == "entropy" else "path confidence"
    head = (f"{'bin':>3}  {label:<17} {'positions':>9} {'mean ' + SIGNAL_LABEL[signal]:>7}  {'tree':<8} {'nodes':>5} "
            f"{'depth':>5} {'tok/step':>8} {'cost':>6} {'(verify+draft)':<15} {'speed-up':>8}")
    rows = [head, "-" * len(head)]
    notes = []
    for b, tid in zip(choices, bin_ids):
        c = b.scheduled
        if tid == NO_DRAFT_ID:
            rows.append(f"{b.stats.index:>3}  {b.stats.range_str():<17} {b.stats.positions:>9} "
                        f"{b.stats.mean_signal:>7.3f}  {'none':<8} {0:>5} {0:>5} {1.0:>8.3f} {1.0:>6.3f} "
                        f"{'':<15} {1.0:>8.3f}")
            notes.append(f"* bin {b.stats.index}: no tree beats plain decoding (best: {c.num_nodes} nodes, "
                         f"{c.tokens_per_step:.3f} tokens/step at cost {c.cost:.3f}, x{c.speedup:.3f}); it drafts "
                         "nothing")
            continue
        rows.append(f"{b.stats.index:>3}  {b.stats.range_str():<17} {b.stats.positions:>9} "
                    f"{b.stats.mean_signal:>7.3f}  {tid:<8} {c.num_nodes:>5} {max(map(len, c.paths)):>5} "
                    f"{c.tokens_per_step:>8.3f} {c.cost:>6.3f} ({c.verify_cost:.3f}+{c.draft_cost:.3f}){'':<2} "
                    f"{c.speedup:>8.3f}")
    rows.append("tok/step: expected tokens per step incl. the bonus token; cost: step time relative to a plain "
                "decode step; speed-up = tok/step / cost (no drafting = 1.000)")
    return "\n".join(rows + notes)
