"""Rollouts: sample G responses from a captured prompt by incremental decoding on its pages.

    state = capture(model, prompt_ids)
    rollouts = sample(model, state, SamplingConfig(num_generations=8, max_new_tokens=64, temperature=1.0,
                                                   top_p=0.95, stop_ids=(eos,), seed=0))
    rollouts.responses[i], rollouts.logprobs[i]      # token ids (stop token included), log p per token

Decoding starts from the last prompt token (the state covers the prompt minus it).
The G sequences share the prompt's attention pages and MLA latent pages (read in place, never copied)
and keep their own pages for the generated tokens (MLA: latents, and index keys on DSA index layers,
so each sequence's top-k runs over the prompt's keys and its own); Gated DeltaNet states (constant
size) are copied per sequence.
The captured state itself is never written.

Sampling follows HF `generate` step for step, so the same seed gives the same tokens: float32
logits, temperature then top-p through HF's own logits warpers, one draw over all G rows per step
(`torch.multinomial`'s own arithmetic for one sample: the argmax of p / q, q ~ Exp(1) from the generator;
finished rows too, then replaced by `pad_id`), stopping when every row has emitted a stop id or
`max_new_tokens` is reached. `temperature == 0` is greedy.

The phases, as gpt-fast's `generate.py` has them (the capture is the prefill): `Decoder.step` decodes one token
for the G rows and keeps everything on the device: the token, its log-prob and which rows finished are written into
buffers at the clock's step (`state.pages.DecodeClock`), so every step runs the same kernels on the same tensors.
On CUDA (`SamplingConfig.cuda_graph`) a step is recorded once as a CUDA graph (`DecodeGraph`) and launched per
token; the host looks at the rows only every `stop_check_every` tokens (one sync), so a few steps may run after
the last row stopped, each writing pads. LoRA layers decode on their merged weights
(`models.lora_linear.merged_lora_for_decoding`); on CUDA, an attention layer's q/k/v and an MLP's gate/up are one
GEMM each, a plain attention layer rotates and appends in one launch (`families.attention_decode`) and a dense
layer's RMSNorms fold into the projections after them (`families.folded_norms`); a step reads the rotary's cos and
sin from a table of the decode's positions computed once (`RotaryTable`: each step's own, bit for bit) and, without
top-p, draws, takes the log-prob and writes the buffers in two Triton launches after torch's Exp(1) draws
(`kernels.sampling_triton`: the torch tail's tokens from a seed but for a near-exact tie, its log-probs within float32
rounding; `Decoder._torch_tail` is the reference).
`Decoder.step` run eagerly is the plain reference the graph records. `sample(..., session=DecodeSession())` keeps the
decoder, its graph and its merged and stacked weights across calls of one signature (the trainer's steps), the
state copied in and the weights rebuilt in place at each call; a fresh `sample()` is its reference.

The log-probs returned are the policy's (temperature 1, no top-p truncation), i.e. what
`longstraw.core.transaction.score` recomputes from the state: the old-policy log-probs of GRPO.
"""

from __future__ import annotations

import dataclasses
import functools
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten
from transformers.generation.logits_process import TemperatureLogitsWarper, TopPLogitsWarper

from longstraw.config.grpo import GROUP_SIZE
from longstraw.core.member_graphs import own_copy, state_layout
from longstraw.core.transaction import check_deterministic, check_state
from longstraw.families import adapter_for
from longstraw.kernels.optional_import import optional_function
from longstraw.kernels.rms_norm import decoding_norms
from longstraw.measure.timing import warmup_stream
from longstraw.models.lora_linear import (
    KeptWeights,
    in_place_lora_class,
    merged_lora_for_decoding,
    single_plain_adapter,
)
from longstraw.models.stacked_projections import stacked_projections_for_decoding
from longstraw.state import ResidentState
from longstraw.state.pages import DecodeClock, check_entries_implement

# `sampling_triton.sample_step_triton`, or None when Triton does not import
_load_sample_step = functools.partial(optional_function, "longstraw.kernels.sampling_triton", "sample_step_triton")


def on_cuda_unless(setting: bool | None, on_cuda: bool) -> bool:
    """A `SamplingConfig` switch as asked, or (None) on where the state is on CUDA."""
    return on_cuda if setting is None else setting


