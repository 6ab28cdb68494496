"""The peers, looked up by their mode name: one `Peer` each, registered with `register_peer`.

A `Peer` is plain data (no torch, no peer package), so the plan and the report read it without importing
either: what it needs installed, the model types it applies to, the class that runs its step (loaded only
when `build_peer` builds one), and what the report says and draws for it.

Registering a peer also makes its name a mode a point config accepts (`longstraw.config.point.PEER_MODES`)
and gives it its colour in every figure (`longstraw.plotting.styles.MODE_COLORS`): both sit below the peers,
so the registry hands them the name and the colour.
"""

from __future__ import annotations

import importlib
import importlib.util
from dataclasses import dataclass
from typing import Protocol

from longstraw.config import point
from longstraw.plotting import styles

INSTALL = 'pip install -e ".[peers]"'


class PeerStep(Protocol):
    """What a peer's step class provides (`Peer.step` names it): built once per point on the model, with our
    objective (`longstraw.core.grpo.GRPOConfig`) and the longest response it will see; `step` runs one GRPO
    step on one group and returns `grpo_step`'s metrics (`longstraw.peers.measured.measured_step`)."""

    def __init__(self, model, config, max_response_length: int): ...

    def step(self, prompt_ids, responses, rewards, optimizer) -> dict: ...


@dataclass(frozen=True)
class Peer:
    """One peer: its mode, what it needs and applies to, its step, and what the report says and draws."""

    name: str  # its mode in a point config
    step: str  # "module:Class" of its `PeerStep`, imported when a step is built (torch and the peer's package)
    difference: str  # the report's first sentence about it: what it does differently from our modes
    color: str  # its lines and bars in the figures
    requirement: str | None = None  # the pinned distribution it runs (pyproject's `peers` extra); None: none
    import_name: str | None = None  # that distribution's import name, looked for before any work
    model_types: tuple[str, ...] | None = None  # the HF model types it applies to; None: every one
    why_not: str = ""  # why it does not apply to another model type (said by the plan and the report)
    label: str = ""  # its name in the report's sentences and legends; empty: `name`

    @property
    def shown(self) -> str:
        """What the report calls it."""
        return self.label or self.name


_PEERS: dict[str, Peer] = {}
PEER_MODES = _PEERS.keys()  # the registered peers' names, in registration order (a live view)


class PeerNotApplicable(ValueError):
    """The peer does not apply to this model (said before any work)."""


def register_peer(peer: Peer) -> Peer:
    """Add `peer`: its name becomes a point config's mode, its colour the figures' for that mode."""
    taken = (*point.OUR_MODES, *_PEERS)
    if peer.name in taken:
        raise ValueError(f"peer {peer.name!r}: the mode name is taken ({', '.join(taken)})")
    _PEERS[peer.name] = peer
    point.PEER_MODES.append(peer.name)
    styles.MODE_COLORS[peer.name] = peer.color
    return peer


def unregister_peer(name: str) -> None:
    """Remove the peer `name` (a peer registered for a test)."""
    del _PEERS[name]
    point.PEER_MODES.remove(name)
    del styles.MODE_COLORS[name]


def peer(name: str) -> Peer:
    if name not in _PEERS:
        raise ValueError(f"unknown peer mode {name!r}; peers: {', '.join(_PEERS)}")
    return _PEERS[name]


def not_applicable(name: str, model_type: str) -> str | None:
    """Why peer `name` cannot run on a model of `model_type`, or None when it can."""
    declared = peer(name)
    if declared.model_types is None or model_type in declared.model_types:
        return None
    return f"{name} does not apply to model type {model_type!r}: {declared.why_not}"


def missing_requirement(name: str) -> str | None:
    """The install hint when peer `name`'s package is not importable, else None."""
    declared = peer(name)
    if declared.import_name and importlib.util.find_spec(declared.import_name) is None:
        return f"mode {name!r} runs the peer {declared.requirement}, which is not installed: {INSTALL}"
    return None


def check_peer(name: str, model_type: str | None) -> None:
    """Refuse a peer point before any work: an unknown peer, its package missing, or a model it does not
    apply to (`model_type` None: not known yet, e.g. a checkpoint not read; `build_peer` checks it then)."""
    missing = missing_requirement(name)
    if missing:
        raise ValueError(missing)
    reason = not_applicable(name, model_type) if model_type else None
    if reason:
        raise PeerNotApplicable(reason)


def build_peer(name: str, model, config, max_response_length: int = 1024) -> PeerStep:
    """The peer's step on `model` for the objective `config` (a `GRPOConfig`), set up (imports, a peer's own
    trainer) for responses of up to `max_response_length` tokens; the model is checked before any work."""
    from longstraw.families import adapter_for

    check_peer(name, adapter_for(model).config.model_type)
    module, _, cls = peer(name).step.partition(":")
    return getattr(importlib.import_module(module), cls)(model, config, max_response_length)
