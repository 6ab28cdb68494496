"""ResidentState: what `capture` keeps of a prompt, one entry per decoder layer (`pages.py`).

The core relies only on each entry's `tensors()` (bytes, fingerprint, snapshot/restore). A state
knows what it belongs to: the model it was captured from (`ModelBinding`: its layers and shapes,
its weights) and the prompt (a digest); `check` refuses any other, and `age` counts the optimizer
steps taken since the capture (reusing a state across steps is the design: prefix reuse).
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class ModelBinding:
    """What a state was captured from (`FamilyAdapter.binding`): `structure` (family, layer count,
    each layer's mixer, the config shapes that size the entries, dtype), `storages` (the identity of
    the weights: another model object differs), `frozen` (a sampled checksum of the frozen
    weights: another model built in the same memory differs) and `trainable` (the version counters of
    the trainable weights, which every in-place write bumps: an optimizer step, `load_state_dict`).
    A state is bound to the weights it was captured with; serving it after they moved is prefix reuse,
    which `grpo_step` (for the update it makes) and `reuse_state` (any other) declare by rebinding."""

    structure: tuple
    storages: int
    frozen: float
    trainable: int

    def mismatch(self, other: ModelBinding) -> str | None:
        """Why `other` is not the model this binding describes, or None."""
        if self.structure != other.structure:
            return f"captured from {_describe(self.structure)}, not {_describe(other.structure)}"
        if self.storages != other.storages:
            return "captured from another model's weights (another model object, or its weights were replaced)"
        if self.frozen != other.frozen:
            return "the model's frozen weights changed since the capture"
        if self.trainable != other.trainable:
            return (
                "the trainable weights were written since the capture (an optimizer step or load_state_dict "
                "outside grpo_step), so the state is stale; capture the prompt again, or declare the reuse on "
                "purpose with longstraw.core.transaction.reuse_state(model, state) (prefix reuse)"
            )
        return None


def _describe(structure: tuple) -> str:
    model_type, layers, mixers, shapes, dtype = structure
    kinds = ", ".join(f"{mixers.count(m)} {m}" for m in dict.fromkeys(mixers))
    return f"a {layers}-layer {model_type} model ({kinds}; {dict(shapes)}; {dtype})"


def _id_bytes(ids: torch.Tensor) -> bytes:
    return ids.detach().to("cpu", torch.int64).contiguous().numpy().tobytes()


def prompt_hash(ids: torch.Tensor):
    """The running sha256 of a prompt's token ids: `prompt_digest`'s, which more ids can continue (`extend`)."""
    return hashlib.sha256(_id_bytes(ids))


def prompt_digest(ids: torch.Tensor) -> str:
    """A digest of a prompt's token ids (a state is bound to the prompt it covers)."""
    return prompt_hash(ids).hexdigest()[:32]


def check_positions(positions: int, tokens: int, limit: int | None, what: str) -> None:
    """Refuse `tokens` tokens after a prompt whose resident state covers `positions` (the prompt minus its last
    token) when they need more than `limit` positions (None: no limit)."""
    if limit is not None and positions + tokens > limit:
        raise ValueError(
            f"{what}: {tokens} tokens after the prompt's {positions + 1} need {positions + tokens} "
            f"positions (the last token is only predicted), past the model's max_position_embeddings "
            f"({limit}); capture with beyond_max_positions=True (config: capture.beyond_max_positions) "
            "to go past it"
        )


_FINGERPRINT_CHUNK = 1 << 24


