"""Table output for the CLI: rich when installed, plain aligned text otherwise."""

from __future__ import annotations

from collections.abc import Sequence


def print_table(title: str, columns: Sequence[str], rows: Sequence[Sequence[object]]) -> None:
    """Print ``rows`` under ``columns``; numbers right-aligned."""
    cells = [[str(value) for value in row] for row in rows]
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:
        widths = [max([len(c), *(len(r[i]) for r in cells)]) for i, c in enumerate(columns)]
        print(title)
        print("  ".join(c.ljust(w) for c, w in zip(columns, widths)))
        print("  ".join("-" * w for w in widths))
        for row in cells:
            print("  ".join(v.rjust(w) if _numeric(v) else v.ljust(w) for v, w in zip(row, widths)))
        return
    table = Table(title=title)
    for i, column in enumerate(columns):
        numeric = bool(cells) and all(_numeric(row[i]) for row in cells)
        table.add_column(column, justify="right" if numeric else "left")
    for row in cells:
        table.add_row(*row)
    Console().print(table)


def _numeric(text: str) -> bool:
    return text.replace(",", "").replace(".", "", 1).replace("x", "", 1).lstrip("-").isdigit()


def human_bytes(n: int) -> str:
    """1536 -> '1.5 KiB'; sizes past a billion GiB (only a huge growth factor gives them) in E notation."""
    if n >= 1 << 60:
        from decimal import Decimal

        return f"{Decimal(n) / (1 << 30):.2E} GiB"
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if value < 1024 or unit == "GiB":
            return f"{value:.1f} {unit}" if unit != "B" else f"{int(value)} B"
        value /= 1024
    return f"{value:.1f} GiB"
