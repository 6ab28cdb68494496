"""capture() and replay(): the transaction's two halves (docs/design.md).

    from longstraw import capture, extend, replay
    state = capture(model, prompt_ids)          # no autograd; ResidentState over prompt[:-1]
    logp = replay(model, state, response_ids)   # float32 [R] under autograd; state unchanged
    extend(model, state, more_ids)              # the same state, now over (prompt + more_ids)[:-1]

Capture walks the prompt (minus its last token) in chunks, writing each attention layer's K/V
into preallocated pages and carrying GDN states forward. Two loop orders give the same state:
chunk-major (each chunk through all layers; transient memory independent of the prompt length)
and layer-major (the whole prompt through one layer at a time; holds [P, hidden] activations,
used when they fit the memory budget). Replay feeds the last prompt token and the response
(minus its last token) on top of the pages, so every response token has a full autograd path.
"""

from __future__ import annotations

import math
from contextlib import contextmanager
from contextvars import ContextVar

import torch
from torch.utils.checkpoint import checkpoint

from longstraw.core import exact, exact_cp
from longstraw.cp.capture import capture_sharded
from longstraw.families import adapter_for
from longstraw.kernels.logprobs import token_logprobs
from longstraw.kernels.paged_attention import ForwardMemo
from longstraw.measure.memory import synchronize
from longstraw.measure.progress import CaptureProgress
from longstraw.models.lora_linear import merged_lora_for_capture, merged_weights_kept
from longstraw.state import ResidentState, chain_host_pages, prompt_hash
from longstraw.state.pages import check_entries_implement

DEFAULT_CHUNK = {"cpu": 2048, "cuda": 16384}


def _as_ids(ids, name: str, adapter) -> torch.Tensor:
    """`ids` checked (`_shaped_ids`, then `check_vocabulary`) as a 1-D int64 tensor."""
    ids = _shaped_ids(ids, name, adapter)
    check_vocabulary(ids, name, adapter)
    return ids


def _shaped_ids(ids, name: str, adapter) -> torch.Tensor:
    """`ids` as a 1-D int64 tensor on the model's device, or a clear error (no host sync)."""
    if not isinstance(ids, torch.Tensor):
        raise TypeError(f"{name} must be a torch.LongTensor, got {type(ids).__name__}")
    if ids.dtype not in (torch.int64, torch.int32):
        raise TypeError(f"{name} must hold integer token ids (int64), got dtype {ids.dtype}")
    if ids.dim() == 2 and ids.shape[0] == 1:
        ids = ids[0]
    if ids.dim() != 1:
        raise ValueError(f"{name} must be 1-D or [1, n], got shape {tuple(ids.shape)}")
    if ids.numel() == 0:
        raise ValueError(f"{name} is empty")
    if ids.device != adapter.device:
        raise ValueError(f"{name} is on {ids.device} but the model is on {adapter.device}")
    return ids.long()


def check_vocabulary(ids, name: str, adapter) -> None:
    """Refuse ids outside the vocabulary (one host sync)."""
    low, high = (int(v) for v in torch.stack([ids.min(), ids.max()]).tolist())
    if low < 0 or high >= adapter.vocab_size:
        raise ValueError(f"{name} has ids outside the vocabulary [0, {adapter.vocab_size}): min {low}, max {high}")


