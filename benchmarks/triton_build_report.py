"""Registers, spills and vector loads of the package's autotuned Triton kernels as built for the H200 (sm_90), on any
machine: Triton compiles to PTX without a GPU and its bundled ptxas assembles it (no CUDA driver needed).

    python benchmarks/triton_build_report.py [--arch 90] [--out F]

For each configuration an autotuned kernel offers (the GDN conv forward and the backward's two kernels, at
hybrid-1b's widths), with the pointer arguments 16-byte aligned as Triton's JIT specialises them: ptxas's registers
per thread and spill bytes, and how many of the global loads and stores are 16-byte vectors. A spilling
configuration still runs (its spills go to L1), but the autotuner's candidates are chosen from these
(`kernels/gdn_conv_triton.py`). The last stdout line is one JSON object, also written to --out.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import tempfile
from pathlib import Path

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from longstraw.kernels import gdn_conv_triton
from longstraw.results import write_json_atomic

# hybrid-1b's GDN layer: q and k 2,048 channels each (heads of 128), v 4,096, 4 taps, a state and a bias, SiLU
GDN_SHAPE = {"C": 8192, "KEY_DIM": 2048, "K": 4, "D": 128, "HAS_STATE": True, "HAS_BIAS": True, "SILU": True}
POINTERS = {"dpre_ptr": "*fp32"}  # the backward's float32 intermediate; every other tensor is bf16
KERNELS = {
    "gdn conv forward": gdn_conv_triton._conv_split_normalized_kernel,
    "gdn conv backward, pre-activations' gradient": gdn_conv_triton._pre_activation_gradient_kernel,
    "gdn conv backward, the taps' transpose": gdn_conv_triton._conv_input_gradient_kernel,
}


def build(autotuned, config: triton.Config, arch: int) -> dict:
    fn = autotuned.fn
    constexprs = {name: v for name, v in {**GDN_SHAPE, "EPS": 1e-6, **config.kwargs}.items() if name in fn.arg_names}
    signature = {name: "constexpr" if name in constexprs else POINTERS.get(name, "*bf16") for name in fn.arg_names}
    signature["T"] = "i32"
    aligned = {(i,): [["tt.divisibility", 16]] for i, name in enumerate(fn.arg_names) if name.endswith("_ptr")}
    source = ASTSource(
        fn=fn,
        signature=signature,
        constexprs={(fn.arg_names.index(name),): value for name, value in constexprs.items()},
        attrs=aligned,
    )
    compiled = triton.compile(source, target=GPUTarget("cuda", arch, 32), options={"num_warps": config.num_warps})
    ptx = compiled.asm["ptx"]
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "kernel.ptx"
        path.write_text(ptx)
        ptxas = Path(triton.__file__).parent / "backends/nvidia/bin/ptxas"
        report = subprocess.run(
            [str(ptxas), f"-arch=sm_{arch}a", "-v", str(path), "-o", str(Path(folder) / "kernel.cubin")],
            capture_output=True,
            text=True,
            check=True,
        ).stderr
    number = lambda pattern: int(re.search(pattern, report).group(1))  # noqa: E731
    return {
        "config": {**config.kwargs, "num_warps": config.num_warps},
        "registers": number(r"Used (\d+) registers"),
        "spill_store_bytes": number(r"(\d+) bytes spill stores"),
        "spill_load_bytes": number(r"(\d+) bytes spill loads"),
        "global_loads": len(re.findall(r"\bld\.global", ptx)),
        "vector_loads": len(re.findall(r"\bld\.global[.\w]*\.v4", ptx)),
        "global_stores": len(re.findall(r"\bst\.global", ptx)),
        "vector_stores": len(re.findall(r"\bst\.global[.\w]*\.v4", ptx)),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", type=int, default=90)
    parser.add_argument("--out")
    args = parser.parse_args()
    result = {"arch": f"sm_{args.arch}", "triton": triton.__version__, "shape": GDN_SHAPE, "kernels": {}}
    for name, autotuned in KERNELS.items():
        rows = result["kernels"][name] = [build(autotuned, config, args.arch) for config in autotuned.configs]
        for row in rows:
            print(
                f"{name} {row['config']}: {row['registers']} registers, spills {row['spill_store_bytes']} B stored "
                f"{row['spill_load_bytes']} B loaded; vector loads {row['vector_loads']} of {row['global_loads']}, "
                f"stores {row['vector_stores']} of {row['global_stores']}"
            )
    print(json.dumps(result))
    if args.out:
        write_json_atomic(args.out, result)


if __name__ == "__main__":
    main()
