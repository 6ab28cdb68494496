"""The attention layers' rotary embedding (longstraw.kernels.rotary): the models whose HF function the fused kernel
stands in for compute the rotate-half form, the selection swaps and restores it, and on CUDA the kernel matches it."""

from __future__ import annotations

import copy
import importlib

import pytest
import torch
from tolerances import EPS_BF16, relative
from torch.utils._pytree import tree_flatten

from longstraw import capture
from longstraw.families import adapter_for
from longstraw.kernels import rotary as rotary_module
from longstraw.kernels.rotary import ROTATE_HALF_MODELS, fused_rotary_selected
from longstraw.models import TINY_MLA_PRESETS, TINY_PRESETS, build_model
from longstraw.state.pages import DecodeClock
from longstraw.training.rollout import Decoder, RotaryTable, SamplingConfig

pytestmark = pytest.mark.numerics

# the models whose function rotates the first cos.shape[-1] features of a head and passes the rest through (partial
# rotation, the hybrid family's 1/4); the others rotate whole heads
PARTIAL_ROTATION_MODELS = ("qwen3_next", "qwen3_5", "qwen3_5_moe")


def rotate_half_formula(x, cos, sin):
    """The rotate-half rotation of x [B, H, T, D] by cos, sin [B or 1, T, R], written out feature by feature: with
    h = R / 2, x_c cos_c - x_{c+h} sin_c for c < h, x_c cos_c + x_{c-h} sin_c for h <= c < R, x_c beyond."""
    R, h = cos.shape[-1], cos.shape[-1] // 2
    cos, sin = cos[:, None], sin[:, None]
    first = x[..., :h] * cos[..., :h] - x[..., h:R] * sin[..., :h]
    second = x[..., h:R] * cos[..., h:R] + x[..., :h] * sin[..., h:R]
    return torch.cat([first, second, x[..., R:]], dim=-1)


def _angles(gen, B, T, R, dtype=torch.float64):
    """cos and sin of random angles, each half its own (HF's halves repeat; the formula must not rely on it)."""
    theta = torch.rand(B, T, R, generator=gen, dtype=torch.float64) * 6.3
    return theta.cos().to(dtype), theta.sin().to(dtype)


def _modeling(model: str):
    return importlib.import_module(f"transformers.models.{model}.modeling_{model}")