@dataclass(frozen=True)
class SamplingConfig:
    num_generations: int = GROUP_SIZE  # G
    max_new_tokens: int = 32
    temperature: float = 1.0
    top_p: float = 1.0
    stop_ids: tuple[int, ...] = ()
    pad_id: int = 0
    seed: int | None = 0
    # record a decoding step as a CUDA graph and launch it per token (CUDA, every entry graph-safe); None: on CUDA
    cuda_graph: bool | None = None
    # tokens between the host's looks at which rows stopped (one device sync each); None: 1 off CUDA, 16 on it
    stop_check_every: int | None = None
    progress: bool = False  # a line on stderr per stop check: tokens so far, rows still going, tokens a second
    # q/k/v and gate/up as one GEMM each (`models.stacked_projections`: a copy of those weights while sampling);
    # None: on CUDA, where a decoding step's GEMMs are latency-bound
    stacked_projections: bool | None = None
    # a dense layer's two RMSNorms folded into the stacked projections after them (`families.folded_norms`: within
    # the dtype's rounding of the unfolded step, not bit for bit); None: on CUDA, where the projections stack
    folded_norms: bool | None = None
    # the rotary's cos and sin at every position the decode reaches computed once, each step reading its row by the
    # clock's step (`RotaryTable`: each step's own, bit for bit; a rotary whose frequencies follow the positions
    # asked, HF's dynamic and longrope types, runs per step); None: on CUDA, where HF's rotary is ~7 launches a step
    rotary_table: bool | None = None
    # the draw, the log-prob and the step's writes in two Triton launches (`kernels.sampling_triton`: CUDA, without
    # top-p; the torch tail is the reference); None: on CUDA, where the torch tail is ~20 latency-bound launches
    fused_sampler: bool | None = None

    def __post_init__(self):
        if self.num_generations < 1 or self.max_new_tokens < 1:
            raise ValueError(
                f"num_generations and max_new_tokens must be >= 1, got {self.num_generations}, {self.max_new_tokens}"
            )
        if self.temperature < 0 or not 0 < self.top_p <= 1:
            raise ValueError(f"need temperature >= 0 and 0 < top_p <= 1, got {self.temperature}, {self.top_p}")
        if self.stop_check_every is not None and self.stop_check_every < 1:
            raise ValueError(f"stop_check_every must be >= 1 (or None), got {self.stop_check_every}")


@dataclass
class Rollouts:
    responses: list[torch.Tensor]
    logprobs: list[torch.Tensor]
    finished: list[bool] = field(default_factory=list)  # ended on a stop id (else: max_new_tokens)
    graphed: bool = False  # decoded through a recorded CUDA graph
    steps: int = 0  # decoding steps run (at most max_new_tokens; a few past the last stop between checks)


@contextmanager
def decoding(
    adapter, stacked_projections: bool | None = None, kept: KeptWeights | None = None, folded_norms: bool | None = None
):
    """What decoding steps run under: no autograd, the paged attention implementation, LoRA layers on their merged
    weights (built once), Llama-form norms in one launch (`kernels.rms_norm.decoding_norms`), and (on CUDA unless
    said otherwise) stacked projections (`models.stacked_projections`) with a dense layer's norms folded into them
    (`families.folded_norms`). `kept`: where the merged and stacked weights are kept (a `DecodeSession`'s, across
    calls); None, for the block only."""
    on_cuda = adapter.device.type == "cuda"
    stacked, folded = on_cuda_unless(stacked_projections, on_cuda), on_cuda_unless(folded_norms, on_cuda)
    with torch.no_grad(), adapter.selected(), merged_lora_for_decoding(kept), decoding_norms():
        with stacked_projections_for_decoding(stacked, kept, fold_norms=folded):
            yield


def _decode_entries(state: ResidentState, batch: int, clock: DecodeClock) -> list:
    """Each layer's entry as `batch` sequences decode on it (`entry.for_decoding`), refused before any step."""
    check_entries_implement(state.layers, "for_decoding", "sampling")
    return [entry.for_decoding(batch, clock) for entry in state.layers]


