"""A step's replayed members as one CUDA graph, recorded once and re-launched on later steps (opt-in:
`grpo_step(..., graphs=MemberGraphs())`; config `replay.cuda_graph`).

Warm members are launch-bound on a small model: hybrid-1b's two members at 32,768 launch about 2,800 kernels,
0.08 s of GPU work behind 0.2 s of host time (benchmarks/replay_graph_probe.py). A graph records the members'
forward, their GRPO losses and the backward once; a later step copies its inputs in and launches the graph.

What a graph reads and writes lives at fixed addresses, so it keeps:
- its own copy of the resident state, into which each step copies its state (one more resident state's memory:
  graphs are for prompts whose state is small beside the members' graphs; the caller's state is never written);
- buffers for the members' inputs and targets, the advantages and any given old or reference log-probs;
- the trainable parameters, which the optimizer updates in place;
- the gradients, written into tensors of the graph's memory pool that each step hands to `.grad` (so a
  gradient stays valid until the next step's launch overwrites it).

A graph is recorded for one signature: the model, the state's layout, the batches and their response lengths,
checkpointing and the loss's settings (the token weights are constants inside it). A step with another
signature frees the graph and records anew: a warm-up run of the members on a side stream, the recording,
then the launch that gives the step's gradient. Responses whose lengths change every step would record every
step and be slower than eager replay; a point with fixed lengths (the step kind's seeded groups) records once.
`replay_inputs` is the eager reference the graph records.
"""

from __future__ import annotations

import copy
import dataclasses

import torch

from longstraw.core import grpo
from longstraw.core.transaction import member_inputs, replay_inputs


class MemberGraphs:
    """One recorded member graph and what it reads, kept across steps (see the module doc)."""

    def __init__(self):
        self.signature = None
        self.graph = None
        self.records = 0  # graphs recorded so far (each new signature records one)
        self.graph_bytes = 0  # the members' autograd graph peak, measured while recording (a launch runs no Python)

    def run(
        self, adapter, state, responses, batches, objective: grpo.GroupObjective, checkpoint_layers, recorder, meter
    ):
        """The step's members (`batches` of response indices) through the graph: each member's detached loss and
        log-probs, the group's gradient left in the parameters' `.grad`. A new signature records first (phase
        `graph_record`; `meter`, the step's `GraphBytesMeter`, active around this call, measures the members'
        autograd graph then); the launch is phase `replay`."""
        signature = (
            id(adapter.model),
            state_layout(state),
            tuple(tuple(responses[i].numel() for i in b) for b in batches),
            bool(checkpoint_layers),
            objective.config,
            tuple(float(w) for w in objective.weights),
            tuple(o is None for o in objective.old),
            objective.ref is None,
        )
        if signature != self.signature:
            with recorder.phase("graph_record"):
                self._record(signature, adapter, state, responses, batches, objective, checkpoint_layers, meter)
        with recorder.phase("replay"):
            return self._launch(state, responses, objective)

    def _launch(self, state, responses, objective):
        """Copy the step's inputs into the graph's buffers and launch it."""
        for kept, fresh in zip(state_tensors(self.state), state_tensors(state), strict=True):
            kept.copy_(fresh)
        for b, inputs, targets in zip(self.batches, self.inputs, self.targets):
            members = [responses[i].reshape(-1) for i in b]
            inputs.copy_(member_inputs(state, members))
            targets.copy_(torch.cat(members))
        kept = self.objective
        kept.advantages.copy_(objective.advantages)
        for buffers, given in ((kept.old, objective.old), (kept.ref or [], objective.ref or [])):
            for buffer, lp in zip(buffers, given):
                if buffer is not None:
                    buffer.copy_(lp.detach())
        self.graph.replay()
        for p, g in self.grads:
            p.grad = g
        return [loss.clone() for loss in self.losses], [lp.clone() for lp in self.logps]

    def _record(self, signature, adapter, state, responses, batches, objective, checkpoint_layers, meter):
        """Warm the members up on a side stream, then record them, their losses and their backward into a new
        graph for `signature`, reading buffers of its own (the state, the ids, the objective's tensors)."""
        self.signature = self.graph = None  # the old graph's pool is freed before the new one records
        self._own_inputs(adapter, state, responses, batches, objective, meter)
        params = [p for p in adapter.model.parameters() if p.requires_grad]

        def members():
            losses, logps = [], []
            for b, inputs, targets in zip(self.batches, self.inputs, self.targets):
                lengths = [responses[i].numel() for i in b]
                logps_b = replay_inputs(
                    adapter, self.state, inputs, targets, lengths, checkpoint_layers=checkpoint_layers
                )
                losses_b = [self.objective.member_loss(i, lp) for i, lp in zip(b, logps_b)]
                torch.stack(losses_b).sum().backward()
                losses += [loss.detach() for loss in losses_b]
                logps += [lp.detach() for lp in logps_b]
            return losses, logps

        graph = self._recorded(members, params, adapter.device)
        self.graph, self.signature, self.records = graph, signature, self.records + 1
        self.graph_bytes = meter.peak

    def _own_inputs(self, adapter, state, responses, batches, objective, meter) -> None:
        """The buffers a graph reads, its own: the state, the batches' ids and targets, the objective's tensors."""
        self.state, self.batches = own_copy(state), [list(b) for b in batches]
        meter.exclude(state_tensors(self.state))  # resident, as the step's own state is
        self.inputs = [member_inputs(state, [responses[i].reshape(-1) for i in b]) for b in batches]
        self.targets = [torch.cat([responses[i].reshape(-1) for i in b]).long() for b in batches]
        self.objective = dataclasses.replace(
            objective,
            old=[None if o is None else o.detach().clone() for o in objective.old],
            ref=None if objective.ref is None else [r.detach().clone() for r in objective.ref],
            advantages=objective.advantages.to(device=adapter.device, dtype=torch.float32).clone(),
        )

    def _recorded(self, members, params, device) -> torch.cuda.CUDAGraph:
        """`members` warmed up on a side stream, then recorded into a new graph (its losses, log-probs and
        gradients kept as the graph's outputs)."""
        # torch's whole-network recipe: warm up on a side stream (lazy initialisation, autotuning), then record
        # with no gradient held, so the backward allocates the gradients in the graph's pool; the gradients held
        # before (none or zeros: `undone_on_failure`) are put back whatever happens
        held = [p.grad for p in params]
        try:
            side = torch.cuda.Stream(device)
            side.wait_stream(torch.cuda.current_stream(device))
            for p in params:
                p.grad = None
            with torch.cuda.stream(side):
                members()
            torch.cuda.current_stream(device).wait_stream(side)
            for p in params:
                p.grad = None
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                self.losses, self.logps = members()
            self.grads = [(p, p.grad) for p in params if p.grad is not None]
        finally:
            for p, grad in zip(params, held):
                p.grad = grad
        return graph