@pytest.mark.parametrize("model", ROTATE_HALF_MODELS)
def test_hfs_function_is_the_rotate_half_formula(model):
    """Each model type the fused kernel stands in for: HF's apply_rotary_pos_emb equals the formula in float64 on
    whole heads, and on a quarter of each head where the model rotates part of it; a swapped sign is told apart."""
    gen = torch.Generator().manual_seed(0)
    B, H, T, D = 2, 3, 5, 16
    q, k = (torch.randn(B, H, T, D, generator=gen, dtype=torch.float64) for _ in range(2))
    for R in (D, D // 4) if model in PARTIAL_ROTATION_MODELS else (D,):
        cos, sin = _angles(gen, B, T, R)
        q_hf, k_hf = _modeling(model).apply_rotary_pos_emb(q, k, cos, sin)
        for ours, theirs, x in (
            (rotate_half_formula(q, cos, sin), q_hf, q),
            (rotate_half_formula(k, cos, sin), k_hf, k),
        ):
            assert relative(theirs, ours) <= 1e-15, (model, R)
            assert relative(theirs, rotate_half_formula(x, cos, -sin)) > 0.1


def test_the_selection_swaps_each_rotate_half_file_once_and_restores_it(monkeypatch):
    """Inside the block the modeling file of a rotate-half model calls the fused function: HF's own result off CUDA,
    the kernel (a stand-in here) for q and for k where usable; nested blocks swap once; on exit HF's function is back.
    A model outside the list (gpt-oss's rotary takes half-width angles) is not touched."""
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssAttention
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5Attention

    qwen, gpt_oss = _modeling("qwen3_5"), _modeling("gpt_oss")
    hf_function, gpt_oss_function = qwen.apply_rotary_pos_emb, gpt_oss.apply_rotary_pos_emb
    modules = [object.__new__(Qwen3_5Attention), object.__new__(GptOssAttention)]  # only their classes are read
    gen = torch.Generator().manual_seed(0)
    q, k = (torch.randn(1, 2, 5, 16, generator=gen) for _ in range(2))
    cos, sin = _angles(gen, 1, 5, 4, torch.float32)
    with fused_rotary_selected(modules):
        assert qwen.apply_rotary_pos_emb is not hf_function and gpt_oss.apply_rotary_pos_emb is gpt_oss_function
        for a, e in zip(qwen.apply_rotary_pos_emb(q, k, cos, sin), hf_function(q, k, cos, sin)):
            assert torch.equal(a, e)  # CPU: HF's function
        calls = []
        monkeypatch.setattr(rotary_module, "_fused_usable", lambda *a: True)
        monkeypatch.setattr(rotary_module, "_load_rotary", lambda: lambda x, c, s: calls.append(x) or x * 2)
        with fused_rotary_selected(modules):
            q_out, k_out = qwen.apply_rotary_pos_emb(q, k, cos, sin)
        assert calls[0] is q and calls[1] is k and torch.equal(q_out, q * 2) and torch.equal(k_out, k * 2)
        assert qwen.apply_rotary_pos_emb is not hf_function  # the inner block left the outer swap in place
    assert qwen.apply_rotary_pos_emb is hf_function


def test_the_paged_selection_swaps_the_rotary_and_a_peers_does_not():
    from longstraw.families import adapter_for
    from longstraw.models import build_model

    adapter = adapter_for(build_model("tiny-qwen3_5", seed=0))
    qwen = _modeling("qwen3_5")
    hf_function = qwen.apply_rotary_pos_emb
    with adapter.selected():
        assert qwen.apply_rotary_pos_emb is not hf_function
    with adapter.selected("sdpa"):
        assert qwen.apply_rotary_pos_emb is hf_function
    assert qwen.apply_rotary_pos_emb is hf_function


@pytest.mark.cuda
@pytest.mark.parametrize("B, T", [(1, 1), (2, 4096)])
def test_fused_rotary_on_cuda_matches_the_formula_in_float64(B, T):
    """The kernel on HF's layout (q and k [B, T, H, D] seen as [B, H, T, D]) at hybrid-1b's attention shape (8 query
    and 2 key heads of 128, a quarter rotated) in bf16, forward and backward, against the formula in float64 on the
    same bf16 values: each output rounds once (half EPS_BF16 norm-wise; HF's bf16 function rounds three times), so
    within EPS_BF16; the gradient comes back in the input's layout."""
    if rotary_module._load_rotary() is None:
        pytest.skip("Triton is not importable")
    gen = torch.Generator().manual_seed(0)
    D, R = 128, 32
    cos, sin = (t.cuda() for t in _angles(gen, 1, T, R, torch.bfloat16))
    for heads in (8, 2):
        x = torch.randn(B, T, heads, D, generator=gen).to("cuda", torch.bfloat16).requires_grad_(True)
        grad = torch.randn(B, heads, T, D, generator=gen, dtype=torch.float64).cuda()
        q_BHTD = x.transpose(1, 2)
        assert rotary_module._fused_usable(q_BHTD, q_BHTD, cos, sin, 1)
        out = rotary_module._load_rotary()(q_BHTD, cos, sin)
        (out.double() * grad).sum().backward()
        leaf = x.detach().double().requires_grad_(True)
        expected = rotate_half_formula(leaf.transpose(1, 2), cos.double(), sin.double())
        (expected * grad).sum().backward()
        assert out.is_contiguous() and x.grad.is_contiguous()
        assert relative(out, expected) <= EPS_BF16 and relative(x.grad, leaf.grad) <= EPS_BF16, heads


TABLE_START, TABLE_STEPS = 37, 9  # a prompt's positions, a decode's steps


def _rotary_table(model, device="cpu"):
    """(adapter, clock, a step's embedded row, the decode's `RotaryTable`) on a prompt of TABLE_START positions."""
    adapter = adapter_for(model)
    clock = DecodeClock.allocate(TABLE_START, TABLE_STEPS, device)
    h_11H = adapter.embed(torch.zeros(1, 1, dtype=torch.long, device=device))
    return adapter, clock, h_11H, RotaryTable(adapter, clock, h_11H)


def _rows_equal(ours, theirs) -> bool:
    (a, a_spec), (b, b_spec) = tree_flatten(ours), tree_flatten(theirs)
    return a_spec == b_spec and all(x.dtype == y.dtype and torch.equal(x, y) for x, y in zip(a, b, strict=True))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("preset", TINY_PRESETS + TINY_MLA_PRESETS)
def test_the_rotary_tables_rows_are_each_steps_own_bit_for_bit(preset, dtype):
    """Every family: at each step, the table's row (one select by the clock's step) is what the adapter's
    `position_embeddings_at` computes for that step alone (HF's rotary module at one position: Gemma 3's for each
    layer type, the hybrid family's on its three axes), the same structure, dtypes and bits; the next position's
    row is not."""
    adapter, clock, h_11H, table = _rotary_table(build_model(preset, seed=1, dtype=dtype))
    assert adapter.rotary_fixed
    for step in range(TABLE_STEPS):
        clock.step_1.fill_(step)
        assert _rows_equal(table.at(clock.step_1), adapter.position_embeddings_at(h_11H, clock.positions_11()))
    clock.step_1.fill_(0)
    assert not _rows_equal(table.at(clock.step_1), adapter.position_embeddings_at(h_11H, clock.positions_11() + 1))


def test_the_rotary_tables_rows_are_hfs_rotary_module_at_each_position():
    """Llama's table against HF's `LlamaRotaryEmbedding` called at each position on its own: equal."""
    model = build_model("tiny-llama", seed=1)
    _, clock, h_11H, table = _rotary_table(model)
    for step in range(TABLE_STEPS):
        clock.step_1.fill_(step)
        assert _rows_equal(table.at(clock.step_1), model.model.rotary_emb(h_11H, torch.tensor([[TABLE_START + step]])))


def test_a_rotary_whose_frequencies_follow_the_positions_is_computed_each_step():
    """HF's dynamic rope rescales its frequencies to the largest position a call asks (past the model's
    max_position_embeddings, keeping them for later calls): a table's rows (every position in one call) are not what
    a fresh rotary gives the first step, so the adapter says so and a decoder asked for the table computes the
    rotary each step."""
    model = build_model(
        "tiny-llama", seed=1, max_position_embeddings=32, rope_parameters={"rope_type": "dynamic", "factor": 2.0}
    )
    fresh = adapter_for(copy.deepcopy(model))
    adapter, clock, h_11H, table = _rotary_table(model)
    assert not adapter.rotary_fixed
    clock.step_1.fill_(0)
    assert not _rows_equal(table.at(clock.step_1), fresh.position_embeddings_at(h_11H, clock.positions_11()))
    state = capture(model, torch.arange(TABLE_START + 1), beyond_max_positions=True)
    assert Decoder(adapter, state, SamplingConfig(2, TABLE_STEPS, rotary_table=True)).rotary_table is None