def capture(
    model,
    prompt_ids,
    prefix_grad: bool = False,
    *,
    chunk_size: int | None = None,
    order: str = "auto",
    memory_budget_bytes: int | None = None,
    progress: bool | None = None,
    cp=None,
    host_pages: bool = False,
    beyond_max_positions: bool = False,
) -> ResidentState:
    """Evaluate the prompt once without autograd and keep only its resident state.

    `host_pages=True` (MLA family) keeps the latent and index-key pages in (pinned) host memory;
    each layer reads them from there when it runs (`LatentPages`).

    `prefix_grad=True` is the exact mode (`longstraw.core.exact`): replays also accumulate the
    pages' gradients and `state.backward_prefix()` adds the prompt-side term. `cp` (a
    `longstraw.cp.CPGroup`) shards the capture over the context-parallel ranks
    (`longstraw.cp.capture`); `replay` and `score` then take the sharded state unchanged. A prompt
    longer than the model's `max_position_embeddings` is refused unless `beyond_max_positions`."""
    adapter = adapter_for(model)
    ids, host_ids = _checked_prompt(model, prompt_ids, adapter)
    chunk = _chunk_length(chunk_size, adapter.device)
    max_positions = _max_positions(adapter, ids.numel(), beyond_max_positions)
    if cp is not None:
        return _capture_sharded(
            model, adapter, ids, host_ids, chunk, progress, cp, prefix_grad, host_pages, max_positions
        )
    state = _allocated_state(adapter, host_ids, host_pages, prefix_grad, max_positions)
    order = _capture_order(order, adapter, state.positions, memory_budget_bytes)
    checkpoints = {} if prefix_grad else None  # exact mode: each GDN layer's state at every chunk boundary
    forward_layer = _capture_layer(adapter, checkpoints)
    layer_major = order == "layer"
    progress_bar = CaptureProgress(
        state.positions * (adapter.num_layers if layer_major else 1), progress, label=f"capture ({order}-major)"
    )
    with torch.no_grad(), adapter.selected(), merged_lora_for_capture():
        if layer_major:
            _layer_major(adapter, ids, state, chunk, forward_layer, progress_bar)
        else:
            _chunk_major(adapter, ids[: state.positions], state.layers, chunk, forward_layer, progress_bar)
    progress_bar.close()
    _bind(state, adapter, host_ids)  # its walk over the parameters runs while the device works through the capture
    synchronize(adapter.device)
    if prefix_grad:
        exact.enable(state, model, ids, chunk, checkpoints)
    return state


def _checked_prompt(model, prompt_ids, adapter, name: str = "prompt_ids") -> tuple[torch.Tensor, torch.Tensor]:
    """The prompt's ids on the model's device and on the host, checked, and the model checked deterministic
    (unless the caller just did)."""
    ids = _shaped_ids(prompt_ids, name, adapter)
    host_ids = ids.cpu()  # one copy to the host: the vocabulary check, the prompt's digest and its last token
    check_vocabulary(host_ids, name, adapter)
    if _deterministic_checked.get() is not model:
        check_deterministic(model)
    return ids, host_ids


def _chunk_length(chunk_size: int | None, device) -> int:
    """The positions a capture runs at a time: `chunk_size` (checked), else the device type's default."""
    if chunk_size is not None and (isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1):
        raise ValueError(f"chunk_size must be a positive integer, got {chunk_size!r}")
    return chunk_size or DEFAULT_CHUNK.get(device.type, 2048)


def _max_positions(adapter, tokens: int, beyond_max_positions: bool) -> int | None:
    """The positions the state may reach (the model's `max_position_embeddings`; None: no limit), refusing a
    prompt of more `tokens` unless `beyond_max_positions`, which lifts the limit."""
    limit = getattr(adapter.config, "max_position_embeddings", None)
    if limit and tokens > limit and not beyond_max_positions:
        raise ValueError(
            f"the prompt has {tokens} tokens but the model was configured for at most {limit} "
            "positions (max_position_embeddings); pass beyond_max_positions=True "
            "(config: capture.beyond_max_positions) to capture it anyway"
        )
    return None if beyond_max_positions else (limit or None)


def _capture_sharded(
    model, adapter, ids, host_ids, chunk: int, progress, cp, prefix_grad: bool, host_pages: bool, max_positions
) -> ResidentState:
    """The context-parallel capture (`longstraw.cp.capture`): this rank's shard of the state."""
    if host_pages:
        raise ValueError("host_pages=True is not implemented for a context-parallel capture")
    checkpoints = {} if prefix_grad else None  # exact mode: as in one process, for this rank's shard
    with merged_lora_for_capture():
        state = _bind(capture_sharded(model, ids, cp, chunk, progress, checkpoints), adapter, host_ids)
    state.max_positions = max_positions
    if prefix_grad:
        exact_cp.enable(state, model, ids, chunk, checkpoints)
    return state