class RotaryTable:
    """The position embeddings (the rotary's cos and sin) of every position a decode reaches, computed once by the
    adapter's own `position_embeddings_at` over the clock's positions; a step reads its row by the clock's step on
    the device (one launch, the same at every step), where HF's rotary module recomputes them (~7 launches). HF's
    rotary takes each position times the inverse frequencies on its own (a product, or a matmul of inner size 1:
    no sum), then cos and sin elementwise, so a row is what that step computes, bit for bit (tests/test_rotary.py).
    Whatever the adapter's answer holds (Gemma 3's rotary a layer type) is stacked into one tensor."""

    def __init__(self, adapter, clock: DecodeClock, h_11H: torch.Tensor):
        positions_1T = (clock.start + torch.arange(clock.capacity, device=clock.step_1.device))[None]
        leaves, self.spec = tree_flatten(adapter.position_embeddings_at(h_11H, positions_1T))
        self.rows_LBTD = torch.stack(leaves)  # each (cos or sin) [B, T, D], positions along T

    def at(self, step_1: torch.Tensor):
        """The adapter's answer at the position of step `step_1` (a device index)."""
        return tree_unflatten(list(self.rows_LBTD.index_select(2, step_1).unbind(0)), self.spec)


def _uses_rotary_table(adapter, config: SamplingConfig, on_cuda: bool) -> bool:
    """Asked (or on CUDA by default), and the adapter's rotary gives a position the same cos and sin whatever other
    positions a call asks (`FamilyAdapter.rotary_fixed`)."""
    wanted = on_cuda_unless(config.rotary_table, on_cuda)
    return wanted and adapter.rotary_fixed


def _fused_sampler(config: SamplingConfig, on_cuda: bool):
    """`sampling_triton.sample_step_triton` where a step samples through it: asked (or on CUDA by default), without
    top-p (HF's warper stays the torch tail's), Triton importing; else None (the torch tail)."""
    wanted = on_cuda_unless(config.fused_sampler, on_cuda)
    if wanted and not on_cuda:
        raise ValueError("sampling: fused_sampler needs the state on a CUDA device")
    return _load_sample_step() if wanted and config.top_p == 1 else None