@dataclass
class ResidentState:
    """What `capture` keeps of a prompt: per-layer pages covering `positions` prompt positions.

    `positions` is the prompt length minus one: replay recomputes the last prompt token together
    with the response, so every response token has a full autograd path. `last_token` is that token,
    `model_type` names the family.
    """

    layers: list
    positions: int
    last_token: int
    model_type: str
    predicted_bytes_per_position: int
    predicted_constant_bytes: int
    dtype: torch.dtype = torch.float32
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    prefix_trace: object | None = None  # exact mode: a `longstraw.core.exact.PrefixTrace`
    binding: ModelBinding | None = None  # the model it was captured from
    prompt: str | None = None  # the digest of the prompt it covers (`prompt_digest`)
    age: int = 0  # optimizer steps taken since the capture (`grpo_step` counts them)
    # the model's position limit that replay and sampling keep to (None: captured with beyond_max_positions)
    max_positions: int | None = None
    prompt_hash: object | None = field(default=None, repr=False)  # `prompt_hash` of the ids, continued by `extend`
    damaged: str | None = None  # why the state is unusable (an extension that failed midway), or None

    def check_model(self, binding: ModelBinding) -> None:
        """Refuse a model this state was not captured from, or whose trainable weights were written since
        without a declared reuse (replay, score, sample, grpo_step); and a damaged state."""
        if self.damaged:
            raise ValueError(f"this resident state is unusable: {self.damaged}; capture the prompt again")
        why = self.binding.mismatch(binding) if self.binding is not None else None
        if why:
            advice = "" if why.startswith("the trainable") else "; capture the prompt with this model"
            raise ValueError(f"this resident state does not belong to the model: {why}{advice}")

    def rebind(self, binding: ModelBinding) -> None:
        """Declare prefix reuse: the state serves the model's current trainable weights from now on. A
        state of another model (structure, weights' storages, frozen weights) is still refused."""
        if self.binding is not None:
            self.check_model(dataclasses.replace(binding, trainable=self.binding.trainable))
        self.binding = binding

    def why_not_extendable(self) -> str | None:
        """Why `extend` cannot grow this state by more prompt tokens, or None."""
        if self.prefix_trace is not None:
            return (
                "an exact-mode state (prefix_grad=True): its prompt-side trace covers the prompt it was captured "
                "from; capture the whole history with prefix_grad=True instead"
            )
        return None

    def cover_more(self, new_ids: torch.Tensor) -> None:
        """The state now covers its prompt followed by `new_ids` (its entries grown by `extend`): its positions,
        last token and digest follow."""
        self.positions += new_ids.numel()
        self.last_token = int(new_ids[-1])
        if self.prompt_hash is not None:
            self.prompt_hash = self.prompt_hash.copy()
            self.prompt_hash.update(_id_bytes(new_ids))
            self.prompt = self.prompt_hash.hexdigest()[:32]

    def check_positions(self, tokens: int, what: str) -> None:
        """Refuse `tokens` more positions after the prompt's (a response replayed, or sampled) past the limit."""
        check_positions(self.positions, tokens, self.max_positions, what)

    def check_prompt(self, prompt_ids: torch.Tensor) -> None:
        """Refuse a prompt other than the one this state covers."""
        if prompt_ids.numel() != self.positions + 1:
            raise ValueError(f"the state covers a prompt of {self.positions + 1} tokens; got {prompt_ids.numel()}")
        if self.prompt is not None and prompt_digest(prompt_ids) != self.prompt:
            raise ValueError(
                f"the state was captured from another prompt of {prompt_ids.numel()} tokens (their "
                "token ids differ); capture this prompt"
            )

    @property
    def nbytes(self) -> int:
        return sum(self.nbytes_by_entry().values())

    def nbytes_by_entry(self) -> dict[str, int]:
        """Resident bytes per entry class (position-proportional pages vs constant-size states)."""
        out: dict[str, int] = {}
        for layer in self.layers:
            name = type(layer).__name__
            out[name] = out.get(name, 0) + sum(t.numel() * t.element_size() for t in layer.tensors())
        return out

    @property
    def device_nbytes(self) -> int:
        """Resident bytes on the compute device (host-resident pages excluded)."""
        return sum(
            t.numel() * t.element_size()
            for layer in self.layers
            for t in layer.tensors()
            if t.device.type == self.device.type
        )

    @property
    def local_positions(self) -> int:
        """Prompt positions whose pages this process holds (a context-parallel rank: its shard)."""
        return self.positions

    @property
    def page_bytes(self) -> int:
        """Bytes of the position-proportional entries (attention pages)."""
        return sum(v for name, v in self.nbytes_by_entry().items() if name.endswith("Pages"))

    @property
    def predicted_nbytes(self) -> int:
        return self.predicted_bytes_per_position * self.local_positions + self.predicted_constant_bytes

    def fingerprint(self) -> int:
        """A position-sensitive checksum of every state byte: changes if any bit of any page changes. The
        tensors' chunk sums stay on their devices until one transfer each (a state of 60 pages: one sync, not 60)."""
        sums = [(index, _chunk_sums(t)) for index, layer in enumerate(self.layers) for t in layer.tensors()]
        by_device: dict = {}
        for _, s in sums:
            by_device.setdefault(s.device, []).append(s)
        host = {device: iter(torch.cat(parts).tolist()) for device, parts in by_device.items()}
        total = 0
        for index, s in sums:
            values = [next(host[s.device]) for _ in range(s.numel())]
            checksum = sum(v * (chunk + 1) for chunk, v in enumerate(values)) % (1 << 61)
            total = (total * 1_000_003 + index + checksum) % (1 << 61)
        return total

    def snapshot(self) -> list:
        """Copies of every tensor (for tests and for callers that must survive a failed replay)."""
        return [[t.clone() for t in layer.tensors()] for layer in self.layers]

    def restore(self, snapshot) -> None:
        for layer, saved in zip(self.layers, snapshot, strict=True):
            for t, s in zip(layer.tensors(), saved, strict=True):
                t.copy_(s)

    def backward_prefix(self) -> None:
        """Exact mode: add the prompt-side gradient to the parameters' .grad (after all replays)."""
        if self.prefix_trace is None:
            raise RuntimeError(
                "backward_prefix needs a state captured with capture(..., prefix_grad=True); "
                "this one gives the conditional-response gradient only"
            )
        self.prefix_trace.backward(self)


