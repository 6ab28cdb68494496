"""Resident state: the model-native pages a captured prompt leaves behind.

A `ResidentState` holds one entry per decoder layer. Each entry is a small class that owns
its tensors and knows its byte count; the family adapters decide which entry a layer gets:

- `AttentionPages`: K/V pages preallocated to the prompt length, written in place by capture.
- `RecurrentState`: Gated DeltaNet conv state (last K-1 conv inputs) and recurrent state.
- `DecodePages`: while sampling, an attention layer's shared prompt pages plus per-sequence pages (`OwnPages`),
  written at a `DecodeClock`'s device step, so a decoding step has one shape (what a CUDA graph records).
- `WindowKV`: a sliding-window attention layer's K/V of the last `window - 1` positions only (constant size).
- `WindowDecodeKV`: while sampling, a sliding-window layer's shared prompt window plus a per-sequence ring.
- `LatentPages`: an MLA layer's compressed latent + rotary key per position (never per-head K/V),
  and on DSA index layers the indexer's key per position.
- `LatentDecodePages`: while sampling, an MLA layer's shared prompt latent pages plus per-sequence entries.

An entry owns its behaviour (`ResidentEntry` below is the contract, `tests/test_entry_contract.py` checks every
entry against it): the core, context parallelism and sampling call these methods and never branch on an
entry's type. The exact mode's recompute entries (`RecomputePages`, `RecomputeLatent`, `RecomputeRecurrent`,
`RecomputeWindow`) live here beside the entries they are made from.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import contextmanager, nullcontext
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Protocol

import torch

from longstraw.kernels.dsa_topk import select_topk, select_topk_decode
from longstraw.kernels.latent_attention import latent_attention, latent_decode_attention
from longstraw.kernels.paged_attention import decode_attention, paged_attention
from longstraw.kernels.window_attention import window_attention
from longstraw.measure.timing import timed_attention


class ResidentEntry(Protocol):
    """What a layer's resident entry does for the core, context parallelism and sampling (a family's entry
    implements all of it). How the live tokens mix over it is the family's: attention entries `attend` for the
    shared attention layer (`families/attention_layer.py`), a GDN layer's mixer reads its state's `inputs()`."""

    # its exact-mode leaves' gradients are per prompt position (context-parallel ranks sum them over the shards)
    # or a state passed on (the same on every rank)
    positional_gradients: bool

    def tensors(self) -> list[torch.Tensor]:
        """The tensors it holds (resident bytes, fingerprint, snapshot)."""

    def for_decoding(self, batch: int, clock: DecodeClock):
        """The entry `batch` sampled sequences decode on, each with room for `clock.capacity` new tokens."""

    def chunk_checkpoint(self):
        """What exact mode keeps at each capture chunk's start to recompute from (None: the pages are the record)."""

    def enable_prefix_grad(self) -> None:
        """Exact mode: grad-tracking leaves over what replays read, whose gradients `backward_prefix` consumes."""

    def for_prefix_recompute(self, start: int, checkpoint):
        """Exact mode's recompute entry for the prompt chunk at `start` (`checkpoint`: `chunk_checkpoint()` there)."""

    def gathered_through(self, end: int, gather: Callable):
        """The entry over every prompt position before `end`, this shard's tensors joined with the earlier
        shards' (`gather` concatenates every rank's tensors along positions): a context-parallel recompute's."""

    def for_shard(self, forms):
        """Its context-parallel form: the one of `forms.pages`, `forms.latent`, `forms.recurrent` that fits
        (`longstraw.cp.capture`), so a new kind of entry names its own form or has none."""

    def with_room(self, extra: int):
        """The entry with room for `extra` more positions after those it holds, its content unchanged (a larger
        copy of pages that lack the room; itself for a constant-size state): what `extend` appends to."""


def check_entries_implement(entries, method: str, purpose: str) -> None:
    """Refuse, before any work, entries lacking `method` of the contract (a family's entry that does not
    implement that part): one message naming their types and what needed it."""
    missing = sorted({type(e).__name__ for e in entries if not hasattr(e, method)})
    if missing:
        raise ValueError(f"{purpose}: {', '.join(missing)} entries have no {method}() (ResidentEntry, state/pages.py)")