class Decoder:
    """G rows decoding on one captured prompt: the entries, the clock and the device buffers a step writes."""

    def __init__(self, adapter, state: ResidentState, config: SamplingConfig):
        G, T, device = config.num_generations, config.max_new_tokens, state.device
        self.adapter, self.config = adapter, config
        self.clock = DecodeClock.allocate(state.positions, T, device)
        self.entries = _decode_entries(state, G, self.clock)
        self.generator = torch.Generator(device=device) if config.seed is not None else None
        self.warpers = [] if config.temperature == 0 else [TemperatureLogitsWarper(config.temperature)]
        if config.temperature > 0 and config.top_p < 1:
            self.warpers.append(TopPLogitsWarper(config.top_p))
        self.stop_S = torch.tensor(config.stop_ids, dtype=torch.long, device=device)
        self.tokens_G = torch.empty(G, dtype=torch.long, device=device)
        self.unfinished_G = torch.empty(G, dtype=torch.bool, device=device)
        self.finite_1 = torch.empty(1, dtype=torch.bool, device=device)  # every step's logits were finite
        # a multi-turn rollout's observation tokens (`training.agent_rollout`): the rows `forcing_G` take `forced_G`
        self.forcing_G = torch.zeros(G, dtype=torch.bool, device=device)
        self.forced_G = torch.zeros(G, dtype=torch.long, device=device)
        self.tokens_GT = torch.empty(G, T, dtype=torch.long, device=device)
        self.logps_GT = torch.empty(G, T, dtype=torch.float32, device=device)
        self._start(state.last_token)
        on_cuda = self.clock.step_1.is_cuda
        self.sample_step = _fused_sampler(config, on_cuda)
        self.rotary_table = None
        if _uses_rotary_table(adapter, config, on_cuda):  # a step's embedded rows: the rotary reads their dtype
            self.rotary_table = RotaryTable(adapter, self.clock, adapter.embed(self.tokens_G[:1, None]))

    def _start(self, last_token: int) -> None:
        """The clock, the buffers and the generator as a decode starts, written in place (a session's later calls
        start again on the tensors its graph recorded)."""
        self.clock.step_1.zero_()
        if self.generator is not None:
            # a graph the generator is registered with reads its seed and offset at each launch
            self.generator.manual_seed(self.config.seed)
        self.tokens_G.fill_(last_token)
        self.unfinished_G.fill_(True)
        self.finite_1.fill_(True)
        self.tokens_GT.fill_(self.config.pad_id)
        self.logps_GT.zero_()

    def restart(self, state: ResidentState, config: SamplingConfig) -> None:
        """Decode anew from `state`, of the layout this decoder was built on, with `config` (another seed): each
        graph-safe entry refilled in place from the state's own decoding entry (every tensor it holds, the prompt's
        pages included: what a recorded step reads at their addresses), the others (eager) replaced by it; then
        `_start`. The rotary table and the sampler stand: the session's signature fixes the positions and the config
        but its seed. The state is only read."""
        self.config = config
        fresh = _decode_entries(state, config.num_generations, self.clock)
        for i, (kept, new) in enumerate(zip(self.entries, fresh, strict=True)):
            if getattr(kept, "graph_safe", False):
                for tensor, value in zip(kept.tensors(), new.tensors(), strict=True):
                    tensor.copy_(value)
            else:
                self.entries[i] = new
        self._start(state.last_token)

    @property
    def graph_safe(self) -> bool:
        return all(getattr(entry, "graph_safe", False) for entry in self.entries)

    def logits(self) -> torch.Tensor:
        """The float32 logits [G, V] of the rows' next token: the current one through every layer."""
        adapter, clock = self.adapter, self.clock
        h = adapter.embed(self.tokens_G[:, None])
        if self.rotary_table is None:
            pe = adapter.position_embeddings_at(h, clock.positions_11())
        else:
            pe = self.rotary_table.at(clock.step_1)
        for i, entry in enumerate(self.entries):
            h = adapter.layer_forward(i, h, pe, entry, capturing=True)
        return adapter.lm_head(adapter.final_hidden(h))[:, -1].float()

    def draw(self, logits_GV: torch.Tensor) -> torch.Tensor:
        """The next token of each row, as HF's `generate` draws it (warpers, then one multinomial draw)."""
        if self.config.temperature == 0:
            return logits_GV.argmax(-1)
        scores = logits_GV
        for warp in self.warpers:
            scores = warp(None, scores)
        probs = torch.softmax(scores, dim=-1)
        # torch.multinomial's own arithmetic for one sample, without its host-side checks of the probabilities
        return probs.div_(self._exponential(probs)).argmax(-1)

    def _exponential(self, like_GV: torch.Tensor) -> torch.Tensor:
        """Exp(1) draws of `like_GV`'s shape from the generator: a draw's q (what torch.multinomial takes)."""
        return torch.empty_like(like_GV).exponential_(1, generator=self.generator)

    def step(self, forced: bool = False) -> None:
        """Decode one token for every row: its token and log-prob into the buffers at the clock's step, the rows
        that emitted a stop id marked finished, the clock advanced. No host sync. `forced`: the rows `forcing_G`
        take their `forced_G` token instead of the drawn one, its log-prob recorded all the same (a multi-turn
        rollout's observation tokens, which the host writes into those buffers before each step)."""
        logits_GV = self.logits()
        if self.sample_step is None:
            self._torch_tail(logits_GV, forced)
        else:
            self._fused_tail(logits_GV, forced)
        self.clock.advance()

    def _fused_tail(self, logits_GV: torch.Tensor, forced: bool) -> None:
        """`_torch_tail` in two Triton launches after torch's Exp(1) draws (`kernels.sampling_triton`)."""
        q_GV = None if self.config.temperature == 0 else self._exponential(logits_GV)
        self.sample_step(
            logits_GV, q_GV, self.config.temperature, self.stop_S, self.config.pad_id, self.clock.step_1,
            self.tokens_G, self.unfinished_G, self.finite_1, self.tokens_GT, self.logps_GT,
            forcing=(self.forcing_G, self.forced_G) if forced else None,
        )  # fmt: skip

    def _torch_tail(self, logits_GV: torch.Tensor, forced: bool) -> None:
        """What a step does after the logits, in torch (the fused sampler's reference): the draw, the forced tokens,
        the log-prob, the pads of finished rows, the buffers' writes at the clock's step, the stop test."""
        self.finite_1 &= torch.isfinite(logits_GV).all()
        next_G = self.draw(logits_GV)
        if forced:
            next_G = torch.where(self.forcing_G, self.forced_G, next_G)
        logp_G = torch.log_softmax(logits_GV, -1).gather(1, next_G[:, None]).squeeze(1)
        next_G = torch.where(self.unfinished_G, next_G, self.config.pad_id)
        self.tokens_GT.index_copy_(1, self.clock.step_1, next_G[:, None])
        self.logps_GT.index_copy_(1, self.clock.step_1, logp_G[:, None])
        self.unfinished_G &= ~(next_G[:, None] == self.stop_S).any(1)
        self.tokens_G.copy_(next_G)

    def rollouts(self, steps: int, graphed: bool) -> Rollouts:
        """Each row's response up to its first stop id (included), or every step's token; refused where a step's
        logits were not finite."""
        if not bool(self.finite_1):
            raise ValueError("sampling: the policy's logits are not finite (a non-finite weight or activation)")
        tokens_GT, logps_GT = self.tokens_GT[:, :steps], self.logps_GT[:, :steps]
        stops_GT = torch.isin(tokens_GT, self.stop_S)
        responses, logprobs, finished = [], [], []
        for g in range(tokens_GT.shape[0]):
            hits = stops_GT[g].nonzero()
            end = int(hits[0]) + 1 if hits.numel() else steps
            responses.append(tokens_GT[g, :end].clone())
            logprobs.append(logps_GT[g, :end].clone())
            finished.append(bool(hits.numel()))
        return Rollouts(responses, logprobs, finished, graphed, steps)


