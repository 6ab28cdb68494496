"""Experiment kinds: one module per kind (`KINDS`, named in the experiment schema) owns everything
about a point of that kind, how it runs and how it is reported.

Plan half (`longstraw.harness.plan.resolve`, before any work):
- `check(cfg, source)`: the kind's own section checked through to the names and tasks it uses (a
  `ConfigError` naming the source and key); the settings every kind shares are the plan's.

Run half (imports torch inside `run`, so reporting stays free of torch):
- `run(cfg, device, progress) -> metrics`: the point's measurement (`longstraw.harness.runner`).

Report half (plain Python; matplotlib only inside `figures`):
- `columns(point) -> dict`: the kind's cells of the point's row in the experiment's table;
- `tables(points) -> {suffix: rows}`: tables of their own (`<experiment>.<suffix>.csv`), e.g. a
  sweep's steps, with `EXTRA_TABLES[suffix]` saying how the page shows each (`ExtraTable`);
- `SHOWN`: the columns the page's table shows, in order (the CSV has them all);
- `notes(row, grid) -> [sentence]`: what a row cannot say in one cell;
- `figures(data, ceiling, marks) -> (name, figure)...` with `CAPTIONS[name]`: the figures the
  experiment's tables support (`columns.ExperimentData`).

A kind without one of these has none (`part` gives the empty default); a kind this package does
not know (a result from a later version) gets the report's generic table.
"""

from __future__ import annotations

import importlib
import types

from longstraw.config.point import KINDS

_EMPTY = {
    "check": lambda cfg, source: None,
    "columns": lambda point: {},
    "tables": lambda points: {},
    "notes": lambda row, grid: [],
    "figures": lambda data, ceiling, marks: (),
    "EXTRA_TABLES": {},
    "SHOWN": None,
    "CAPTIONS": {},
}


def module(kind):
    """The kind's module, or None for a kind this package does not know."""
    return importlib.import_module(f"longstraw.kinds.{kind}") if kind in KINDS else None


def modules() -> list:
    """Every kind's module, in `KINDS` order (the order of a section's tables and figures)."""
    return [module(kind) for kind in KINDS]


def part(kind_or_module, name: str):
    """One part of a kind (see the module doc), or its empty default."""
    mod = kind_or_module if isinstance(kind_or_module, types.ModuleType) else module(kind_or_module)
    return getattr(mod, name, _EMPTY[name]) if mod is not None else _EMPTY[name]