_WEIGHT_PERIOD = 65521  # a word's weight is its index in its chunk mod this, plus 1


def _chunk_sums(t: torch.Tensor) -> torch.Tensor:
    """The tensor's raw 32-bit words weighted by position (mod 65521, plus 1) and summed per chunk of
    `_FINGERPRINT_CHUNK` words: int64 [chunks] on the tensor's device (int64 wraps alike on every device)."""
    if t.numel() == 0:
        return torch.zeros(0, dtype=torch.int64, device=t.device)
    words = t.detach().contiguous().view(-1).view(torch.uint8)
    pad = (-words.numel()) % 4
    if pad:
        words = torch.cat([words, words.new_zeros(pad)])
    words = words.view(torch.int32)
    weights = _weights(words.device)
    chunks = [words[start : start + _FINGERPRINT_CHUNK] for start in range(0, words.numel(), _FINGERPRINT_CHUNK)]
    return torch.stack([_weighted_sum(chunk, weights) for chunk in chunks])


@functools.cache
def _weights(device: torch.device) -> torch.Tensor:
    """The weights 1..65521 on `device`, made once a process (every fingerprint takes them, twice a step)."""
    return torch.arange(1, _WEIGHT_PERIOD + 1, device=device, dtype=torch.int64)


def _weighted_sum(chunk: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """sum_i (i mod 65521 + 1) * chunk[i] in int64, as sum_j (j + 1) * (the column sums of the chunk laid out in
    rows of 65521): equal mod 2^64 (a ring), and the words are read once by one reduction rather than converted,
    weighted and multiplied in int64 (at 131,072 positions on an H100 the plain form took ~50 ms of a 0.25 s step).
    A column sums at most 256 words (2^24 over 65,521) of 32 bits, so it cannot wrap."""
    rows, tail = divmod(chunk.numel(), _WEIGHT_PERIOD)
    total = torch.zeros((), dtype=torch.int64, device=chunk.device)
    if rows:
        columns = chunk[: rows * _WEIGHT_PERIOD].view(rows, _WEIGHT_PERIOD).sum(0, dtype=torch.int64)
        total = total + (columns * weights).sum()
    if tail:
        total = total + (chunk[rows * _WEIGHT_PERIOD :].to(torch.int64) * weights[:tail]).sum()
    return total