def _grown(t: torch.Tensor, dim: int, length: int, extra: int) -> torch.Tensor:
    """`t` with room for `length + extra` positions along `dim`, its first `length` copied (itself when it has
    the room); in the same memory (pinned host pages stay pinned)."""
    if t.shape[dim] >= length + extra:
        return t
    shape = list(t.shape)
    shape[dim] = length + extra
    pinned = t.device.type == "cpu" and torch.cuda.is_available() and t.is_pinned()
    out = torch.empty(shape, dtype=t.dtype, device=t.device, pin_memory=pinned)
    out.narrow(dim, 0, length).copy_(t.narrow(dim, 0, length))
    return out


def _same(self, extra: int):
    """`with_room` of a constant-size entry (a GDN state, a window): itself."""
    return self


def _leaves(*tensors):
    return tuple(t.detach().requires_grad_() for t in tensors)


def _page_chunk_outputs(self, grads, start: int, stop: int):
    """(outputs, seeds) of a recomputed chunk's backward: its live pages and their rows of the page gradients."""
    return self.live, [g[:, :, start:stop] for g in grads]


def _carry_page_gradients(self, grads, start: int) -> None:
    """Add what reached the pages before the chunk into `grads` (consumed when their chunk comes up)."""
    for grad, leaf in zip(grads, self.prefix_leaves):
        if leaf.grad is not None:  # None where nothing read them (the last layer)
            grad[:, :, :start] += leaf.grad


_OUTPUT_UNUSED: ContextVar[bool] = ContextVar("attention_output_unused", default=False)


@contextmanager
def attention_output_unused():
    """Within the block a capture's attention (`attend_pages` with `append`) only writes the live K/V and gives
    back zeros: for a layer whose output nothing reads (a capture's last layer; `FamilyAdapter.layer_state_forward`)."""
    token = _OUTPUT_UNUSED.set(True)
    try:
        yield
    finally:
        _OUTPUT_UNUSED.reset(token)


def attend_pages(pages, q_BHTD, k_BKTD, v_BKTD, scale: float, append: bool, sinks=None):
    """The live queries over `pages.filled()` and their own causal keys ([B, H, T, Dv]), and the layer's
    attention `sinks` when it has them; a capture (`append`) then writes the live K/V after the filled part.
    Any entry with `filled()` and `append()` attends this way (attention pages, the exact mode's recompute
    pages). Within `attention_output_unused()` a capture appends and returns zeros."""
    if append and _OUTPUT_UNUSED.get():
        pages.append(k_BKTD, v_BKTD)
        B, H, T, _ = q_BHTD.shape  # zeros in HF's [B, T, H, D] memory: its transpose back is not a copy
        return q_BHTD.new_zeros(B, T, H, v_BKTD.shape[-1]).transpose(1, 2)
    k_prefix_BKPD, v_prefix_BKPD = pages.filled()
    with timed_attention(q_BHTD, k_prefix_BKPD.shape[2]) if append else nullcontext():
        out_BHTD = paged_attention(
            q_BHTD,
            k_prefix_BKPD,
            v_prefix_BKPD,
            k_BKTD,
            v_BKTD,
            scale=scale,
            capture=append and not torch.is_grad_enabled(),
            sinks=sinks,
        )
    if append:  # pages copy detached values; the exact mode's recompute keeps the graph
        pages.append(k_BKTD, v_BKTD)
    return out_BHTD


