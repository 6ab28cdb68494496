"""Experiment kinds, one registry: each `kinds/<kind>.py` declares its kind as one `Kind`
(`longstraw.kinds.spec`: its config section, plan-time checks, run and report parts) and is
registered here, once. The kinds' names, the point config's class (one optional section per kind)
and the experiment schema's `kind` enum all derive from the registry. The report reaches a kind's parts
through `part` and `contributed`, and the columns every point's row has through `common_columns`.

    kinds.get("step").run(cfg, device, progress)
    kinds.part(row["kind"], "columns")(point)     # a kind this package does not know: the empty part
"""

from __future__ import annotations

from longstraw.config.point import PointConfig, point_class, resolve_with
from longstraw.kinds import (
    agent,
    capacity,
    capture,
    learning,
    length_curve,
    pretrain,
    staleness,
    step,
    sweep,
    validation,
)
from longstraw.kinds.columns import common_columns
from longstraw.kinds.spec import UNKNOWN, Kind

__all__ = [
    "common_columns",
    "contributed",
    "get",
    "names",
    "names_with",
    "part",
    "point_config_class",
    "register",
    "resolve_point",
    "sections",
    "unregister",
]

_KINDS: dict[str, Kind] = {}


def register(kind: Kind) -> Kind:
    """Add a kind (its name new): its section joins the point config class (`point_config_class`)."""
    if kind.name in _KINDS:
        raise ValueError(f"kind {kind.name!r} is registered already")
    _KINDS[kind.name] = kind
    return kind


def unregister(name: str) -> None:
    """Remove a kind registered at run time (a test's)."""
    del _KINDS[name]


for _module in (step, capture, capacity, sweep, staleness, validation, pretrain, length_curve, learning, agent):
    register(_module.KIND)


def names() -> tuple[str, ...]:
    """Every kind's name, in registration order (the order of a section's tables and figures)."""
    return tuple(_KINDS)


def get(name) -> Kind | None:
    """The kind, or None for one this package does not know."""
    return _KINDS.get(name)


def part(name, attribute: str):
    """One part of a kind, or the empty part of a kind this package does not know."""
    return getattr(_KINDS.get(name, UNKNOWN), attribute)


def sections() -> dict[str, type]:
    """{kind: its section's type} of the kinds with a section of their own."""
    return {k.name: k.section for k in _KINDS.values() if k.section is not None}


def point_config_class() -> type[PointConfig]:
    """The point config of the registered kinds: the shared settings, `kind` one of `names()`, and one optional
    section per kind that has one."""
    return point_class(names(), tuple(sections().items()))


def resolve_point(raw, source: str = "config") -> PointConfig:
    """A point config from its mapping (`config.point.resolve_with`), its kind one of the registered kinds."""
    return resolve_with(point_config_class(), raw, source)


def contributed(name: str):
    """A part one kind offers other report sections (`Kind.contributes`), or None when no kind offers it."""
    return next((k.contributes[name] for k in _KINDS.values() if name in k.contributes), None)


def names_with(attribute: str) -> list[str]:
    """The kinds whose `attribute` is set (a message naming the kinds a setting applies to)."""
    return [k.name for k in _KINDS.values() if getattr(k, attribute) not in (None, False)]
