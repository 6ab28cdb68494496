"""Registers, spills, vector loads and instructions of the package's Triton kernels as built for the H200 (sm_90), on
any machine: Triton compiles to PTX and a cubin without a GPU (its bundled ptxas, no CUDA driver needed), and its
bundled nvdisasm lists the cubin's SASS.

    python benchmarks/triton_build_report.py [--arch 90] [--out F]

For each configuration a kernel is launched with (every one an autotuned kernel offers: the GDN conv forward and the
backward's two kernels, the capture's GDN scan, the prefix's dq-only backward; the one the SwiGLU, rotary and sampler
kernels are launched with), at hybrid-1b's widths (the sampler at SmolLM2's vocabulary), with the pointer arguments
16-byte aligned as Triton's JIT specialises them: ptxas's registers
per thread and spill bytes, how many of the global loads and stores are 16-byte vectors, and the SASS: its
instructions (every path, each counted once: what a program runs is fewer where it branches) and the most frequent
opcodes. A spilling configuration still runs (its spills go to L1), but the autotuner's candidates are chosen from
these (`kernels/gdn_conv_triton.py`). The listing shows where a kernel's instructions go: the GDN conv forward at
a193562 held 2,520 a program of 32 rows and 4 warps (Triton 3.8; 2,808 with the box's 3.6), 1,085 of them integer
address and mask arithmetic (IMAD, IADD3, LEA, LOP3, ISETP), and took as long on the H200 as on an H100, so its bytes
were not what bound it. A kernel that does not build for sm_90 fails here, before a GPU runs it. The last stdout line
is one JSON object, also written to --out.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import tempfile
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from longstraw.kernels import (
    attention_dq_triton,
    gdn_conv_triton,
    gdn_scan_triton,
    rotary_triton,
    sampling_triton,
    swiglu_triton,
)
from longstraw.results import write_json_atomic

# an instruction in nvdisasm's listing: its address comment, an optional predicate, the opcode (before its modifiers)
SASS_OPCODE = re.compile(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)[. ;]")
# hybrid-1b's GDN layer: q and k 2,048 channels each (heads of 128), v 4,096, 4 taps, a state and a bias, SiLU
GDN_SHAPE = {"C": 8192, "KEY_DIM": 2048, "K": 4, "D": 128, "HAS_STATE": True, "HAS_BIAS": True, "SILU": True}
# its rule: 16 q/k heads, 32 value heads, head dims 128, chunks of 64, from a state
GDN_SCAN_SHAPE = {"H": 16, "HV": 32, "K": 128, "V": 128, "BT": 64, "HAS_INITIAL_STATE": True}
# its attention layers' heads of 128, a quarter rotated
ROTARY_SHAPE = {"D": 128, "R": 32, "BD": 128, "ROWS": rotary_triton.ROWS}
# their prefix backward: 2 K/V heads of 128
ATTENTION_DQ_SHAPE = {"HEADS": 2, "D": 128}
ATTENTION_DQ_STRIDES = ("stride_kb", "stride_kh", "stride_kn", "stride_vb", "stride_vh", "stride_vn")
# a decoding step's sampler, drawing and forcing: SmolLM2's 49,152 logits a row (24 chunks), two stop ids
SAMPLER_SHAPE = {"SAMPLED": True, "FORCED": True, "CHUNK": sampling_triton.CHUNK, "S_BLOCK": 32, "STOP_BLOCK": 2}
# its float32 logits, draws and chunk statistics, int64 token ids, bool flags
SAMPLER_TYPES = {
    **dict.fromkeys(("logits_ptr", "q_ptr", "stats_ptr", "logps_out_ptr"), "*fp32"),
    **dict.fromkeys(("candidate_ptr", "forced_ptr", "stop_ptr", "step_ptr", "tokens_ptr", "tokens_out_ptr"), "*i64"),
    **dict.fromkeys(("finite_ptr", "forcing_ptr", "unfinished_ptr"), "*i1"),
    "inv_t": "fp32",
}


@dataclass
class Kernel:
    """A jitted kernel, its shape's constexprs, the launch configurations to build and the argument types other than
    a bf16 pointer (scalars are 32-bit integers unless named), and the integers that are multiples of 16 at
    hybrid-1b's shapes (the JIT specialises on it, and a masked or strided access vectorises by it)."""

    fn: object
    shape: dict
    configs: list
    types: dict = field(default_factory=dict)
    scalars: tuple = ()
    multiples_of_16: tuple = ()