@dataclass
class AttentionPages:
    """K/V pages of one full-attention layer: `k_BKPD`, `v_BKPD` with `length` positions filled."""

    k_BKPD: torch.Tensor
    v_BKPD: torch.Tensor
    length: int = 0
    # exact mode: grad-tracking leaves over the filled pages; replays' backwards accumulate the
    # prompt-side gradient in their .grad (allocated on first touch)
    leaves: tuple | None = None

    @classmethod
    def allocate(cls, num_kv_heads, positions, head_dim, dtype, device, v_head_dim=None):
        shape = (1, num_kv_heads, positions, head_dim)
        v_shape = (1, num_kv_heads, positions, v_head_dim or head_dim)
        return cls(torch.empty(shape, dtype=dtype, device=device), torch.empty(v_shape, dtype=dtype, device=device))

    def filled(self):
        """Views of the pages written so far (no copy); the grad-tracking leaves in exact mode."""
        if self.leaves is not None:
            return self.leaves
        return self.k_BKPD[:, :, : self.length], self.v_BKPD[:, :, : self.length]

    def append(self, k_BKTD, v_BKTD):
        """Write a chunk's K/V in place after the filled part."""
        end = self.length + k_BKTD.shape[2]
        if end > self.k_BKPD.shape[2]:
            raise ValueError(f"attention pages hold {self.k_BKPD.shape[2]} positions; cannot append up to {end}")
        self.k_BKPD[:, :, self.length : end].copy_(k_BKTD.detach())
        self.v_BKPD[:, :, self.length : end].copy_(v_BKTD.detach())
        self.length = end

    def tensors(self):
        return [self.k_BKPD, self.v_BKPD]

    def for_members(self, members: int) -> AttentionPages:
        """The pages as `members` replayed sequences read them: in place (paged attention folds their rows)."""
        return self

    attend = attend_pages
    positional_gradients = True

    def for_decoding(self, batch: int, clock: DecodeClock) -> DecodePages:
        return DecodePages.allocate(self, batch, clock)

    def chunk_checkpoint(self):
        return None

    def enable_prefix_grad(self) -> None:
        self.leaves = _leaves(self.k_BKPD[:, :, : self.length], self.v_BKPD[:, :, : self.length])

    def for_prefix_recompute(self, start: int, checkpoint=None) -> RecomputePages:
        return RecomputePages(*(t[:, :, :start].detach().requires_grad_(start > 0) for t in (self.k_BKPD, self.v_BKPD)))

    def gathered_through(self, end: int, gather: Callable) -> AttentionPages:
        k, v = (t[:, :, :end] for t in gather(*(t[:, :, : self.length] for t in self.tensors())))
        return AttentionPages(k, v, end)

    def for_shard(self, forms):
        return forms.pages(self)

    def with_room(self, extra: int) -> AttentionPages:
        return AttentionPages(*(_grown(t, 2, self.length, extra) for t in self.tensors()), self.length)

    def attend_decode(self, q_BHTD, own: OwnPages, scale: float, sinks=None):
        """One decoding step: each sequence's query over these shared pages and its `own` pages."""
        return decode_attention(q_BHTD, *self.filled(), *own.written(), scale=scale, sinks=sinks)


@dataclass
class DecodeClock:
    """Where B sequences decoding on one captured prompt are: `step_1`, the index of the token being decoded, a
    device counter that a step advances in place, so every step runs the same kernels on the same tensors (a CUDA
    graph records one and replays it). `capacity` tokens at most; `start` is the prompt's positions."""

    step_1: torch.Tensor
    start: int
    capacity: int

    @classmethod
    def allocate(cls, start: int, capacity: int, device) -> DecodeClock:
        return cls(torch.zeros(1, dtype=torch.long, device=device), start, capacity)

    def positions_11(self) -> torch.Tensor:
        """The position of the token being decoded, [1, 1]."""
        return (self.step_1 + self.start)[None]

    def advance(self) -> None:
        self.step_1.add_(1)


@dataclass
class OwnPages:
    """Each of B decoding sequences' own K/V ([B, K, capacity, D]): a step writes its token's at the clock's step
    and reads every slot, those not yet written masked out (one shape whatever the step)."""

    k_BKND: torch.Tensor
    v_BKND: torch.Tensor
    clock: DecodeClock

    def append(self, k_BK1D, v_BK1D):
        self.k_BKND.index_copy_(2, self.clock.step_1, k_BK1D)
        self.v_BKND.index_copy_(2, self.clock.step_1, v_BK1D)

    def written(self):
        """(k, v, step_1): every slot, and the last one written (`decode_attention`'s own keys)."""
        return self.k_BKND, self.v_BKND, self.clock.step_1

    def tensors(self):
        return [self.k_BKND, self.v_BKND]


@dataclass
class DecodePages:
    """One attention layer while B sequences decode on top of one captured prompt: the prompt's
    `shared` pages (batch 1, read by every sequence, never copied) and each sequence's `own`
    pages (batch B) holding the tokens generated so far."""

    shared: AttentionPages
    own: OwnPages
    graph_safe = True  # a step's kernels and tensors are the same at every step (no host-side counter)

    @classmethod
    def allocate(cls, shared: AttentionPages, batch: int, clock: DecodeClock):
        _, K, _, D = shared.k_BKPD.shape
        # zeros: a masked slot's probability is 0, and 0 times a stale NaN would still be NaN
        k = shared.k_BKPD.new_zeros(batch, K, clock.capacity, D)
        v = shared.v_BKPD.new_zeros(batch, K, clock.capacity, shared.v_BKPD.shape[3])
        return cls(shared, OwnPages(k, v, clock))

    def tensors(self):
        return self.shared.tensors() + self.own.tensors()

    def attend(self, q_BHTD, k_BKTD, v_BKTD, scale: float, append: bool = True, sinks=None):
        """A decoding step: the new token's K/V join each sequence's own pages, then it attends."""
        self.own.append(k_BKTD, v_BKTD)
        return self.shared.attend_decode(q_BHTD, self.own, scale, sinks)