def own_copy(state):
    """`state` with its entries' tensors cloned: what a graph reads, apart from the caller's state."""
    kept = copy.copy(state)
    kept.layers = [
        dataclasses.replace(
            entry,
            **{
                f.name: getattr(entry, f.name).clone()
                for f in dataclasses.fields(entry)
                if isinstance(getattr(entry, f.name), torch.Tensor)
            },
        )
        for entry in state.layers
    ]
    return kept


def state_tensors(state) -> list[torch.Tensor]:
    return [t for entry in state.layers for t in entry.tensors()]


def state_layout(state) -> tuple:
    """What a graph recorded on `state` depends on besides its tensors' values: each entry's type, its tensors'
    shapes, dtypes and devices, and its other fields (lengths, windows); refuses what a graph cannot read (a tensor
    off the state's device: the member graphs run on CUDA states only, a sampling session also keeps CPU ones)."""
    if getattr(state, "cp", None) is not None:
        raise ValueError("replay.cuda_graph: a context-parallel state cannot be replayed through a CUDA graph")
    if state.prefix_trace is not None:
        raise ValueError("replay.cuda_graph: the exact mode (prefix_grad) cannot be replayed through a CUDA graph")
    layout = [state.positions]
    for entry in state.layers:
        if not dataclasses.is_dataclass(entry):
            raise ValueError(f"replay.cuda_graph: {type(entry).__name__} entries are not recordable")
        fields = []
        for f in dataclasses.fields(entry):
            value = getattr(entry, f.name)
            if isinstance(value, torch.Tensor):
                if value.device.type != state.device.type:
                    raise ValueError(
                        f"replay.cuda_graph: {type(entry).__name__}.{f.name} is on {value.device}; a CUDA graph "
                        "reads device memory only (host_pages cannot be graphed)"
                    )
                value = (tuple(value.shape), value.dtype, value.device)
            elif not (value is None or isinstance(value, (int, float, str, bool, torch.device))):
                raise ValueError(
                    f"replay.cuda_graph: {type(entry).__name__}.{f.name} holds a {type(value).__name__}, "
                    "which a recorded graph cannot follow"
                )
            fields.append((f.name, value))
        layout.append((type(entry).__name__, tuple(fields)))
    return tuple(layout)
