"""`benchmarks/rollout_speed.py`'s HF baseline on a hybrid (GDN layers, whose HF cache layers cannot be repeated to G
rows): the G-row prompt cache continues as HF's own forward over the whole prompt does, and the command counts HF's
step beside ours."""

import json
import subprocess
import sys
from pathlib import Path

import torch
from float64_reference import float64_model, hf_float64
from script_module import load_script
from tolerances import TOL64

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "rollout_speed.py"


def _benchmark():
    return load_script("benchmarks/rollout_speed.py")


def test_the_g_row_prompt_cache_gives_hfs_whole_prompt_logits_on_a_hybrid():
    """float64 (HF's float32 casts lifted): each of the G rows' next-token logits from the cache, through HF's
    recurrent GDN step, equal HF's chunked forward over the whole prompt."""
    model = float64_model("tiny-qwen3_5", seed=0)
    prompt = torch.randint(0, model.config.vocab_size, (40,), generator=torch.Generator().manual_seed(0))
    with hf_float64(model), torch.no_grad():
        cache = _benchmark()._hf_prompt_cache(model, prompt, 3)
        rows = model(prompt[-1:].expand(3, 1), past_key_values=cache, use_cache=True).logits[:, -1]
        whole = model(prompt[None]).logits[0, -1]
    assert rows.shape == (3, model.config.vocab_size)
    torch.testing.assert_close(rows, whole.expand(3, -1), rtol=TOL64, atol=TOL64 * whole.abs().max().item())


def test_the_counts_include_hfs_step_on_a_hybrid(tmp_path):
    out = tmp_path / "counts.json"
    args = ["--preset", "tiny-qwen3_5", "--length", "256", "--group", "4", "--member-tokens", "4"]
    done = subprocess.run(
        [sys.executable, str(SCRIPT), *args, "--device", "cpu", "--counts-only", "--out", str(out)],
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    counts = json.loads(out.read_text())["counts"]
    assert counts["hf_eager_step"]["aten_ops"] > 0 and counts["ours_eager_step"]["aten_ops"] > 0
