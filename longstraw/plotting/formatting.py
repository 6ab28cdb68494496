"""How a table value reads: every number with its unit (GiB/MiB, s, positions), the unit chosen
from the column's name, so the aggregated data and the page can never disagree about units."""

from __future__ import annotations

import json
import numbers

import numpy as np
import pandas as pd

_BINARY = ((2**40, "TiB", 3), (2**30, "GiB", 3), (2**20, "MiB", 2), (2**10, "KiB", 1))
_POSITION_COLUMNS = {
    "prompt_length",
    "positions",
    "prompt_positions",
    "largest_fitting",
    "smallest_oom",
    "first_failing",
    "response_length",
    "prompt.length",
    "responses.length",
    "replayed_tokens",
}
_COUNT_COLUMNS = {
    "G",
    "grpo.num_generations",
    "cycles",
    "replays",
    "trainable_parameters",
    "probes",
    "probes_ok",
    "probes_oom",
    "count",
    "step",
    "steps",
    "steps_ok",
    "steps_oom",
}
# Relative drifts (a fraction in the data) read as percent on the page: the paper states its
# staleness drift in percent.
_PERCENT_COLUMNS = {"drift_threshold"}
# Losses, log-probabilities and drifts move in the 4th-6th digit between two steps (5.5591 against
# 5.5594): they get 6 significant digits where other numbers get 4.
_PRECISE_PARTS = ("loss", "logprob", "kl_k3", "drift")
PRECISE_DIGITS, DIGITS = 6, 4
# The paper writes GB (10^9 bytes): sizes from 1 GiB up read in GB too, beside the binary unit.
DECIMAL_FROM = 2**30
# An axis of sizes is linear from zero unless its largest value is more than this many times the
# median (`draw.log_scale`): bars under a 25th of the axis read as nothing (a CPU step's MiB under a
# machine's GiB of RAM). The median, not the smallest: one small bar among large ones (the weights
# beside a replay) is data, not a reason for a log axis.
LOG_SPAN = 25
MISSING = "—"


def is_missing(value) -> bool:
    """None, NaN, pd.NA / NaT: a value the point does not have (an error point, a CPU-only key)."""
    if value is None:
        return True
    if np.ndim(value) != 0:
        return False
    try:
        return bool(pd.isna(value))
    except (TypeError, ValueError):
        return False


def is_nested(value) -> bool:
    """A list or dict setting, as a row or a table holds it (the tables keep it as compact JSON text)."""
    if isinstance(value, str) and value[:1] in ("{", "["):
        try:
            value = json.loads(value)
        except ValueError:
            return False
    return isinstance(value, (dict, list))


def column_unit(column: str) -> str:
    """bytes | bytes_per_position | seconds | positions_per_second | tflops_per_second | positions | count |
    percent | cosine | ratio | precise | plain."""
    name = column.rsplit(".", 1)[-1] if column not in _POSITION_COLUMNS | _COUNT_COLUMNS else column
    if name in _PERCENT_COLUMNS or "relative_loss_drift" in name:
        return "percent"
    if name.endswith("grad_cosine") and not name.startswith("one_minus"):
        return "cosine"
    if name.endswith("tflops_per_second"):
        return "tflops_per_second"
    if "bytes_per_position" in name:
        return "bytes_per_position"
    if name.endswith("bytes") or "bytes" in name.split("_"):
        return "bytes"
    if name == "positions_per_second":
        return "positions_per_second"
    if column in _POSITION_COLUMNS or name.endswith("_length"):
        return "positions"
    if "seconds" in name:
        return "seconds"
    if column in _COUNT_COLUMNS or name.endswith("_count"):
        return "count"
    if "ratio" in name:
        return "ratio"
    if any(part in name for part in _PRECISE_PARTS):
        return "precise"
    return "plain"


_HEADER_UNITS = {
    "positions": " (positions)",
    "positions_per_second": " (positions/s)",
    "tflops_per_second": " (TFLOP/s)",
    "count": "",
    "bytes_per_position": " (per position)",
}


def column_label(column: str) -> str:
    return column + _HEADER_UNITS.get(column_unit(column), "")


def format_bytes(value, decimal_from: float = DECIMAL_FROM) -> str:
    """The binary unit that fits ("24.883 GiB"), and from `decimal_from` bytes up the same size in GB
    beside it ("24.883 GiB (26.718 GB)"), to the paper's 3 decimals."""
    if is_missing(value):
        return MISSING
    value = float(value)
    text = next(
        (f"{value / scale:,.{digits}f} {unit}" for scale, unit, digits in _BINARY if abs(value) >= scale),
        f"{value:,.0f} B",
    )
    return text + (f" ({value / 1e9:,.3f} GB)" if abs(value) >= decimal_from else "")


def format_seconds(value) -> str:
    if is_missing(value):
        return MISSING
    value = float(value)
    if abs(value) >= 100:
        return f"{value:,.1f} s"
    if abs(value) >= 0.01 or value == 0:
        return f"{value:.3f} s"
    return f"{value * 1e3:.3f} ms"


def format_number(value, digits: int = DIGITS) -> str:
    """Integers with thousands separators; floats to `digits` significant digits."""
    if is_missing(value):
        return MISSING
    if isinstance(value, (bool, np.bool_)):
        return "yes" if value else "no"
    if isinstance(value, numbers.Integral) or (isinstance(value, float) and value.is_integer() and abs(value) < 1e15):
        return f"{int(value):,}"
    return f"{float(value):.{digits}g}"


def format_percent(value) -> str:
    """A fraction as percent, 3 significant digits (never rounded to 0 when it is not 0)."""
    if is_missing(value):
        return MISSING
    return f"{float(value) * 100:.3g}%"


def format_value(column: str, value) -> str:
    if is_missing(value):
        return MISSING
    if isinstance(value, (bool, np.bool_)):
        return "yes" if value else "no"
    if not isinstance(value, numbers.Number):
        return str(value)
    unit = column_unit(column)
    if unit == "bytes":
        return format_bytes(value)
    if unit == "bytes_per_position":
        return format_bytes(value) + "/position"
    if unit == "seconds":
        return format_seconds(value)
    if unit == "positions_per_second":  # 4 significant digits at least: a tiny CPU capture runs at tens per second
        return f"{float(value):,.0f} positions/s" if abs(value) >= 1000 else f"{float(value):.4g} positions/s"
    if unit == "tflops_per_second":
        return f"{float(value):,.1f} TFLOP/s"
    if unit == "ratio":
        return f"{float(value):.4f}"
    if unit == "percent":
        return format_percent(value)
    if unit == "cosine":  # near 1: six decimals, so 0.99999 is not shown as 1
        return f"{float(value):.6f}"
    return format_number(value, PRECISE_DIGITS if unit == "precise" else DIGITS)


def exact_value(value) -> str | None:
    """The exact number behind a cell (for data-value): integral floats as ints, others by repr."""
    if is_missing(value) or isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Number):
        return None
    if isinstance(value, float) and value.is_integer() and abs(value) < 2**53:
        return str(int(value))
    return repr(value) if isinstance(value, float) else str(int(value))