@dataclass
class RecurrentState:
    """Gated DeltaNet state of one layer: conv inputs `conv_BCK1` and recurrent `recurrent_BHDV` (float32)."""

    conv_BCK1: torch.Tensor
    recurrent_BHDV: torch.Tensor
    leaves: tuple | None = None  # exact mode: grad-tracking leaves replays read (see AttentionPages)
    keep_final = False  # capture writes the final state back in place (not a dataclass field)

    def tensors(self):
        return [self.conv_BCK1, self.recurrent_BHDV]

    def inputs(self):
        """(conv, recurrent) a chunk starts from: the leaves in exact mode, else the state itself."""
        return self.leaves if self.leaves is not None else (self.conv_BCK1, self.recurrent_BHDV)

    def repeated(self, batch: int) -> RecurrentState:
        """Copies for `batch` sequences continuing from this state (decoding G responses, replaying G members),
        repeated from `inputs()`: in exact mode the leaves, so each replayed member's gradient reaches them."""
        conv, recurrent = self.inputs()
        return RecurrentState(conv.repeat(batch, 1, 1), recurrent.repeat(batch, 1, 1, 1))

    for_members = repeated  # replay never writes it
    positional_gradients = False

    def for_decoding(self, batch: int, clock: DecodeClock) -> RecurrentState:
        return self.repeated(batch)  # written in place by each step (`gdn_mix`): graph-safe

    graph_safe = True

    def chunk_checkpoint(self):
        return self.conv_BCK1.clone(), self.recurrent_BHDV.clone()

    def enable_prefix_grad(self) -> None:
        self.leaves = _leaves(self.conv_BCK1, self.recurrent_BHDV)

    def for_prefix_recompute(self, start: int, checkpoint) -> RecomputeRecurrent:
        conv, recurrent = checkpoint
        recompute = RecomputeRecurrent(conv, recurrent)
        recompute.leaves = _leaves(conv, recurrent)
        return recompute

    def gathered_through(self, end: int, gather: Callable) -> RecurrentState:
        return self  # its recompute starts from the chunk checkpoints, which each rank keeps for its own chunks

    def for_shard(self, forms):
        return forms.recurrent(self)

    with_room = _same


@dataclass
class RecomputePages:
    """An attention layer while exact mode recomputes one prompt chunk under autograd: the pages before the
    chunk as grad-tracking leaves, the chunk's own K/V (`live`) with their graph."""

    prefix_k: torch.Tensor
    prefix_v: torch.Tensor
    live: list = field(default_factory=list)

    def filled(self):
        return self.prefix_k, self.prefix_v

    def append(self, k_BKTD, v_BKTD):
        self.live = [k_BKTD, v_BKTD]

    attend = attend_pages
    chunk_outputs = _page_chunk_outputs
    carry_gradients = _carry_page_gradients

    @property
    def prefix_leaves(self):
        return self.prefix_k, self.prefix_v


def _carry_state_gradients(self, grads, start: int) -> None:
    """`grads` becomes the gradient of the state at the chunk's start (the seed of the chunk before)."""
    grads[:] = [leaf.grad if leaf.grad is not None else torch.zeros_like(leaf) for leaf in self.leaves]


class RecomputeRecurrent(RecurrentState):
    """A GDN layer while one prompt chunk is recomputed: starts from grad-tracking leaves, keeps its
    end state (with its graph) in `final` instead of writing it back."""

    keep_final = True
    final: tuple = ()

    def chunk_outputs(self, grads, start: int, stop: int):
        """(outputs, seeds): the state at the chunk's end and the gradient of the next chunk's start."""
        return list(self.final), list(grads)

    carry_gradients = _carry_state_gradients


def _last_positions(t_BKND, n: int):
    """The last `n` positions of `t_BKND` (all of them when it has fewer)."""
    return t_BKND[:, :, max(t_BKND.shape[2] - n, 0) :]


