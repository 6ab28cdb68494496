"""`longstraw.measure.kernel_profile.launch_sources` names the code that launched each op: the source line of a
forward op, the autograd node of a backward one."""

import torch

from longstraw.measure.kernel_profile import launch_sources
from longstraw.models.lora_linear import fused_lora_linear, lora_update


def test_ops_are_attributed_to_their_source_line_and_backward_node():
    torch.manual_seed(0)
    x = torch.randn(8, 16, requires_grad=True)
    weight, lora_A, lora_B = torch.randn(12, 16), torch.randn(4, 16, requires_grad=True), torch.randn(12, 4)
    lora_B.requires_grad_(True)

    def step():  # the fused update: these 8 rows would pay for the merged one
        with lora_update("fused"):
            fused_lora_linear(x, weight, None, lora_A, lora_B, 2.0).sum().backward()

    sources = {row["source"]: row for row in launch_sources(step, torch.device("cpu"), top=100)}
    forward = [row for name, row in sources.items() if "longstraw/models/lora_linear.py" in name]
    assert any("aten::addmm_" in row["ops"] and "_lora_forward" in name for name, row in sources.items())
    assert sum(row["ops"].get("aten::addmm_", 0) for row in forward) == 1  # lora_B's GEMM accumulating, once
    backward = sources["backward: _FusedLoraLinearBackward"]["ops"]
    assert backward.get("aten::addmm_") == 1 and backward.get("aten::addmm") == 2  # x's sum, the adapters' two
    assert all(row["launches"] > 0 and row["seconds"] >= 0 for row in sources.values())


def test_device_idle_is_the_wall_outside_the_kernels_span_and_the_gaps_between_them():
    """Kernels at [0, 10], [5, 20] (overlapping the first), [50, 60], [61, 70] us in a 100 us wall: the span is
    70 us, so 30 us lie outside it; 30 + 1 us lie between kernels, the larger after the kernel that ended last."""
    from types import SimpleNamespace

    from longstraw.measure.kernel_profile import device_idle

    def kernel(name, start, end):
        return SimpleNamespace(name=name, time_range=SimpleNamespace(start=start, end=end))

    kernels = [kernel("c", 50, 60), kernel("a", 0, 10), kernel("b", 5, 20), kernel("d", 61, 70)]
    idle = device_idle(kernels, wall=100e-6, top=1)
    assert abs(idle["outside_span_seconds"] - 30e-6) < 1e-12
    assert abs(idle["between_kernels_seconds"] - 31e-6) < 1e-12
    assert len(idle["largest_gaps"]) == 1 and idle["largest_gaps"][0]["after"] == "b"
    assert idle["largest_gaps"][0]["before"] == "c" and abs(idle["largest_gaps"][0]["seconds"] - 30e-6) < 1e-12
    assert device_idle([], wall=1.0, top=3) == {
        "outside_span_seconds": 1.0,
        "between_kernels_seconds": 0.0,
        "largest_gaps": [],
    }


# kernel names from the recorded H200 profiles (`experiments/recorded/h200-benchmarks/hybrid_step_profile_*.json`),
# labelled by hand
LABELLED_KERNELS = {
    "nvjet_sm90_tst_256x152_64x4_1x2_h_bz_coopA_TNT": "gemm",
    "nvjet_sm90_tst_32x64_64x16_1x1_h_bz_splitK_NTN": "gemm",
    "void cublasLt::splitKreduce_kernel<32, 16, int, float, __nv_bfloat16, float, __nv_bfloat16": "gemm",
    "sm80_xmma_gemm_f32f32_f32f32_f32_nn_n_tilesize64x64x8_stage3": "gemm",
    "cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_7_64x128x128_4x1x1_cga1x1": "attention",
    "cudnn_generated_fort_native_sdpa_sm90_flash_bprop_wgmma_f16_knob_26_64x64x128_1x4x1_cga1x1": "attention",
    "void pytorch_flash::flash_bwd_dq_dk_dv_loop_seqk_parallel_kernel<Flash_bwd_kernel_traits<1": "attention",
    "chunk_gated_delta_rule_fwd_kernel_h_blockdim64": "gated_delta_rule",
    "chunk_gated_delta_rule_fwd_kkt_solve_kernel": "gated_delta_rule",
    "recompute_w_u_fwd_kernel": "gated_delta_rule",
    "chunk_fwd_kernel_o": "gated_delta_rule",
    "chunk_bwd_kernel_dqkwg": "gated_delta_rule",
    "prepare_wy_repr_bwd_kernel": "gated_delta_rule",
    "chunk_local_cumsum_scalar_kernel": "gated_delta_rule",
    "_conv_split_normalized_kernel": "conv",
    "_pre_activation_gradient_kernel": "conv",
    "_conv_input_gradient_kernel": "conv",
    "causal_conv1d_fwd_kernel": "conv",
    "layer_norm_fwd_kernel_row": "norm",
    "layer_norm_gated_bwd_kernel": "norm",
    "swiglu_fwdbwd_kernel": "swiglu",
    "_logsumexp_target_kernel": "log_probs",
    "_index_scores_kernel": "dsa_index",
    "Memcpy DtoD (Device -> Device)": "copy_fill",
    "Memset (Device)": "copy_fill",
    "void at::native::unrolled_elementwise_kernel<at::native::direct_copy_kernel_cuda(at::Tenso": "copy_fill",
    "void at::native::vectorized_elementwise_kernel<8, at::native::FillFunctor<c10::BFloat16>, ": "copy_fill",
    "void at::native::(anonymous namespace)::CatArrayBatchedCopy<at::native::(anonymous namespa": "copy_fill",
    "void at::native::vectorized_elementwise_kernel<8, at::native::CUDAFunctor_add<c10::BFloat1": "other",
    "void at::native::reduce_kernel<512, 1, at::native::ReduceOp<float, at::native::MeanOps<flo": "other",
    "void at::native::vectorized_gather_kernel<16, long>(char*, char*, long*, int, long, long, ": "other",
}


def test_kernel_kinds_are_the_hand_labels_of_recorded_kernel_names():
    from longstraw.measure.kernel_profile import kernel_kind

    assert {name: kernel_kind(name) for name in LABELLED_KERNELS} == LABELLED_KERNELS
