"""What the results page's suites share: figures in MiB, the variants'
colours, saving a plot (`benchmarks.report` assembles the page; each
suite's module draws its own tables and plots with these)."""
from __future__ import annotations

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402,F401  (the suites plot with it)

MIB = 2 ** 20
COLORS = {"zero-0": "#9ecae1", "zero-1": "#6baed6", "zero-2": "#3182bd",
          "zero-3": "#08519c", "plain-dp": "#969696", "gspmd-fsdp": "#e6550d",
          "1dev-zero-0": "#9ecae1", "1dev-zero-3": "#08519c",
          "1dev-optax": "#969696"}


def mib(x) -> str:
  return "—" if x is None else f"{x / MIB:,.2f}"


def bar_colors(names):
  return [COLORS.get(n, "#756bb1") for n in names]


def save(fig, path: str):
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)


def finish_line_plot(fig, ax, path: str):
  ax.legend(fontsize=8)
  ax.grid(alpha=0.3)
  save(fig, path)


def memory_table(memory: dict) -> list:
  """Persistent bytes per device against theory, and the compiled step's
  footprint, per variant (the hybrid and tensor-parallel suites)."""
  lines = ["", "| variant | persistent per device | theory | compiled "
           "step footprint |", "|---|---:|---:|---:|"]
  for label, m in memory.items():
    lines.append(f"| {label} | {mib(m['persistent'])} | {mib(m['theory'])} "
                 f"| {mib(m['compiled'])} |")
  return lines
