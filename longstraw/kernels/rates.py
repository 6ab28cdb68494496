"""Kernel rates measured in the same run as the experiment they judge (CUDA only).

    rates = measure_kernel_rates(model.config, response_length=2048, dtype=torch.bfloat16, device="cuda")

- `causal_sdpa`: torch's own `scaled_dot_product_attention(is_causal=True)` (whichever backend
  torch picks) over `sdpa_positions` tokens with the model's attention heads: the rate capture's
  attention is judged against.
- `flash_forward`, `flash_backward`, `cudnn_forward`, `cudnn_backward`: the block kernels paged attention calls, on
  one prefix block of replay's shape (the model's query heads folded over its K/V heads, times the
  response length, against `CUDA_BLOCK_SIZE` keys): the rates replay's FLOP floor uses.
  `cudnn_backward` also records its dq's largest difference from flash's, relative to flash's largest
  |dq|.
- `gemm`: a square bf16 matmul, for the linear part of the floor.
- `nf4_linear` (NF4 models): the model's largest 4-bit linear layer on a capture chunk's rows, through
  the layer as capture calls it (dequantise + GEMM), bitsandbytes' fused 4-bit GEMM, and a bf16 GEMM
  of the same shape on the dequantised weight.
Each is timed after one warm-up call, with device syncs around the timed calls.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from longstraw.kernels.paged_attention import (
    CUDA_BLOCK_SIZE,
    CUDNN_BLOCKS_MAX_HEAD_DIM,
    _cudnn_block_bwd,
    _cudnn_block_fwd,
    _flash_block_bwd,
    _flash_block_fwd,
)
from longstraw.measure.flops import BACKWARD_OVER_FORWARD, attention_forward_flops, head_dim
from longstraw.measure.timing import seconds_per_call


def _rate(flops: int, seconds: float, **shape) -> dict:
    return {"flops": flops, "seconds": seconds, "tflops_per_second": flops / seconds / 1e12, **shape}


def causal_sdpa_rate(heads: int, head_dim: int, positions: int, dtype, device) -> dict:
    q, k, v = (torch.randn(1, heads, positions, head_dim, dtype=dtype, device=device) for _ in range(3))
    seconds = seconds_per_call(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True), device, repeats=1)
    return _rate(
        attention_forward_flops(heads, head_dim, positions, 0),
        seconds,
        heads=heads,
        head_dim=head_dim,
        positions=positions,
    )


def block_rates(
    heads: int,
    kv_heads: int,
    head_dim: int,
    response_length: int,
    dtype,
    device,
    keys: int = CUDA_BLOCK_SIZE,
    repeats: int = 8,
) -> dict:
    rows = heads // kv_heads * response_length
    q, do = (torch.randn(1, kv_heads, rows, head_dim, dtype=dtype, device=device) for _ in range(2))
    k, v = (torch.randn(1, kv_heads, keys, head_dim, dtype=dtype, device=device) for _ in range(2))
    scale = head_dim**-0.5
    out, lse = _flash_block_fwd(q, k, v, scale)
    lse = lse.contiguous()
    flops = 4 * kv_heads * rows * keys * head_dim
    shape = {"kv_heads": kv_heads, "rows": rows, "keys": keys, "head_dim": head_dim}
    rates = {
        "flash_forward": _rate(
            flops, seconds_per_call(lambda: _flash_block_fwd(q, k, v, scale), device, repeats), **shape
        ),
        "flash_backward": _rate(
            int(BACKWARD_OVER_FORWARD * flops),
            seconds_per_call(lambda: _flash_block_bwd(do, q, k, v, out, lse, scale), device, repeats),
            **shape,
        ),
    }
    if head_dim <= CUDNN_BLOCKS_MAX_HEAD_DIM and (torch.backends.cudnn.version() or 0) >= 90000:
        rates["cudnn_forward"] = _rate(
            flops, seconds_per_call(lambda: _cudnn_block_fwd(q, k, v, scale), device, repeats), **shape
        )
        seconds = seconds_per_call(lambda: _cudnn_block_bwd(do, q, k, v, out, lse, scale), device, repeats)
        dq_flash, dq_cudnn = (
            bwd(do, q, k, v, out, lse, scale)[0].float() for bwd in (_flash_block_bwd, _cudnn_block_bwd)
        )
        rates["cudnn_backward"] = _rate(
            int(BACKWARD_OVER_FORWARD * flops),
            seconds,
            **shape,
            dq_difference_from_flash=((dq_cudnn - dq_flash).abs().max() / dq_flash.abs().max()).item(),
        )
    return rates


def gemm_rate(dtype, device, n: int = 8192, repeats: int = 8) -> dict:
    a, b = (torch.randn(n, n, dtype=dtype, device=device) for _ in range(2))
    return _rate(2 * n**3, seconds_per_call(lambda: a @ b, device, repeats), n=n)


def nf4_linear_rates(model, rows: int, dtype, device, repeats: int = 8) -> dict | None:
    """The largest 4-bit linear layer of `model` on `rows` rows, three ways (see the module doc); None
    when the model has no 4-bit layer."""
    import bitsandbytes as bnb

    from longstraw.kernels.nf4_linear import dequantize

    layers = [m for m in model.modules() if isinstance(m, bnb.nn.Linear4bit)]
    if not layers:
        return None
    layer = max(layers, key=lambda m: m.in_features * m.out_features)
    x = torch.randn(rows, layer.in_features, dtype=dtype, device=device)
    weight = dequantize(layer.weight, dtype)
    flops = 2 * rows * layer.in_features * layer.out_features
    shape = {"rows": rows, "in_features": layer.in_features, "out_features": layer.out_features}
    with torch.no_grad():
        return {
            "as_captured": _rate(flops, seconds_per_call(lambda: layer(x), device, repeats), **shape),
            "bitsandbytes_fused": _rate(
                flops, seconds_per_call(lambda: bnb.nn.Linear4bit.forward(layer, x), device, repeats), **shape
            ),
            "bf16_dequantised_weight": _rate(
                flops, seconds_per_call(lambda: F.linear(x, weight), device, repeats), **shape
            ),
        }


def measure_kernel_rates(
    config, *, response_length: int, dtype, device, sdpa_positions: int = 1 << 20, model=None, capture_rows: int = 16384
) -> dict:
    """The rates above for `config`'s attention shape; `nf4_linear` too when `model` has 4-bit layers."""
    heads, dim = config.num_attention_heads, head_dim(config)
    rates = {"causal_sdpa": causal_sdpa_rate(heads, dim, sdpa_positions, dtype, device)}
    torch.cuda.empty_cache()
    rates.update(block_rates(heads, config.num_key_value_heads, dim, response_length, dtype, device))
    rates["gemm"] = gemm_rate(dtype, device)
    if model is not None and getattr(model, "is_loaded_in_4bit", False):
        rates["nf4_linear"] = nf4_linear_rates(model, capture_rows, dtype, device)
    torch.cuda.empty_cache()
    return rates
