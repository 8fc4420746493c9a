"""Plots as PNG files, rendered by us with matplotlib.

``dvc plots show`` writes HTML that loads vega from the web, so offline it is blank (docs/design.md §3); a PNG of the
same CSV is what lands in MLflow and what ``splatflow plots`` writes next to the CSV.
"""

from __future__ import annotations

from pathlib import Path


def render_csv_png(csv_path: str | Path, png_path: str | Path, *, x: str = "step", title: str | None = None,
                   max_panels: int = 9) -> Path:
    """One panel per numeric column of ``csv_path`` against ``x`` (the row index when absent) -> ``png_path``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import pandas as pd

    csv_path, png_path = Path(csv_path), Path(png_path)
    df = pd.read_csv(csv_path)
    if df.empty:
        raise ValueError(f"{csv_path}: no rows to plot")
    xs = df[x] if x in df.columns else pd.Series(range(len(df)), name="row")
    cols = [c for c in df.columns if c != x and pd.api.types.is_numeric_dtype(df[c])][:max_panels]
    if not cols:
        raise ValueError(f"{csv_path}: no numeric columns to plot")
    ncols = min(3, len(cols))
    nrows = (len(cols) + ncols - 1) // ncols
    fig, axes = plt.subplots(nrows, ncols, figsize=(4.2 * ncols, 3.0 * nrows), squeeze=False)
    for ax, col in zip(axes.flat, cols):
        ax.plot(xs, df[col], lw=1.2)
        ax.set_title(col, fontsize=10)
        ax.set_xlabel(xs.name)
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(cols):]:
        ax.axis("off")
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    png_path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png_path, dpi=100)
    plt.close(fig)
    return png_path
