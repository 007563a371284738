"""The simulator's own plot: goodput against a swept value (engine-bench's plots are reused
for everything else)."""

from __future__ import annotations


def goodput(key: str, values: list, rates: list[float], out_dir, label: str = "") -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.6))
    numeric = all(isinstance(v, int | float) and not isinstance(v, bool) for v in values)
    xs = list(values) if numeric else list(range(len(values)))
    ax.plot(xs, rates, "o-", label=label or None)
    if not numeric:
        ax.set_xticks(xs, [str(v) for v in values])
    ax.set_xlabel(key)
    ax.set_ylabel("goodput (req/s)")
    ax.set_title(f"goodput vs {key}")
    if label:
        ax.legend()
    fig.tight_layout()
    path = out_dir / f"goodput_{key}.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return str(path)
