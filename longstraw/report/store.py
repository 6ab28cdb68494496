"""Tables on disk: one CSV per table and `manifest.json` beside them, so each later stage (figures,
page) reads exactly the values the tables stage computed, and never a result file.

The manifest lists every table written (a stage reads only what it lists, never a stale CSV left by
an earlier run), with each column's pandas dtype and how its cells are written: `int`, `float` (by
repr, which reads back to the same double), `bool`, `text`, or `json` (an object column that holds
anything but non-empty text, e.g. numbers beside strings). An empty cell is a missing value. It
also carries what the stages share beyond tables (`meta`: the results folder, the profile, the
memory ceiling, the targets' state).

    write_tables({"g_sweep": df}, "results/cpu/tables", {"profile": "cpu"})
    tables = read_tables("results/cpu/tables"); tables.frame("g_sweep")
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pandas as pd

from longstraw.results import atomic_path, write_json_atomic

MANIFEST = "manifest.json"


def _missing(value) -> bool:
    return value is None or (np.ndim(value) == 0 and bool(pd.isna(value)))


def _cells(series: pd.Series) -> str:
    """How a column's cells are written (see the module doc)."""
    dtype = series.dtype.kind  # numpy's one-letter code
    if dtype in "iu":
        return "int"
    if dtype == "f":
        return "float"
    if dtype == "b":
        return "bool"
    present = [v for v in series if not _missing(v)]
    return "text" if all(isinstance(v, str) and v for v in present) else "json"


def _encode(value, cells: str) -> str:
    if _missing(value):
        return ""
    if cells == "int":
        return str(int(value))
    if cells == "float":
        return repr(float(value))
    if cells == "bool":
        return "True" if value else "False"
    if cells == "text":
        return value
    return json.dumps(value.item() if isinstance(value, np.generic) else value)


def _decode(text: str, cells: str):
    if text == "":
        return None
    if cells == "int":
        return int(text)
    if cells == "float":
        return float(text)
    if cells == "bool":
        return text == "True"
    if cells == "text":
        return text
    return json.loads(text)


def write_table(df: pd.DataFrame, path) -> dict:
    """Write one table as CSV atomically; returns its manifest entry (file, rows, columns)."""
    path = Path(path)
    columns = [{"name": str(c), "dtype": str(df[c].dtype), "cells": _cells(df[c])} for c in df.columns]
    encoded = pd.DataFrame(
        {c["name"]: [_encode(v, c["cells"]) for v in df[name]] for c, name in zip(columns, df.columns)},
        columns=[c["name"] for c in columns],
    )
    with atomic_path(path) as tmp:
        encoded.to_csv(tmp, index=False)
    return {"file": path.name, "rows": len(df), "columns": columns}


def write_tables(frames: dict[str, pd.DataFrame], out_dir, meta: dict) -> dict:
    """`<name>.csv` per table and the manifest, each written atomically; returns the manifest."""
    out_dir = Path(out_dir)
    manifest = {**meta, "tables": {name: write_table(df, out_dir / f"{name}.csv") for name, df in frames.items()}}
    write_json_atomic(out_dir / MANIFEST, manifest)
    return manifest


def read_table(path, entry: dict) -> pd.DataFrame:
    """A table as written: the same columns, dtypes and values."""
    columns = entry["columns"]
    if not columns:
        return pd.DataFrame(index=range(entry.get("rows", 0)))
    raw = pd.read_csv(path, dtype=str, keep_default_na=False, na_filter=False)
    data = {}
    for column in columns:
        values = pd.Series([_decode(text, column["cells"]) for text in raw[column["name"]]], dtype=object)
        data[column["name"]] = values if column["dtype"] == "object" else values.astype(column["dtype"])
    return pd.DataFrame(data, columns=[c["name"] for c in columns])


@dataclass
class Tables:
    """A tables folder: its manifest, and each table read once, when asked for."""

    folder: Path
    manifest: dict
    _frames: dict = field(default_factory=dict, repr=False)

    @property
    def names(self) -> list[str]:
        return list(self.manifest["tables"])

    def frame(self, name: str) -> pd.DataFrame | None:
        """The table, or None where the manifest lists none of that name."""
        entry = self.manifest["tables"].get(name)
        if entry is None:
            return None
        if name not in self._frames:
            self._frames[name] = read_table(self.folder / entry["file"], entry)
        return self._frames[name]

    def files(self) -> list[Path]:
        return [self.folder / entry["file"] for entry in self.manifest["tables"].values()]


def read_tables(folder) -> Tables:
    """The tables a folder's manifest lists (a missing manifest raises FileNotFoundError)."""
    folder = Path(folder)
    return Tables(folder, json.loads((folder / MANIFEST).read_text()))