def attend_window(pages, q_BHTD, k_BKTD, v_BKTD, scale: float, append: bool, sinks=None):
    """The live queries over `pages.filled()` (the positions just before them) and their own keys, within
    `pages.window` (`kernels.window_attention`), and the layer's attention `sinks` when it has them; a capture
    (`append`) then keeps the live K/V. Not timed (`timed_attention` rates a capture's causal attention over its
    whole prefix). Any entry with `window`, `filled()` and `append()` attends this way (window K/V, the exact
    mode's recompute window)."""
    out_BHTD = window_attention(q_BHTD, *pages.filled(), k_BKTD, v_BKTD, scale=scale, window=pages.window, sinks=sinks)
    if append:
        pages.append(k_BKTD, v_BKTD)
    return out_BHTD


@dataclass
class WindowKV:
    """K/V of one sliding-window attention layer: of the positions before the next query, the last
    `window - 1` (every key a later query can see: `kernels.window_attention`), oldest first, in buffers of
    that size whatever the prompt's length (zeros past `length` while fewer positions have come)."""

    k_BKWD: torch.Tensor
    v_BKWD: torch.Tensor
    window: int
    length: int = 0
    leaves: tuple | None = None  # exact mode: grad-tracking leaves over the kept K/V (see AttentionPages)

    @classmethod
    def allocate(cls, num_kv_heads, window, head_dim, dtype, device):
        shape = (1, num_kv_heads, window - 1, head_dim)
        k, v = (torch.zeros(shape, dtype=dtype, device=device) for _ in range(2))
        return cls(k, v, window)

    def filled(self):
        """The kept K/V, oldest first (views, no copy); the grad-tracking leaves in exact mode."""
        if self.leaves is not None:
            return self.leaves
        return self.k_BKWD[:, :, : self.length], self.v_BKWD[:, :, : self.length]

    def append(self, k_BKTD, v_BKTD):
        """Keep the last `window - 1` of the kept positions and a chunk's: the same whatever the chunking."""
        for buffer, live in ((self.k_BKWD, k_BKTD), (self.v_BKWD, v_BKTD)):
            kept = _last_positions(torch.cat([buffer[:, :, : self.length], live.detach()], dim=2), buffer.shape[2])
            buffer[:, :, : kept.shape[2]].copy_(kept)
        self.length = kept.shape[2]

    def tensors(self):
        return [self.k_BKWD, self.v_BKWD]

    def for_members(self, members: int) -> WindowKV:
        """The window as `members` replayed sequences read it: in place (every member's queries over it)."""
        return self

    attend = attend_window
    # its leaves' gradients are of the window at the prompt's end: a state passed on, like a GDN state's
    positional_gradients = False

    def for_decoding(self, batch: int, clock: DecodeClock) -> WindowDecodeKV:
        return WindowDecodeKV.allocate(self, batch, clock.capacity)

    def chunk_checkpoint(self):
        """The kept K/V at a chunk's start: what its recompute attends over (later chunks overwrite it)."""
        return tuple(t.clone() for t in self.filled())

    def enable_prefix_grad(self) -> None:
        self.leaves = _leaves(*self.filled())

    def for_prefix_recompute(self, start: int, checkpoint) -> RecomputeWindow:
        return RecomputeWindow(*_leaves(*checkpoint), self.window)

    def gathered_through(self, end: int, gather: Callable) -> WindowKV:
        return self  # never sharded (for_shard refuses); its recompute starts from the chunk checkpoints

    def for_shard(self, forms):
        raise ValueError(
            "a context-parallel capture: WindowKV (sliding-window layers) has no context-parallel form yet "
            "(each shard would start from the last window - 1 K/V of the shard before it); capture without cp"
        )

    with_room = _same


@dataclass
class WindowDecodeKV:
    """One sliding-window layer while B sequences decode on one captured prompt: the prompt's `shared` window
    (batch 1, read by every sequence, never copied) and each sequence's own K/V in a ring of
    min(capacity, window) slots. A step's query sees the newest `window` keys: every own key the ring holds
    and, while that is fewer than `window`, the prompt's last ones."""

    shared: WindowKV
    own_k_BKSD: torch.Tensor
    own_v_BKSD: torch.Tensor
    generated: int = 0
    graph_safe = False  # its ring's slot and the prompt's part it reads follow a host-side count

    @classmethod
    def allocate(cls, shared: WindowKV, batch: int, capacity: int):
        _, K, _, D = shared.k_BKWD.shape
        slots = min(capacity, shared.window)
        return cls(shared, *(t.new_empty(batch, K, slots, D) for t in (shared.k_BKWD, shared.v_BKWD)))

    @property
    def window(self) -> int:
        return self.shared.window

    def tensors(self):
        return self.shared.tensors() + [self.own_k_BKSD, self.own_v_BKSD]

    def attend(self, q_BHTD, k_BKTD, v_BKTD, scale: float, append: bool = True, sinks=None):
        """A decoding step: the new token's K/V take the ring's oldest slot, then it attends (the ring's order
        does not matter: a softmax over a set of keys)."""
        slots = self.own_k_BKSD.shape[2]
        slot = self.generated % slots
        self.own_k_BKSD[:, :, slot : slot + 1].copy_(k_BKTD)
        self.own_v_BKSD[:, :, slot : slot + 1].copy_(v_BKTD)
        self.generated += 1
        own = min(self.generated, slots)
        shared = (_last_positions(t, max(self.window - self.generated, 0)) for t in self.shared.filled())
        own_kv = (self.own_k_BKSD[:, :, :own], self.own_v_BKSD[:, :, :own])
        return decode_attention(q_BHTD, *shared, *own_kv, scale=scale, sinks=sinks)