def _configs(autotuned) -> list:
    return [{**c.kwargs, "num_warps": c.num_warps, "num_stages": c.num_stages} for c in autotuned.configs]


def _fixed(**config) -> list:
    return [{"num_stages": 3, **config}]


KERNELS = {
    "gdn conv forward": Kernel(
        gdn_conv_triton._conv_split_normalized_kernel.fn,
        {**GDN_SHAPE, "EPS": 1e-6},
        _configs(gdn_conv_triton._conv_split_normalized_kernel),
        scalars=("T", "ROWS_LOG2"),
    ),
    "gdn conv backward, pre-activations' gradient": Kernel(
        gdn_conv_triton._pre_activation_gradient_kernel.fn,
        {**GDN_SHAPE, "EPS": 1e-6},
        _configs(gdn_conv_triton._pre_activation_gradient_kernel),
        {"dpre_ptr": "*fp32"},  # the backward's float32 intermediate
        scalars=("T", "ROWS_LOG2"),
    ),
    "gdn conv backward, the taps' transpose": Kernel(
        gdn_conv_triton._conv_input_gradient_kernel.fn,
        {**GDN_SHAPE, "EPS": 1e-6},
        _configs(gdn_conv_triton._conv_input_gradient_kernel),
        {"dpre_ptr": "*fp32"},
        scalars=("T", "ROWS_LOG2"),
    ),
    "gdn capture scan": Kernel(
        gdn_scan_triton._scan_output_kernel.fn,
        GDN_SCAN_SHAPE,
        _configs(gdn_scan_triton._scan_output_kernel),
        {"g_ptr": "*fp32", "h0_ptr": "*fp32", "ht_ptr": "*fp32", "scale": "fp32"},
        scalars=("T", "CHUNKS_LOG2"),
    ),
    "attention dq": Kernel(
        attention_dq_triton._dq_kernel,
        ATTENTION_DQ_SHAPE,
        _configs(attention_dq_triton._tuned_dq_kernel),
        {"lse_ptr": "*fp32", "dq_ptr": "*fp32", "scale": "fp32"},
        scalars=("M", "N", "ROWS_LOG2", "KEYS_LOG2", *ATTENTION_DQ_STRIDES),
        multiples_of_16=ATTENTION_DQ_STRIDES,  # page strides: multiples of the head dim
    ),
    **{
        f"swiglu {direction}": Kernel(
            fn,
            {"BLOCK": swiglu_triton.BLOCK},
            _fixed(num_warps=swiglu_triton.WARPS),
            scalars=("n",),
            multiples_of_16=("n",),  # rows x 5,632 elements
        )
        for direction, fn in (
            ("forward", swiglu_triton._swiglu_forward_kernel),
            ("backward", swiglu_triton._swiglu_backward_kernel),
        )
    },
    **{
        f"rotary {'backward' if transposed else 'forward'}": Kernel(
            rotary_triton._rotary_kernel,
            {**ROTARY_SHAPE, "TRANSPOSED": transposed},
            _fixed(num_warps=4),
            scalars=("T", "H", "x_sb", "x_sh", "x_st", "c_sb", "c_st", "o_sb", "o_sh", "o_st"),
            # every stride (of [B, T, H, D] memory seen as [B, H, T, D], D = 128, and of [1, T, 32] angles)
            multiples_of_16=("x_sb", "x_sh", "x_st", "c_sb", "c_st", "o_sb", "o_sh", "o_st"),
        )
        for transposed in (False, True)
    },
    "sampler chunks": Kernel(
        sampling_triton._chunk_kernel, SAMPLER_SHAPE, _fixed(num_warps=4), SAMPLER_TYPES, scalars=("V", "S")
    ),
    "sampler rows": Kernel(
        sampling_triton._row_kernel,
        SAMPLER_SHAPE,
        _fixed(num_warps=1),
        SAMPLER_TYPES,
        scalars=("V", "S", "T", "n_stop", "pad_id"),
    ),
}