class DecodeGraph:
    """`Decoder.step` recorded as one CUDA graph: torch's recipe (a warm-up on a side stream, which is the first
    real step: lazy initialisation, autotuning and the merged LoRA weights happen there, then the recording, which
    runs nothing), the sampling generator registered with the graph so each launch draws what the eager step
    would. Every later token is one launch. `forced`: the step reads the decoder's forced-token buffers (what the
    host writes there before a launch, it reads)."""

    def __init__(self, decoder: Decoder, forced: bool = False):
        device = decoder.clock.step_1.device
        side = warmup_stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            decoder.step(forced)
        torch.cuda.current_stream(device).wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        if decoder.generator is not None:
            self.graph.register_generator_state(decoder.generator)
        with torch.cuda.graph(self.graph):
            decoder.step(forced)

    def step(self) -> None:
        self.graph.replay()


def uses_graph(decoder: Decoder, config: SamplingConfig) -> bool:
    """Whether to record the step: asked (or on CUDA by default) and every decoding entry graph-safe."""
    on_cuda = decoder.clock.step_1.is_cuda
    wanted = on_cuda_unless(config.cuda_graph, on_cuda)
    if wanted and not on_cuda:
        raise ValueError("sampling: cuda_graph needs the state on a CUDA device")
    if wanted and not decoder.graph_safe and config.cuda_graph:
        kinds = sorted({type(e).__name__ for e in decoder.entries if not getattr(e, "graph_safe", False)})
        raise ValueError(f"sampling: cuda_graph: {', '.join(kinds)} entries decode by a host-side count")
    return wanted and decoder.graph_safe


def _show_progress(steps: int, config: SamplingConfig, going: int, seconds: float) -> None:
    rate = steps * config.num_generations / max(seconds, 1e-9)
    line = f"sampling: {steps}/{config.max_new_tokens} tokens, {going} of {config.num_generations} rows going"
    print(f"{line}, {rate:.0f} tokens/s", file=sys.stderr, flush=True)


def _recorded(decoder: Decoder, config: SamplingConfig) -> DecodeGraph | None:
    """The step recorded as a CUDA graph where `uses_graph` says so (its warm-up ran the first step), else None."""
    return DecodeGraph(decoder) if uses_graph(decoder, config) else None


def _decode(decoder: Decoder, graph: DecodeGraph | None, config: SamplingConfig, steps: int) -> int:
    """Steps after the `steps` already run, launches of `graph` or eager, until every row stopped (the host looks
    every `stop_check_every` tokens) or `max_new_tokens`: the steps run in all."""
    run = decoder.step if graph is None else graph.step
    every = config.stop_check_every or (16 if decoder.clock.step_1.is_cuda else 1)
    started = time.perf_counter()
    while steps < config.max_new_tokens:
        for _ in range(min(every - steps % every, config.max_new_tokens - steps)):
            run()
            steps += 1
        going = int(decoder.unfinished_G.sum())  # the one sync per `every` tokens
        if config.progress:
            _show_progress(steps, config, going, time.perf_counter() - started)
        if not going:
            break
    return steps


def _new_decode(
    adapter, decoder: Decoder, config: SamplingConfig, kept: KeptWeights | None = None
) -> tuple[Rollouts, DecodeGraph | None]:
    """A new decoder's rollouts and its recorded step (None: eager), the merged and stacked weights built in `kept`."""
    with decoding(adapter, config.stacked_projections, kept, config.folded_norms):
        graph = _recorded(decoder, config)
        steps = _decode(decoder, graph, config, steps=int(graph is not None))
    return decoder.rollouts(steps, graph is not None), graph