@dataclass
class RecomputeWindow:
    """A sliding-window layer while exact mode recomputes one prompt chunk: the K/V kept at the chunk's start
    (its checkpoint) as grad-tracking leaves, the chunk's own K/V (`live`) with their graph. Like a GDN state
    it passes a state on: the window kept at the chunk's end, whose gradient the next chunk's leaves (or, for
    the last chunk, the replays) hold."""

    prefix_k: torch.Tensor
    prefix_v: torch.Tensor
    window: int
    live: list = field(default_factory=list)

    def filled(self):
        return self.prefix_k, self.prefix_v

    def append(self, k_BKTD, v_BKTD):
        self.live = [k_BKTD, v_BKTD]

    attend = attend_window

    @property
    def leaves(self):
        return self.prefix_k, self.prefix_v

    def chunk_outputs(self, grads, start: int, stop: int):
        """(outputs, seeds): the window kept at the chunk's end, with its graph, and its gradient."""
        ends = [
            _last_positions(torch.cat([p, live], dim=2), self.window - 1) for p, live in zip(self.leaves, self.live)
        ]
        return ends, list(grads)

    carry_gradients = _carry_state_gradients


@dataclass
class IndexQueries:
    """A chunk's DSA indexer queries `q_THI`, head weights `w_TH` and keys `key_TI` (no grad), with the
    layer's `topk` and score `scale`: what an index layer's entry selects from."""

    q_THI: torch.Tensor
    w_TH: torch.Tensor
    key_TI: torch.Tensor
    topk: int
    scale: float

    def selects(self, visible: int) -> bool:
        """Whether the top k of `visible` positions drops any; else every one is kept (no selection)."""
        return self.topk < visible


def attend_latent_pages(
    pages,
    q_1HTE,
    live_11TE,
    *,
    rank: int,
    scale: float,
    append: bool,
    index: IndexQueries | None = None,
    selection=None,
):
    """(attention-weighted latents [1, H, T, C], the top-k selection used or None when dense) of the
    live absorbed queries over `pages.on_device()` and their own causal entries. An index layer
    (`index`) selects its own top k over [pages ‖ live] when that drops positions; an IndexShare layer
    passes the `selection` of the index layer before it. A capture (`append`) then writes the live
    entries (and index keys) after the filled part. Any entry with `on_device()`, `filled()` and
    `append()` attends this way (latent pages, the exact mode's recompute pages)."""
    T = q_1HTE.shape[2]
    pages_11PE, index_pages_1PI = pages.on_device()  # host pages: this layer's, streamed (the next one's starts)
    if index is not None:
        selection = (
            select_topk(index.q_THI, index.w_TH, index_pages_1PI[0], index.key_TI, topk=index.topk, scale=index.scale)
            if index.selects(pages_11PE.shape[2] + T)
            else None
        )
    out_1HTC = latent_attention(
        q_1HTE, pages_11PE, live_11TE, rank=rank, scale=scale, selection_TK=selection, resident_11PE=pages.filled()[0]
    )
    del pages_11PE, index_pages_1PI  # a streamed copy lives for this layer only
    if append:
        pages.append(live_11TE, None if index is None else index.key_TI[None])
    return out_1HTC, selection