def _allocated_state(adapter, host_ids, host_pages: bool, prefix_grad: bool, max_positions) -> ResidentState:
    """An empty resident state for the prompt `host_ids` (its last token replayed, not captured): each layer's
    entry allocated, in host memory with `host_pages` (MLA only, not in exact mode)."""
    device, dtype = adapter.device, adapter.compute_dtype
    positions = host_ids.numel() - 1
    per_position, constant = adapter.predicted_bytes(dtype)
    host = {}
    if host_pages:
        if not adapter.supports_host_pages:
            raise ValueError(
                f"host_pages=True: {adapter.config.model_type!r} models keep no host-resident pages "
                "(supported: the MLA family)"
            )
        if prefix_grad:
            raise ValueError("host_pages=True cannot be combined with prefix_grad=True (exact mode)")
        host = {"host": True}
    state = ResidentState(
        layers=[adapter.allocate_entry(i, positions, dtype, device, **host) for i in range(adapter.num_layers)],
        positions=positions,
        last_token=int(host_ids[-1]),
        model_type=adapter.config.model_type,
        predicted_bytes_per_position=per_position,
        predicted_constant_bytes=constant,
        dtype=dtype,
        device=device,
        max_positions=max_positions,
    )
    chain_host_pages(state.layers)
    return state


def _capture_order(order: str, adapter, positions: int, memory_budget_bytes: int | None) -> str:
    """`chunk` or `layer`; "auto" takes layer-major when the family runs it and twice the prompt's `[P, hidden]`
    activations fit the budget (`memory_budget_bytes`, else the device's default)."""
    if order == "auto":
        dtype = adapter.compute_dtype
        budget = memory_budget_bytes if memory_budget_bytes is not None else _default_budget(adapter.device)
        hidden_bytes = positions * adapter.config.hidden_size * torch.empty((), dtype=dtype).element_size()
        order = "layer" if adapter.layer_major_capture and 2 * hidden_bytes <= budget else "chunk"
    if order not in ("chunk", "layer"):
        raise ValueError(f"order must be 'auto', 'chunk' or 'layer', got {order!r}")
    return order


def _capture_layer(adapter, checkpoints: dict | None):
    """`forward_layer(i, h, pe, entry, start)`: one layer of one chunk writing its entry; its output, or None
    for the last layer (nothing reads its output, so only its entry is written). In exact mode it first saves
    the entry's chunk checkpoint into `checkpoints`."""
    last = adapter.num_layers - 1

    def forward_layer(i, h, pe, entry, start):
        if checkpoints is not None and (saved := entry.chunk_checkpoint()) is not None:
            checkpoints[(i, start)] = saved
        if i == last:
            return adapter.layer_state_forward(i, h, pe, entry)
        return adapter.layer_forward(i, h, pe, entry, capturing=True)

    return forward_layer


def _chunk_major(adapter, ids, layers, chunk: int, forward_layer, progress_bar, first: int = 0) -> None:
    """Each chunk of `ids` (the tokens at positions `first`, `first + 1`, ...) through every layer's entry of
    `layers`, then the next chunk."""
    end = first + ids.numel()
    for start in range(first, end, chunk):
        stop = min(start + chunk, end)
        h = adapter.embed(ids[None, start - first : stop - first])
        pe = adapter.position_embeddings(h, start)
        for i, entry in enumerate(layers):
            h = forward_layer(i, h, pe, entry, start)
        progress_bar.advance_to(stop - first)


