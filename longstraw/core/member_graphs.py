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
  gradient stays valid until the next step's launch overwrites it);
- the token weights and loss masks, so a group whose lengths or masks differ launches the same graph.

A graph is recorded for one signature: the model, the state's layout, the batch size and the members' lengths,
checkpointing and the loss's settings. A step with another signature frees the graph and records anew: a warm-up
run of the members on a side stream, the recording, then the launch that gives the step's gradient. Sampled
responses change length every step: `MemberGraphs(pad_to=T)` right-pads every member to T tokens inside the graph
(pads follow every real token, so causally no real token reads them; they bear no loss and count in no weight)
and cuts the log-probs it returns to each member's length, so a trainer's groups (answers of up to T tokens)
record once. `micro_batch` "auto" is sized when recording: one padded member runs first (the warm-up's start)
and k is what its graph bytes fit (`step.members_that_fit`), kept with the graph. `replay_inputs` is the eager
reference the graph records.
"""

from __future__ import annotations

import copy
import dataclasses

import torch

from longstraw.core import grpo
from longstraw.core.transaction import member_inputs, replay_inputs
from longstraw.measure.timing import warmup_stream


class MemberGraphs:
    """One recorded member graph and what it reads, kept across steps (see the module doc). `pad_to`: every
    member right-padded to that many tokens inside the graph (None: members keep their lengths)."""

    def __init__(self, pad_to: int | None = None):
        if pad_to is not None and (isinstance(pad_to, bool) or not isinstance(pad_to, int) or pad_to < 1):
            raise ValueError(f"MemberGraphs: pad_to must be a positive integer or None, got {pad_to!r}")
        self.pad_to = pad_to
        self.signature = None
        self.graph = None
        self.records = 0  # graphs recorded so far (each new signature records one)
        self.graph_bytes = 0  # the members' autograd graph peak, measured while recording (a launch runs no Python)
        self.micro_batch = None  # the recorded graph's batch size k ("auto" resolved when recording)

    def run(self, adapter, state, responses, micro_batch, objective, checkpoint_layers, recorder, meter):
        """The step's members through the graph, `micro_batch` at a time (an int k, or a rule `k(member_bytes)`
        that sizes k from one padded member's graph bytes when recording): each member's detached loss and
        log-probs (cut to its length), the group's gradient left in the parameters' `.grad`. A new signature
        records first (phase `graph_record`; `meter`, the step's `GraphBytesMeter`, active around this call,
        measures the members' autograd graph then); the launch is phase `replay`."""
        lengths = [int(r.numel()) for r in responses]
        members = self._padded(state, responses)
        objective = padded_objective(objective, lengths, [m.numel() for m in members], adapter.device)
        signature = (
            id(adapter.model),
            state_layout(state),
            tuple(m.numel() for m in members),
            micro_batch if isinstance(micro_batch, int) else "auto",
            bool(checkpoint_layers),
            objective.config,
            tuple(o is None for o in objective.old),
            objective.ref is None,
        )
        if signature != self.signature:
            with recorder.phase("graph_record"):
                self._record(signature, adapter, state, members, micro_batch, objective, checkpoint_layers, meter)
        with recorder.phase("replay"):
            losses, logps = self._launch(state, members, objective)
        return losses, [lp[:n] for lp, n in zip(logps, lengths)]

    def _padded(self, state, responses) -> list[torch.Tensor]:
        """Each member's ids as the graph reads them: right-padded to `pad_to` (the prompt's last token as pad)."""
        if self.pad_to is None:
            return [r.reshape(-1) for r in responses]
        longest = max(r.numel() for r in responses)
        if longest > self.pad_to:
            raise ValueError(f"replay.cuda_graph: a response of {longest} tokens exceeds the graph's {self.pad_to}")
        return [
            torch.nn.functional.pad(r.reshape(-1), (0, self.pad_to - r.numel()), value=state.last_token)
            for r in responses
        ]

    def _launch(self, state, members, objective):
        """Copy the step's inputs into the graph's buffers and launch it."""
        for kept, fresh in zip(state_tensors(self.state), state_tensors(state), strict=True):
            kept.copy_(fresh)
        for b, inputs, targets in zip(self.batches, self.inputs, self.targets):
            inputs.copy_(member_inputs(state, [members[i] for i in b]))
            targets.copy_(torch.cat([members[i] for i in b]))
        kept = self.objective
        kept.advantages.copy_(objective.advantages)
        kept.weights.copy_(objective.weights)
        for buffers, given in (
            (kept.old, objective.old),
            (kept.ref or [], objective.ref or []),
            (kept.masks, objective.masks),
        ):
            for buffer, value in zip(buffers, given):
                if buffer is not None:
                    buffer.copy_(value.detach())
        self.graph.replay()
        for p, g in self.grads:
            p.grad = g
        return [loss.clone() for loss in self.losses], [lp.clone() for lp in self.logps]

    def _record(self, signature, adapter, state, members, micro_batch, objective, checkpoint_layers, meter):
        """Warm the members up on a side stream, then record them, their losses and their backward into a new
        graph for `signature`, reading buffers of its own (the state, the ids, the objective's tensors)."""
        self.signature = self.graph = None  # the old graph's pool is freed before the new one records
        self.state = own_copy(state)
        meter.exclude(state_tensors(self.state))  # resident, as the step's own state is
        self.objective = owned_objective(objective)
        params = [p for p in adapter.model.parameters() if p.requires_grad]

        def batch(b, inputs, targets):
            logps_b = replay_inputs(
                adapter,
                self.state,
                inputs,
                targets,
                [members[i].numel() for i in b],
                checkpoint_layers=checkpoint_layers,
            )
            losses_b = [self.objective.member_loss(i, lp) for i, lp in zip(b, logps_b)]
            torch.stack(losses_b).sum().backward()
            return [loss.detach() for loss in losses_b], [lp.detach() for lp in logps_b]

        def sized():  # the warm-up's first member sizes an "auto" k; then the batches' buffers
            k = micro_batch
            if not isinstance(k, int):
                batch([0], member_inputs(state, members[:1]), members[0].long())
                k = k(meter.peak)
            self._own_inputs(state, members, k)

        def members_run():
            losses, logps = [], []
            for b, inputs, targets in zip(self.batches, self.inputs, self.targets):
                losses_b, logps_b = batch(b, inputs, targets)
                losses += losses_b
                logps += logps_b
            return losses, logps

        graph = self._recorded(sized, members_run, params, adapter.device)
        self.graph, self.signature, self.records = graph, signature, self.records + 1
        self.graph_bytes = meter.peak

    def _own_inputs(self, state, members, k: int) -> None:
        """The batches of `k` members and the ids and targets buffers the graph reads."""
        self.micro_batch = k
        self.batches = [list(range(s, min(s + k, len(members)))) for s in range(0, len(members), k)]
        self.inputs = [member_inputs(state, [members[i] for i in b]) for b in self.batches]
        self.targets = [torch.cat([members[i] for i in b]).long() for b in self.batches]

    def _recorded(self, sized, members, params, device) -> torch.cuda.CUDAGraph:
        """`members` warmed up on a side stream (after `sized()`), then recorded into a new graph (its losses,
        log-probs and gradients kept as the graph's outputs)."""
        # torch's whole-network recipe: warm up on a side stream (lazy initialisation, autotuning), then record
        # with no gradient held, so the backward allocates the gradients in the graph's pool; the gradients held
        # before (none or zeros: `undone_on_failure`) are put back whatever happens
        held = [p.grad for p in params]
        try:
            side = warmup_stream(device)
            side.wait_stream(torch.cuda.current_stream(device))
            for p in params:
                p.grad = None
            with torch.cuda.stream(side):
                sized()
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


def padded_objective(objective: grpo.GroupObjective, lengths, padded, device) -> grpo.GroupObjective:
    """`objective` as a graph reads it for members of `lengths` padded to `padded` tokens: the advantages and token
    weights on the device, the old and reference log-probs padded with zeros, one loss mask per member (the given
    one, or every real token) padded with False (pads bear no loss)."""

    def pad(t, n, value):
        return torch.nn.functional.pad(t.detach().reshape(-1).to(device), (0, n - t.numel()), value=value)

    masks = objective.masks or [torch.ones(n, dtype=torch.bool) for n in lengths]
    return dataclasses.replace(
        objective,
        old=[None if o is None else pad(o, p, 0.0) for o, p in zip(objective.old, padded)],
        ref=None if objective.ref is None else [pad(r, p, 0.0) for r, p in zip(objective.ref, padded)],
        advantages=objective.advantages.to(device=device, dtype=torch.float32),
        weights=objective.weights.to(device=device),
        masks=[pad(m, p, False) for m, p in zip(masks, padded)],
    )


def owned_objective(objective: grpo.GroupObjective) -> grpo.GroupObjective:
    """A copy of a padded objective's tensors: the buffers a graph reads, apart from the step's."""
    return dataclasses.replace(
        objective,
        old=[None if o is None else o.clone() for o in objective.old],
        ref=None if objective.ref is None else [r.clone() for r in objective.ref],
        advantages=objective.advantages.clone(),
        weights=objective.weights.clone(),
        masks=[m.clone() for m in objective.masks],
    )


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