def build(kernel: Kernel, config: dict, arch: int) -> dict:
    fn = kernel.fn
    launch = {"num_warps": config["num_warps"], "num_stages": config["num_stages"]}
    constexprs = {name: v for name, v in {**kernel.shape, **config}.items() if name in fn.arg_names}
    signature = {
        name: "constexpr"
        if name in constexprs
        else kernel.types.get(name, "i32" if name in kernel.scalars else "*bf16")
        for name in fn.arg_names
    }
    aligned = {
        (i,): [["tt.divisibility", 16]]
        for i, name in enumerate(fn.arg_names)
        if signature[name].startswith("*") or name in kernel.multiples_of_16
    }
    source = ASTSource(
        fn=fn,
        signature=signature,
        constexprs={(fn.arg_names.index(name),): value for name, value in constexprs.items()},
        attrs=aligned,
    )
    compiled = triton.compile(source, target=GPUTarget("cuda", arch, 32), options=launch)
    ptx = compiled.asm["ptx"]
    tools = Path(triton.__file__).parent / "backends/nvidia/bin"
    with tempfile.TemporaryDirectory() as folder:
        path, cubin = Path(folder) / "kernel.ptx", Path(folder) / "kernel.cubin"
        path.write_text(ptx)
        report = subprocess.run(
            [str(tools / "ptxas"), f"-arch=sm_{arch}a", "-v", str(path), "-o", str(cubin)],
            capture_output=True,
            text=True,
            check=True,
        ).stderr
        sass = subprocess.run([str(tools / "nvdisasm"), "-c", str(cubin)], capture_output=True, text=True, check=True)
    opcodes = Counter(SASS_OPCODE.findall(sass.stdout))
    number = lambda pattern: int(re.search(pattern, report).group(1))  # noqa: E731
    return {
        "config": {k: v for k, v in config.items()},
        "registers": number(r"Used (\d+) registers"),
        "spill_store_bytes": number(r"(\d+) bytes spill stores"),
        "spill_load_bytes": number(r"(\d+) bytes spill loads"),
        "global_loads": len(re.findall(r"\bld\.global", ptx)),
        "vector_loads": len(re.findall(r"\bld\.global[.\w]*\.v4", ptx)),
        "global_stores": len(re.findall(r"\bst\.global", ptx)),
        "vector_stores": len(re.findall(r"\bst\.global[.\w]*\.v4", ptx)),
        "sass_instructions": sum(opcodes.values()),
        "sass_opcodes": dict(opcodes.most_common(8)),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", type=int, default=90)
    parser.add_argument("--out")
    args = parser.parse_args()
    shapes = {
        "gdn conv": GDN_SHAPE,
        "gdn scan": GDN_SCAN_SHAPE,
        "rotary": ROTARY_SHAPE,
        "attention dq": ATTENTION_DQ_SHAPE,
        "sampler": SAMPLER_SHAPE,
    }
    result = {"arch": f"sm_{args.arch}", "triton": triton.__version__, "shapes": shapes, "kernels": {}}
    for name, kernel in KERNELS.items():
        rows = result["kernels"][name] = [build(kernel, config, args.arch) for config in kernel.configs]
        for row in rows:
            print(
                f"{name} {row['config']}: {row['registers']} registers, spills {row['spill_store_bytes']} B stored "
                f"{row['spill_load_bytes']} B loaded; vector loads {row['vector_loads']} of {row['global_loads']}, "
                f"stores {row['vector_stores']} of {row['global_stores']}; {row['sass_instructions']} SASS instructions"
                f" "
                f"({', '.join(f'{op} {n}' for op, n in row['sass_opcodes'].items())})"
            )
    print(json.dumps(result))
    if args.out:
        write_json_atomic(args.out, result)


if __name__ == "__main__":
    main()