def _layer_major(adapter, ids, state: ResidentState, chunk: int, forward_layer, progress_bar) -> None:
    """Each layer over every chunk of the prompt, then the next layer: the `[P, hidden]` activations held."""
    positions = state.positions
    h_all = adapter.embed(ids[None, :positions])
    for i, entry in enumerate(state.layers):
        with merged_weights_kept():  # the layer's merged LoRA weights, built once for its chunks
            for start in range(0, positions, chunk):
                h = h_all[:, start : start + chunk]
                pe = adapter.position_embeddings(h, start)
                out = forward_layer(i, h, pe, entry, start)
                if out is not None:
                    h_all[:, start : start + chunk] = out
        progress_bar.advance_to((i + 1) * positions, label=f"capture layer {i + 1}/{adapter.num_layers}")
    del h_all


def _bind(state: ResidentState, adapter, ids) -> ResidentState:
    """Record the model and the prompt the state belongs to (`check_state` compares them)."""
    state.prompt_hash = prompt_hash(ids)
    state.binding, state.prompt = adapter.binding(), state.prompt_hash.hexdigest()[:32]
    return state


def extend(model, state: ResidentState, new_ids, *, chunk_size: int | None = None, progress=None) -> ResidentState:
    """Grow `state`, in place, by the prompt tokens `new_ids`: afterwards it is the state of the prompt it covered
    followed by `new_ids` (an agent's history: the next episode starts where the last one ended), as one capture
    of the whole would leave it, without running the prefix again. Its last token and `new_ids` but the last run
    through every layer without autograd, a chunk at a time (chunk-major, as `capture`), appended to each entry
    (`entry.with_room`: attention and latent pages copied into larger ones, constant-size states as they are).
    Refused before any work: a state of another model, an exact-mode or context-parallel state
    (`why_not_extendable`), ids a capture would refuse, a prompt past the model's positions. An extension that
    fails midway leaves the state marked unusable (`damaged`). Returns the state."""
    adapter = adapter_for(model)
    check_state(adapter, state)
    why = state.why_not_extendable()
    if why:
        raise ValueError(f"extend: cannot grow {why}")
    check_entries_implement(state.layers, "with_room", "extend")
    ids, host_ids = _checked_prompt(model, new_ids, adapter, "new_ids")
    if state.max_positions is not None and state.positions + 1 + ids.numel() > state.max_positions:
        raise ValueError(
            f"extend: a prompt of {state.positions + 1} tokens and {ids.numel()} more passes the model's "
            f"max_position_embeddings ({state.max_positions}); capture with beyond_max_positions=True to go past it"
        )
    chunk, first = _chunk_length(chunk_size, adapter.device), state.positions
    inputs = torch.cat([ids.new_full((1,), state.last_token), ids[:-1]])  # the last token is only predicted
    state.layers = [entry.with_room(ids.numel()) for entry in state.layers]
    chain_host_pages(state.layers)
    progress_bar = CaptureProgress(ids.numel(), progress, label="extend")
    try:
        with torch.no_grad(), adapter.selected(), merged_lora_for_capture():
            _chunk_major(adapter, inputs, state.layers, chunk, _capture_layer(adapter, None), progress_bar, first)
    except BaseException as exc:
        state.damaged = f"an extension failed midway ({type(exc).__name__}: {exc})"
        raise
    finally:
        progress_bar.close()
    state.cover_more(host_ids)
    synchronize(adapter.device)
    return state


def check_state(adapter, state) -> None:
    """Refuse a state that does not belong to the adapter's model (its layers, shapes, weights, device, dtype)."""
    if not isinstance(state, ResidentState):
        raise TypeError(f"state must be a ResidentState from capture(), got {type(state).__name__}")
    if state.model_type != adapter.config.model_type:
        raise ValueError(f"state was captured from a {state.model_type!r} model, not {adapter.config.model_type!r}")
    if state.device != adapter.device:
        raise ValueError(f"state is on {state.device} but the model is on {adapter.device}")
    if state.dtype != adapter.compute_dtype:
        raise TypeError(f"state pages are {state.dtype} but the model computes in {adapter.compute_dtype}")
    binding = adapter.binding()
    if math.isnan(binding.frozen):  # NaN equals nothing, itself included: no state would ever match the checksum
        raise ValueError(
            "the model's frozen weights hold NaN (a non-finite value): every log-prob through them is NaN; "
            "load or build the model again"
        )
    state.check_model(binding)


