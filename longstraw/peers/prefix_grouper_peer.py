"""Peer `prefix_grouper`: PrefixGrouper 0.0.1.post1 (Liu et al. 2025, arXiv 2506.05433) on our group, as its
README documents it (its "Best Practices" data flow and its transformers `AttentionInterface` integration):

1. `PrefixGrouper.from_ungrouped_masks(prefix_mask, suffix_mask, group_sizes=G, padding_mode="right")`;
   `concat_input(prompt, prompt_mask, responses, response_mask)` gives one row, prompt then the G responses;
   position ids as its README says: the prompt's 0..P-1, then every response from P.
2. `prefix_grouper.utils.register_transformers.register_attention()` registers `"prefix_grouper_attention"`,
   which the HF attention modules select for the forward; the model's forward gets `prefix_grouper=` and
   `prefix_grouper_attn_func=` (the kernel it calls twice per layer: prefix self-attention, then each
   response over prompt + itself). Its default kernel is flash-attention-2 (masks as [B, T] key-padding
   masks, causal aligned bottom-right); `masked_sdpa` below is that contract in torch SDPA, so it runs on
   CPU and on a GPU without the flash-attn package.
3. `split_output(hidden, include_prefix_last=1)` and `convert_padding(responses, ...)` align each response
   with the outputs that predict it. One departure: we split the decoder's hidden states and apply the LM
   head to the responses' positions only (the README splits full logits; the prompt's logits are never
   used, and TRL and our modes skip them too). Log-probs: `longstraw.kernels.logprobs.token_logprobs`.

The loss is our objective (`longstraw.core.grpo`, the same weights and advantages), on-policy, one backward
over the grouped row under HF's activation checkpointing (as naive and TRL run). PrefixGrouper splits
attention only: on a model with Gated DeltaNet (or other recurrent) layers those layers would run through
the concatenation and carry state from one response into the next, so `build_peer` refuses such models.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right

from longstraw.core import grpo
from longstraw.core.step import hf_checkpointing
from longstraw.families import adapter_for
from longstraw.kernels.logprobs import token_logprobs
from longstraw.peers.measured import measured_step

ATTENTION = "prefix_grouper_attention"  # the implementation its register_attention() adds to transformers
KERNEL = "longstraw_masked_sdpa"  # the kernel PrefixGrouper's attention hook calls (`prefix_grouper_attn_func`)


def masked_sdpa(module, query_BHQD, key_BKTD, value_BKTD, keep_BT, dropout=0.0, scaling=None, **kwargs):
    """flash-attention-2's contract for PrefixGrouper's hook, in torch SDPA: `keep_BT` marks the real keys
    (bool [B, T]); queries are the last Q positions of the keys (prefix: all of them; a response: its own),
    causal on the real positions. Returns (output [B, Q, H, D], None)."""
    if kwargs.get("sliding_window") is not None or getattr(module, "sliding_window", None):
        raise ValueError("prefix_grouper: sliding-window attention is not supported by masked_sdpa")
    q_len, k_len = query_BHQD.shape[2], key_BKTD.shape[2]
    keep_BT = keep_BT.to(device=query_BHQD.device, dtype=torch.bool)
    groups = query_BHQD.shape[1] // key_BKTD.shape[1]
    key, value = (t.repeat_interleave(groups, dim=1) for t in (key_BKTD, value_BKTD))
    if bool(keep_BT.all()):  # no padding: causal aligned bottom-right, without a materialised mask on CUDA
        out = F.scaled_dot_product_attention(
            query_BHQD, key, value, attn_mask=causal_lower_right(q_len, k_len), scale=scaling
        )
    else:
        position_BT = keep_BT.long().cumsum(-1)  # real position of each key (padding repeats its left neighbour)
        query_BQ = position_BT[:, k_len - q_len :]
        mask_BQT = keep_BT[:, None, :] & (position_BT[:, None, :] <= query_BQ[:, :, None])
        out = F.scaled_dot_product_attention(query_BHQD, key, value, attn_mask=mask_BQT[:, None], scale=scaling)
    return out.transpose(1, 2).contiguous(), None


def _register() -> None:
    from prefix_grouper.utils.register_transformers import register_attention
    from transformers import AttentionInterface

    register_attention()
    AttentionInterface.register(KERNEL, masked_sdpa)


class PrefixGrouperPeer:
    """PrefixGrouper's grouped forward on `model` (attention-only families), our objective `config`."""

    mode = "prefix_grouper"

    def __init__(self, model, config: grpo.GRPOConfig, max_response_length: int):
        del max_response_length  # the step class's signature (`PeerStep`); one grouped row takes any length
        import prefix_grouper  # noqa: F401  (imported in the setup, not in the first step)

        _register()
        self.model, self.config = model, config
        self.adapter = adapter_for(model)

    def logprobs(self, prompt_ids, responses) -> list[torch.Tensor]:
        """Each response's log-probs [R_i] from one grouped forward (under autograd when grad is on), inside
        `self.adapter.selected("prefix_grouper_attention")` (its backward too: checkpointing recomputes)."""
        from prefix_grouper import PrefixGrouper

        device = prompt_ids.device
        prompt_1P = prompt_ids.reshape(1, -1)
        lengths = [int(r.numel()) for r in responses]
        responses_GR = torch.nn.utils.rnn.pad_sequence([r.reshape(-1) for r in responses], batch_first=True)
        response_mask = torch.arange(max(lengths), device=device)[None] < torch.tensor(lengths, device=device)[:, None]
        prompt_mask = torch.ones_like(prompt_1P, dtype=torch.bool)
        grouper = PrefixGrouper.from_ungrouped_masks(
            prefix_mask=prompt_mask,
            suffix_mask=response_mask,
            group_sizes=len(responses),
            padding_mode="right",
            device=device,
        )
        input_ids = grouper.concat_input(prompt_1P, prompt_mask, responses_GR, response_mask)
        P = prompt_1P.shape[1]
        position_ids = torch.cat(
            [torch.arange(P, device=device)] + [torch.arange(P, P + n, device=device) for n in lengths]
        )[None]
        hidden = self.adapter.decoder(
            input_ids=input_ids,
            attention_mask=grouper.padding_mask,
            position_ids=position_ids,
            use_cache=False,
            prefix_grouper=grouper,
            prefix_grouper_attn_func=KERNEL,
        ).last_hidden_state
        _, _, suffix_hidden, _ = grouper.split_output(hidden, include_prefix_last=1)
        targets_GR = grouper.convert_padding(responses_GR, response_mask, padding_mode="right")
        return [
            token_logprobs(suffix_hidden[i, :n], self.adapter.lm_head, targets_GR[i, :n]) for i, n in enumerate(lengths)
        ]

    def step(self, prompt_ids, responses, rewards, optimizer) -> dict:
        config = self.config

        def forward_backward(advantages, weights, ref):
            with hf_checkpointing(self.model), self.adapter.selected(ATTENTION):
                logps = self.logprobs(prompt_ids, responses)
                loss = sum(
                    grpo.response_loss(lp, None, ref and ref[i], advantages[i], weights[i], config)
                    for i, lp in enumerate(logps)
                )
                loss.backward()
            return loss.detach(), grpo.summarize_stats(
                [grpo.response_stats(lp, None, ref and ref[i], advantages[i], config) for i, lp in enumerate(logps)]
            )

        return measured_step(
            self.model,
            optimizer,
            self.mode,
            responses,
            rewards,
            config,
            forward_backward,
            self.scorer(prompt_ids, responses),
        )

    def scorer(self, prompt_ids, responses):
        def score():
            with self.adapter.selected(ATTENTION):
                return self.logprobs(prompt_ids, responses)

        return score
