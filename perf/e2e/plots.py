"""PNG of the end-to-end model: stacked per-group bars (both ends) and fps against core count."""

from __future__ import annotations

from pathlib import Path

from perf.e2e.components import GROUPS
from perf.e2e.run import E2EResult

__all__ = ["write_plots"]


def write_plots(r: E2EResult, out_dir: Path, stem: str = "e2e") -> list[Path]:
    """Stacked per-group bar (merged, two-pass, eager sharded and the peer at both ends) and fps vs cores."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(15, 5.5))
    variants = []
    for v, lab in (("merged", "merged"), ("two_pass", "two-pass"), ("merged_eager", "eager")):
        for end, e in (("pessimistic", "pess."), ("optimistic", "opt.")):
            variants.append((f"{lab}\n{e}", r.chunk(v, end)))
    for row in r.peer[:1]:
        for end, e in (("pessimistic", "pess."), ("optimistic", "opt.")):
            if end in row.chunks:
                variants.append((f"peer model\n{e}", row.chunks[end]))
    bottoms = [0.0] * len(variants)
    cmap = plt.get_cmap("tab20")
    colors = [cmap(i) for i in range(20)]
    for gi, g in enumerate(GROUPS):
        vals = [cm.by_group().get(g, 0.0) * 1e3 for _, cm in variants]
        if any(vals):
            ax1.bar(
                [v for v, _ in variants],
                vals,
                bottom=bottoms,
                label=g,
                color=colors[(2 * gi) % 20 + (2 * gi) // 20],
            )
            bottoms = [b + v for b, v in zip(bottoms, vals)]
    prm = r.params
    deadline = r.chunk("merged", "optimistic").video_frames / prm.target_fps * 1e3
    ax1.axhline(deadline, color="k", ls="--", lw=1, label=f"{prm.target_fps:.0f} fps deadline")
    if r.peer and r.peer[0].measured is not None:
        pm = r.peer[0].measured
        ax1.axhline(12 / pm.fps * 1e3, color="m", ls=":", lw=1.2, label=f"peer measured {pm.fps:g} fps")
    ax1.set_ylabel("modelled ms per chunk")
    ax1.tick_params(axis="x", labelsize=7)
    ax1.set_title(f"{r.model.name} {r.height}x{r.width}, {r.cores} cores (MODELLED)")
    ax1.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    pts = [(c, d) for c, _, d in r.scaling if d]
    cs = [c for c, _ in pts]
    for end, style in (("pessimistic", "o-"), ("optimistic", "s--")):
        ax2.plot(cs, [d[end][0] for _, d in pts], style, label=f"end to end, {end}")
    ax2.axhline(prm.target_fps, color="k", ls="--", lw=1)
    ax2.set_xscale("log", base=2)
    if cs:
        ax2.set_xticks(cs, [str(c) for c in cs])
    ax2.set_xlabel("NeuronCore-v3 cores (16 = 2 chips)")
    ax2.set_ylabel("modelled fps")
    ax2.set_title("modelled fps vs cores (merged forward)")
    ax2.legend()
    fig.tight_layout()
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{stem}.png"
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return [path]