_deterministic_checked: ContextVar = ContextVar("deterministic_checked", default=None)


@contextmanager
def deterministic_checked(model):
    """Within the block, a capture of `model` skips `check_deterministic`: its caller (a step, which checks
    before any work) has just made it, and the module walk is host time inside the timed capture."""
    token = _deterministic_checked.set(model)
    try:
        yield
    finally:
        _deterministic_checked.reset(token)


def check_deterministic(model) -> None:
    """Refuse a policy whose dropout is active (a dropout module in training mode with p > 0, e.g. peft's
    LoRA dropout, whose modules start in training mode): capture, scoring, sampling and replay would each
    draw their own masks, so the old-policy log-probs would not be the replay's and the on-policy ratio
    would no longer be 1."""
    for name, module in adapter_for(model).lm.named_modules():
        # HF's attention modules keep attention_dropout as a plain attribute: read from the instance's dict, as
        # getattr's miss on the other thousand modules of a large model costs milliseconds before every capture
        p = (
            module.p
            if isinstance(module, torch.nn.modules.dropout._DropoutNd)
            else vars(module).get("attention_dropout", 0.0)
        )
        if module.training and isinstance(p, (int, float)) and p > 0:
            raise ValueError(
                f"{name or 'the model'}: dropout p={p} is active (training mode), so scoring and replay "
                "would be random and the on-policy ratio no longer 1; use dropout 0 (LoRA: "
                "lora.dropout: 0) or put the model in eval mode (model.eval())"
            )


def reuse_state(model, state: ResidentState) -> ResidentState:
    """Declare that `state` serves the model's current weights although they were written since the capture
    (prefix reuse on purpose: the staleness oracle, a trainer's refresh policy, a resumed run). `grpo_step`
    does this itself for the update it makes; a state of another model is still refused."""
    state.rebind(adapter_for(model).binding())
    return state


def _default_budget(device) -> int:
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return free // 8
    return 512 << 20


def replay(
    model, state: ResidentState, response_ids, *, rows_per_chunk: int | None = None, checkpoint_layers: bool = False
) -> torch.Tensor:
    """float32 [R] log p(y_t | prompt, y_<t) under autograd, computed on top of `state`.

    `checkpoint_layers=True`: whole-layer activation checkpointing (the paper replays so): each layer
    (`adapter.checkpoint_segments`) keeps only its input for the backward and recomputes its forward
    there, so the live graph is one layer's activations plus a hidden state per layer, for a second
    forward's time."""
    return replay_members(
        model, state, [response_ids], rows_per_chunk=rows_per_chunk, checkpoint_layers=checkpoint_layers
    )[0]


def replay_members(
    model,
    state: ResidentState,
    responses,
    *,
    rows_per_chunk: int | None = None,
    checkpoint_layers: bool = False,
    ids_checked: bool = False,
) -> list[torch.Tensor]:
    """`replay` of k responses as one batch: one float32 [R_i] tensor per response, under one graph.

    The responses are right-padded to the longest (`member_inputs`) and each layer's entry is read as k
    sequences share it (`members_view`: attention pages are read in place, the rows of the k members folded
    over them as decoding folds its samples; a GDN state is repeated). One response is `replay` exactly: no
    padding, the entries as they are.
    `ids_checked=True`: the caller has checked the ids against the vocabulary (`grpo_step` does, once for the
    group), so the batch runs without that check's host sync."""
    adapter = adapter_for(model)
    check_state(adapter, state)
    targets = [_shaped_ids(y, "response_ids", adapter) for y in responses]
    every_target = torch.cat(targets)
    if not ids_checked:
        check_vocabulary(every_target, "response_ids", adapter)  # one host sync for the k members
    lengths = [t.numel() for t in targets]
    state.check_positions(max(lengths), "response_ids")
    return replay_inputs(
        adapter,
        state,
        member_inputs(state, targets),
        every_target,
        lengths,
        rows_per_chunk=rows_per_chunk,
        checkpoint_layers=checkpoint_layers,
    )