@dataclass
class LatentPages:
    """One MLA layer's pages: `kv_11PE` holds, per position, the latent after `kv_a_layernorm`
    (the first `kv_lora_rank` of E) followed by the rotated rope key (E = kv_lora_rank +
    qk_rope_head_dim), laid out as one shared kv head so it feeds `paged_attention` unchanged;
    `index_1PI` holds the DSA indexer's key (after its norm and rotary) on index layers, else None."""

    kv_11PE: torch.Tensor
    index_1PI: torch.Tensor | None
    kv_lora_rank: int
    length: int = 0
    leaves: tuple | None = None  # exact mode: a grad-tracking leaf over the filled latent pages
    # host-resident pages: the device the layer computes on (the pages stay in pinned host memory
    # and come to it whole, one layer at a time: `on_device`)
    compute_device: torch.device | None = None
    next_host: LatentPages | None = field(default=None, repr=False)  # the host pages read after these
    _staged: tuple | None = field(default=None, repr=False)  # (length, copy done event, device copies)

    @classmethod
    def allocate(cls, positions, kv_lora_rank, rope_dim, index_dim, dtype, device, host=False):
        device = torch.device(device)
        where = (
            dict(dtype=dtype, device="cpu", pin_memory=device.type == "cuda")
            if host
            else dict(dtype=dtype, device=device)
        )
        kv = torch.empty(1, 1, positions, kv_lora_rank + rope_dim, **where)
        index = torch.empty(1, positions, index_dim, **where) if index_dim else None
        return cls(kv, index, kv_lora_rank, compute_device=device if host else None)

    def filled(self):
        """(kv pages, index-key pages or None) written so far, as views; the leaf in exact mode."""
        kv = self.leaves[0] if self.leaves is not None else self.kv_11PE[:, :, : self.length]
        return kv, None if self.index_1PI is None else self.index_1PI[:, : self.length]

    def on_device(self):
        """`filled()` on the compute device. Host pages: the copy prefetched while the layer before
        ran, when its length still matches, else a copy now; then the next layer's copy starts on a
        side stream, so that transfer overlaps this layer's compute. Device pages: `filled()`."""
        kv, index = self.filled()
        if self.compute_device is None:
            return kv, index
        staged, self._staged = self._staged, None
        if staged is not None and staged[0] == self.length:
            stream = torch.cuda.current_stream(self.compute_device)
            stream.wait_event(staged[1])
            for t in staged[2]:
                if t is not None:
                    t.record_stream(stream)  # allocated on the copy stream, read on this one
            kv, index = staged[2]
        else:
            kv, index = (None if t is None else t.to(self.compute_device, non_blocking=True) for t in (kv, index))
        if self.next_host is not None:
            self.next_host.prefetch()
        return kv, index

    def prefetch(self):
        """Host pages on CUDA: start copying the filled pages to the device on the copy stream."""
        if self.compute_device is None or self.compute_device.type != "cuda":
            return
        stream = _copy_stream(self.compute_device)
        with torch.cuda.stream(stream):
            copies = tuple(None if t is None else t.to(self.compute_device, non_blocking=True) for t in self.filled())
            self._staged = (self.length, stream.record_event(), copies)

    def append(self, kv_11TE, index_1TI):
        end = self.length + kv_11TE.shape[2]
        if end > self.kv_11PE.shape[2]:
            raise ValueError(f"latent pages hold {self.kv_11PE.shape[2]} positions; cannot append up to {end}")
        self.kv_11PE[:, :, self.length : end].copy_(kv_11TE.detach())
        if self.index_1PI is not None:
            self.index_1PI[:, self.length : end].copy_(index_1TI.detach())
        self.length = end

    def tensors(self):
        return [self.kv_11PE] + ([] if self.index_1PI is None else [self.index_1PI])

    attend = attend_latent_pages
    positional_gradients = True

    def for_decoding(self, batch: int, clock: DecodeClock) -> LatentDecodePages:
        return LatentDecodePages.allocate(self, batch, clock.capacity)

    def chunk_checkpoint(self):
        return None

    def enable_prefix_grad(self) -> None:
        self.leaves = _leaves(self.kv_11PE[:, :, : self.length])  # the index keys get none (no-grad indexer)

    def for_prefix_recompute(self, start: int, checkpoint=None) -> RecomputeLatent:
        index = None if self.index_1PI is None else self.index_1PI[:, :start]
        return RecomputeLatent(self.kv_11PE[:, :, :start].detach().requires_grad_(start > 0), index, start)

    def gathered_through(self, end: int, gather: Callable) -> LatentPages:
        kv, index = self.kv_11PE[:, :, : self.length], self.index_1PI
        gathered = gather(kv, *([] if index is None else [index[:, None, : self.length]]))
        return LatentPages(
            gathered[0][:, :, :end], None if index is None else gathered[1][:, 0, :end], self.kv_lora_rank, end
        )

    def for_shard(self, forms):
        return forms.latent(self)

    def with_room(self, extra: int) -> LatentPages:
        kv = _grown(self.kv_11PE, 2, self.length, extra)
        index = None if self.index_1PI is None else _grown(self.index_1PI, 1, self.length, extra)
        return LatentPages(kv, index, self.kv_lora_rank, self.length, compute_device=self.compute_device)

    def attend_decode(
        self, q_BH1E, own: LatentPages, *, rank: int, scale: float, index: IndexQueries | None = None, selection=None
    ):
        """One decoding step of B sequences on these shared pages ((attention-weighted latents [B, H, 1, C],
        the selection [B, k] or None)): each sequence's query over the pages and its `own` entries (the
        current one appended); an index layer selects over [pages ‖ own] (`select_topk_decode`)."""
        shared_11PE, shared_index_1PI = self.on_device()
        own_B1NE, own_index_BNI = own.filled()
        if index is not None:
            selection = (
                select_topk_decode(
                    index.q_THI, index.w_TH, shared_index_1PI[0], own_index_BNI, topk=index.topk, scale=index.scale
                )
                if index.selects(self.length + own.length)
                else None
            )
        out_BH1C = latent_decode_attention(
            q_BH1E, shared_11PE, own_B1NE, rank=rank, scale=scale, selection_BK=selection
        )
        return out_BH1C, selection

    @property
    def chunk_start(self) -> int:
        """The first position of the chunk the next mix call brings (IndexShare keys its selections by it)."""
        return self.length