def _plain(adapter, state: ResidentState, config: SamplingConfig) -> Rollouts:
    """`sample` without a session: a decoder (and a recorded step) of the call's own."""
    return _new_decode(adapter, Decoder(adapter, state, config), config)[0]


class DecodeSession:
    """A sampler's decoder and recorded step, kept across `sample` calls: the trainer samples every step with one G
    and response length from a new capture of a prompt of one length, and building the decoder (the merged and
    stacked weights, the warm-up step, the recording) costs more than a short decode. The replay side's sibling is
    `core.member_graphs.MemberGraphs`.

    A call whose signature (`_signature`: the model and its weights' storages, the LoRA layers' active adapters, the
    state's layout, the config but its seed) is the last one's copies the state's decoding entries into the
    session's own (the prompt's pages into its copy of the state: one more resident state's memory), rebuilds the
    merged and stacked weights in place from the parameters as they are now (`KeptWeights.refresh`), starts the
    clock, buffers and generator again (`Decoder.restart`) and launches the graph per token; off CUDA the same,
    with eager steps. Another signature builds anew (`records` counts the builds). A state whose layout a graph
    cannot follow (context-parallel, exact mode, host pages) decodes the plain way. The state is only read."""

    def __init__(self):
        self.signature = None
        self.decoder: Decoder | None = None
        self.graph: DecodeGraph | None = None
        self.kept: KeptWeights | None = None
        self.records = 0  # decoders built so far (each new signature builds one, recording its graph on CUDA)

    def decode(self, adapter, state: ResidentState, config: SamplingConfig) -> Rollouts:
        """`sample`'s rollouts (the model and state already checked), through the kept decoder where it fits."""
        layout = _kept_layout(state)
        if layout is None:
            return _plain(adapter, state, config)
        signature = _signature(adapter, layout, state, config)
        if signature != self.signature:
            return self._build(signature, adapter, state, config)
        self.decoder.restart(state, config)
        self.kept.refresh()
        with decoding(adapter, config.stacked_projections, self.kept, config.folded_norms):
            steps = _decode(self.decoder, self.graph, config, steps=0)
        return self.decoder.rollouts(steps, self.graph is not None)

    def _build(self, signature, adapter, state: ResidentState, config: SamplingConfig) -> Rollouts:
        """A decoder on the session's own copy of the state, its step recorded, and its first rollouts."""
        self.signature = self.decoder = self.graph = None  # the old graph's pool freed before the new one records
        self.kept = KeptWeights()
        self.decoder = Decoder(adapter, own_copy(state), config)
        rollouts, self.graph = _new_decode(adapter, self.decoder, config, self.kept)
        self.signature, self.records = signature, self.records + 1
        return rollouts


def _kept_layout(state: ResidentState) -> tuple | None:
    """The state's layout (`member_graphs.state_layout`), or None for one a recorded step cannot follow by it."""
    try:
        return state_layout(state)
    except ValueError:
        return None


def _signature(adapter, layout: tuple, state: ResidentState, config: SamplingConfig) -> tuple:
    """What a kept decoder and its recorded step depend on besides the values of the state's and the weights'
    tensors (which a later call writes in place)."""
    lora_layers = (m for m in adapter.lm.modules() if type(m) is in_place_lora_class())
    return (
        id(adapter.model),
        None if state.binding is None else state.binding.storages,  # the weights' addresses, read by the graph
        tuple(single_plain_adapter(m) for m in lora_layers),  # merged weights, or peft's forward (disabled adapters)
        layout,
        dataclasses.replace(config, seed=None, progress=False, stop_check_every=None),
        config.seed is None,  # a seeded graph draws from its own generator, else from torch's default one
    )


@torch.no_grad()
def sample(model, state: ResidentState, config: SamplingConfig, session: DecodeSession | None = None) -> Rollouts:
    """G sampled responses and their policy log-probs from the captured `state` (never modified); `session`: the
    decoder kept across calls (`DecodeSession`), else one of this call's own."""
    adapter = adapter_for(model)
    check_state(adapter, state)
    state.check_positions(config.max_new_tokens, "sampling max_new_tokens")
    check_deterministic(model)
    if session is not None:
        return session.decode(adapter, state, config)
    return _plain(adapter, state, config)