def member_inputs(state: ResidentState, targets) -> torch.Tensor:
    """[k, longest] replay inputs of k checked responses: the prompt's last token, then each response without
    its last token, right-padded to the longest (a pad comes after every token of its row, so causally no real
    token reads it)."""
    longest = max(t.numel() for t in targets)
    return torch.stack(
        [
            torch.nn.functional.pad(
                torch.cat([t.new_full((1,), state.last_token), t[:-1]]),
                (0, longest - t.numel()),
                value=state.last_token,
            )
            for t in targets
        ]
    )


def replay_inputs(
    adapter,
    state: ResidentState,
    inputs_BR,
    every_target,
    lengths: list[int],
    *,
    rows_per_chunk: int | None = None,
    checkpoint_layers: bool = False,
) -> list[torch.Tensor]:
    """`replay_members` on prepared inputs (`member_inputs`) and the members' targets, concatenated: the
    layers and the log-probs, nothing checked and no host sync (what a CUDA graph records: `member_graphs`)."""
    entries = state.layers if len(lengths) == 1 else [members_view(e, len(lengths)) for e in state.layers]
    with adapter.selected():
        h = adapter.embed(inputs_BR)
        pe = adapter.position_embeddings(h, state.positions)
        if checkpoint_layers and torch.is_grad_enabled():
            for layers in adapter.checkpoint_segments():
                h = _checkpointed_layers(adapter, layers, h, pe, entries)
        else:
            for i, entry in enumerate(entries):
                h = adapter.layer_forward(i, h, pe, entry, capturing=False)
        h = adapter.final_hidden(h)
    rows = h[0] if len(lengths) == 1 else torch.cat([h[i, :n] for i, n in enumerate(lengths)])
    kwargs = {"rows_per_chunk": rows_per_chunk} if rows_per_chunk else {}
    return list(token_logprobs(rows, adapter.lm_head, every_target, **kwargs).split(lengths))


def members_view(entry, members: int):
    """`entry` as `members` replayed sequences read it together (`entry.for_members`), or a clear refusal."""
    check_members_entry(entry, members)
    return entry.for_members(members)


def check_members_entry(entry, members: int = 2) -> None:
    """Refuse an entry that several replayed sequences cannot read at once (it has no `for_members`)."""
    if not hasattr(entry, "for_members"):
        raise ValueError(
            f"replaying {members} members as one batch: {type(entry).__name__} entries cannot be read "
            "by several sequences at once yet (attention pages and GDN states can); replay one member "
            "at a time (micro_batch 1)"
        )


def _checkpointed_layers(adapter, layers: range, h, pe, entries):
    """A run of replayed layers (`adapter.checkpoint_segments`) under non-reentrant checkpointing. Its
    recompute runs in the backward, outside `replay`'s `adapter.selected()`, so it enters that context
    again (the paged attention the layers dispatch to); the pages and states they read are closed over,
    so their gradients (exact mode) still arrive. The forward's paged-attention outputs are kept
    (`ForwardMemo`, one [R, heads, head_dim] output per attention layer) and the recompute reuses them
    instead of attending over the whole prefix a second time."""

    def run(h_BTH):
        for i in layers:
            h_BTH = adapter.layer_forward(i, h_BTH, pe, entries[i], capturing=False)
        return h_BTH

    memo = ForwardMemo()

    @contextmanager
    def recompute():
        with adapter.selected(), memo.reusing():
            yield

    return checkpoint(run, h, use_reentrant=False, context_fn=lambda: (memo.remembering(), recompute()))


def score(model, state: ResidentState, response_ids, **kwargs) -> torch.Tensor:
    """Graph-free log-probs (old-policy or reference scoring) from the same state."""
    with torch.no_grad():
        return replay(model, state, response_ids, **kwargs)