@dataclass
class RecomputeLatent:
    """An MLA layer while one prompt chunk is recomputed: a grad-tracking leaf over the latent pages
    before the chunk, the index pages before it (read only), the chunk's own entries with their graph."""

    prefix_kv: torch.Tensor
    prefix_index: torch.Tensor | None
    chunk_start: int  # the chunk's first position (the MLA adapter keys IndexShare selections by it)
    live: list = field(default_factory=list)

    def filled(self):
        return self.prefix_kv, self.prefix_index

    on_device = filled  # exact mode keeps its pages on the device
    attend = attend_latent_pages
    chunk_outputs = _page_chunk_outputs
    carry_gradients = _carry_page_gradients

    def append(self, kv_11TE, index_1TI):
        self.live = [kv_11TE]

    @property
    def prefix_leaves(self):
        return (self.prefix_kv,)


_COPY_STREAMS: dict = {}  # one host-to-device copy stream per CUDA device


def _copy_stream(device):
    if device not in _COPY_STREAMS:
        _COPY_STREAMS[device] = torch.cuda.Stream(device)
    return _COPY_STREAMS[device]


def chain_host_pages(layers) -> None:
    """Each host-resident `LatentPages` learns the next one in layer order (what `on_device`
    prefetches)."""
    host = [e for e in layers if isinstance(e, LatentPages) and e.compute_device is not None]
    for a, b in zip(host, host[1:]):
        a.next_host = b


@dataclass
class LatentDecodePages:
    """One MLA layer while B sequences decode on top of one captured prompt: the prompt's `shared`
    latent pages (read by every sequence, never copied) and each sequence's `own` entries (latents,
    and index keys on index layers) for the tokens generated so far: `kv_11PE` is then [B, 1, N, E]
    and `index_1PI` [B, N, I]."""

    shared: LatentPages
    own: LatentPages
    graph_safe = False  # its own entries grow by a host-side length (and an index layer selects by it)

    @classmethod
    def allocate(cls, shared: LatentPages, batch: int, capacity: int):
        device = shared.compute_device or shared.kv_11PE.device  # host-resident prompt: own entries on the device
        kv = torch.empty(batch, 1, capacity, shared.kv_11PE.shape[3], dtype=shared.kv_11PE.dtype, device=device)
        index = (
            None
            if shared.index_1PI is None
            else torch.empty(batch, capacity, shared.index_1PI.shape[2], dtype=shared.index_1PI.dtype, device=device)
        )
        return cls(shared, LatentPages(kv, index, shared.kv_lora_rank))

    @property
    def length(self) -> int:
        """Positions before the next token: the prompt's and the generated ones."""
        return self.shared.length + self.own.length

    chunk_start = length

    def tensors(self):
        return self.shared.tensors() + self.own.tensors()
