"""What of a long table the page shows; the CSV beside the page keeps every row and column.

- `run_ends`: in a kind's table, a run of more than LONG rows (a training run's steps, a pretraining curve: its
  figure draws the curve) shows its first and last row.
- `repeated_columns`: a column equal to an earlier one in every row of a long table (a pretraining curve's
  `loss` where the loss is the answer's alone) is left out; the page names it under the table.
- `column_parts`: a table of more than WIDE columns is drawn as tables of fewer, one under the other, each
  beginning with the point's column, so that none is wider than the page.
"""

from __future__ import annotations

import math

from longstraw.plotting.formatting import exact_value, is_missing

LONG = 16  # rows of a table the page shows open, and of a run it shows whole: about a screen
RUN_KEYS = ("point", "run")  # what names a run: the point, and a run of a point that trains several
WIDE = 14  # columns that fit the page's width at 1,400 px, their cells wrapping
# rows over which two equal columns are one quantity: over a few points they may coincide (a first update's
# drift and step 1's, where the first update is step 1)
REPEATS_FROM = LONG


def run_ends(rows: list[dict]) -> tuple[list[dict], str]:
    """(the rows to show, in table order; how they were chosen, "" for all of them): a run (its point, and its
    run where a point trains several) of more than LONG rows is a curve, its figure draws it: its first and last
    row; a shorter run whole."""
    keys = [k for k in RUN_KEYS if any(not is_missing(r.get(k)) for r in rows)]
    runs: dict[tuple, list[int]] = {}
    for i, row in enumerate(rows):
        runs.setdefault(tuple(str(row.get(k)) for k in keys), []).append(i)
    shown = sorted(i for run in runs.values() for i in (run if len(run) <= LONG else (run[0], run[-1])))
    if len(shown) == len(rows):
        return rows, ""
    return [rows[i] for i in shown], f"a run ({' and '.join(keys)}) of more than {LONG} rows shows its first and last"


def _cell(row: dict, column: str):
    value = row.get(column)
    return None if is_missing(value) else (exact_value(value) or str(value))


def repeated_columns(rows: list[dict], columns: list[str]) -> dict[str, str]:
    """{column: the earlier column it equals in every row} among `columns` (the point and status always shown),
    for tables of REPEATS_FROM rows or more."""
    if len(rows) < REPEATS_FROM:
        return {}
    cells = {c: [_cell(r, c) for r in rows] for c in dict.fromkeys(columns)}
    out: dict[str, str] = {}
    kept: list[str] = []
    for column, values in cells.items():
        twin = next(
            (k for k in kept if cells[k] == values),
            None,
        )
        if twin is not None and column not in ("point", "status") and any(v is not None for v in values):
            out[column] = twin
        else:
            kept.append(column)
    return out


def column_parts(columns: list[str]) -> list[list[int]]:
    """The indices of `columns` each part of the table shows: one part up to WIDE columns, else as few parts of
    about equal width as keep each under WIDE with the point's column first in every part."""
    if len(columns) <= WIDE:
        return [list(range(len(columns)))]
    lead = [columns.index("point")] if "point" in columns else []
    rest = [i for i in range(len(columns)) if i not in lead]
    count = math.ceil(len(rest) / (WIDE - len(lead)))
    size = math.ceil(len(rest) / count)
    return [lead + rest[i : i + size] for i in range(0, len(rest), size)]
