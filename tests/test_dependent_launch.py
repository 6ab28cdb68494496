"""Programmatic dependent launches of the decoding kernels (`kernels.dependent_launch`), without a GPU: the setting,
and the kernels compiled for Hopper (sm_90) by Triton on this CPU (its own ptxas), where the PTX shows that a kernel
waits for the one before it (`griddepcontrol.wait`), or lets the one after it start (`launch_dependents`), only when
launched dependent. Whether that is faster, and bit for bit the serial step, is for a GPU: `benchmarks/rollout_speed.py
--launches`, tests/test_decode_cuda.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from longstraw.kernels.dependent_launch import decode_launches, launches_dependent

pytest.importorskip("triton")


def test_the_setting_refuses_an_unknown_order_and_nothing_launches_dependent_off_cuda():
    with pytest.raises(ValueError, match="decode launches must be one of"), decode_launches("eager"):
        pass
    with decode_launches("dependent"):
        assert not launches_dependent(torch.device("cpu"))
    assert not launches_dependent(torch.device("cpu"), asked=True)


# each kernel compiled for sm_90 with PDL off and on; prints {kernel: {PDL: [waits, releases]}}
COMPILE = """
import json, triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from longstraw.kernels import decode_attention_triton as attention, rope_append_triton as rope, swiglu_triton as swiglu

FLOAT32 = {"o_ptr", "l_ptr"}
SCALARS = {"eps": "fp32", "scale_log2": "fp32"}

def signature(kernel, constants):
    out = {}
    for name in kernel.arg_names:
        if name in constants:
            out[name] = "constexpr"
        elif name == "step_ptr":
            out[name] = "*i64"
        elif name.endswith("_ptr"):
            out[name] = "*fp32" if name in FLOAT32 else "*bf16"
        else:
            out[name] = SCALARS.get(name, "i32")
    return out

KERNELS = {
    "_prefix_partials": (attention._prefix_partials, dict(M=32, D=64, DV=64, BLOCK_N=128)),
    "_own_and_merge": (attention._own_and_merge, dict(D=64, DV=64, BLOCK_N=128, BLOCK_S=32, SINKS=False)),
    "_rope_append_kernel": (rope._rope_append_kernel, dict(D=64, DV=64, R=64, BD=64, BDV=64, SCALED=True, BX=1024)),
    "_swiglu_stacked_scaled_kernel": (swiglu._swiglu_stacked_scaled_kernel, dict(BLOCK=256, BX=1024)),
}
result = {}
for name, (kernel, constants) in KERNELS.items():
    for pdl in (False, True):
        fixed = {**constants, "PDL": pdl}
        source = ASTSource(kernel, signature(kernel, fixed), constexprs=fixed)
        ptx = triton.compile(source, target=GPUTarget("cuda", 90, 32)).asm["ptx"]
        marks = ["griddepcontrol.wait", "griddepcontrol.launch_dependents"]
        result.setdefault(name, {})[str(pdl)] = [mark in ptx for mark in marks]
print(json.dumps(result))
"""


def test_the_decoding_kernels_wait_or_release_only_when_launched_dependent():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # compiled, not interpreted
    done = subprocess.run([sys.executable, "-c", COMPILE], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    compiled = json.loads(done.stdout.splitlines()[-1])
    off = [False, False]
    assert compiled == {
        "_prefix_partials": {"False": off, "True": [False, True]},  # releases the merge at its start
        "_own_and_merge": {"False": off, "True": [True, False]},  # waits, before the partials
        "_rope_append_kernel": {"False": off, "True": [True, False]},
        "_swiglu_stacked_scaled_kernel": {"False": off, "True": [True, False]},
    }
