"""Tolerances of the tests' floating-point comparisons (docs/design.md §12), and a record of each one's margin.

A comparison about algebra (the same math in another order: context parallelism against one process, chunked
against unchunked, serial against batched, ours against HF's one pass) runs in float64 (float64_reference), where
reordering moves results by ~EPS64. A float32 tolerance is derived from what is compared, never tuned: EPS32
times how far the two sides' roundings can drift apart (`float32_tolerance`), and it sits at least 4x above the
worst error measured on every kernel path and thread count CI runs.

    within(error, TOL, "max relative error")      # assert error < TOL, and record it
    close(actual, expected, rtol, atol)           # elementwise |a - e| <= atol + rtol |e|, recorded as a fraction

With LONGSTRAW_TOLERANCE_LOG=FILE, every `within` and `close` appends {test, what, error, tolerance} to FILE
(JSON lines): a pass per kernel path and thread count gives each comparison's margin, tolerance / error.
With LONGSTRAW_TEST_THREADS=N the tests run on N threads, and so do the processes and ranks they start
(forked ranks on one: see install_fixed_threads; tests/conftest.py installs it).
"""

from __future__ import annotations

import json
import math
import os

import torch

EPS32 = 2.0**-23  # float32 machine epsilon: the spacing of float32 numbers at 1 (1.19e-7)
EPS64 = 2.0**-52  # float64 (2.2e-16)
EPS_BF16 = 2.0**-7  # bfloat16 (7.8e-3): 8 significant bits
# the factor a derived bound carries over the error its model predicts; also the least margin each tolerance
# keeps over the worst error measured on any kernel path and thread count
SAFETY = 4
# A float64 comparison's tolerance: far above float64 reordering (measured <= 1e-13, ~500 EPS64) and far below
# one float32 rounding, so a float32 step slipping into a float64 comparison fails it.
TOL64 = EPS32 / 64  # 1.9e-9


def float32_tolerance(*lengths: int, condition: float = 1.0, roundings: float = 1.0) -> float:
    """A bound on the relative difference of two float32 computations of one quantity whose reductions
    run in other orders (other kernels, blockings, thread splits, chunkings): a sum of n terms rounds
    ~sqrt(n) EPS32 apart (random-walk rounding) per reduction of length n in `lengths`, `roundings` counts
    the float32 operations in a chain (layers, steps), and `condition` is how much the compared quantity
    amplifies a relative error of its inputs (sum |terms| / |sum| where terms cancel). Times SAFETY."""
    return SAFETY * condition * roundings * math.sqrt(math.prod(lengths)) * EPS32


def logprob_tolerance(vocab: int, logp_scale: float) -> float:
    """An absolute bound on two float32 evaluations of log softmax(logits)[target] from equal logits (our
    target-logit-less-logsumexp and torch's log_softmax, or one blocked otherwise): the sum of `vocab`
    exponentials rounds within ~sqrt(vocab) EPS32 of itself, an absolute error of its log, and the
    subtraction within EPS32 of |log p| <= `logp_scale`. Times SAFETY."""
    return SAFETY * EPS32 * (math.sqrt(vocab) + logp_scale)


def chunked_logprob_bound(vocab: int, chunk: int, logp_abs, approximate_exp: bool = False):
    """An absolute bound on a float32 log softmax(x)[t] computed as (x_t - m) - log(s) from chunks of `chunk`
    logits (`kernels.sampling_triton`: each chunk's max m_c and sum of exp(x - m_c), merged as s = sum s_c
    exp(m_c - m)), against its exact value; `logp_abs`: |log p| (a float or a tensor of them). s's relative error:
    the chunk's sum of at most `chunk` terms and the merge's of one a chunk (an EPS32 a term), each exponential's
    (EPS32) and its rescaling's (2 EPS32), and the roundings of the exponents x - m_c and m_c - m, each moving its
    term by EPS32 |x - m| relatively: over the terms weighted by p that is EPS32 sum p |log p| (x - m >= log p),
    at most log(vocab) EPS32 each. `approximate_exp`: Triton's exp on CUDA, ex2.approx (2 EPS32) of the exponent
    times log2(e) (another rounding of it). Then log(s) and the two subtractions, each within EPS32 of |log p|
    (0 <= log s, m - x_t <= |log p|). Times SAFETY."""
    exps = 1 + 2 * math.log(vocab) + (2 + math.log(vocab) if approximate_exp else 0)
    return SAFETY * EPS32 * (min(chunk, vocab) + math.ceil(vocab / chunk) + 2 + exps + 3 * logp_abs)


def float64_residue_tolerance(gdn: bool, vocab: int = 256) -> float:
    """The relative tolerance of a float64 comparison (HF's float32 casts lifted: float64_reference) against HF,
    a peer, or another of our paths, where float32 remains by design: the log-softmax of the logits (ours: the
    target logit less a logsumexp; HF's log_softmax; TRL's in float64) and, in a Gated DeltaNet layer,
    exp(A_log) and the decay input a (`families.hybrid.gdn_rule_inputs`). A float32 softmax probability is
    exp of an argument rounded at |log p| ~ log(vocab), so it and the gradient carry ~log(vocab) EPS32
    (measured <= 0.6 log(vocab) EPS32, TRL against ours); a GDN layer's ill-conditioned decay gradients add
    to it (measured <= 1.1 log(vocab) EPS32): 4 times that. Times SAFETY."""
    return float32_tolerance(condition=math.log(vocab) * (4 if gdn else 1))


def relative(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """||actual - expected|| / ||expected|| over the whole tensor, in float64."""
    diff = (actual.detach().double() - expected.detach().double()).norm()
    return float(diff / expected.detach().double().norm().clamp_min(1e-300))


def max_abs(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """max |actual - expected|, in float64."""
    return float((actual.detach().double() - expected.detach().double()).abs().max())


def _record(what: str, error: float, tolerance: float) -> None:
    path = os.environ.get("LONGSTRAW_TOLERANCE_LOG")
    if not path:
        return
    test = os.environ.get("PYTEST_CURRENT_TEST", "?").rsplit(" (", 1)[0]
    with open(path, "a") as f:
        f.write(
            json.dumps(
                {"test": test, "what": what, "error": error, "tolerance": tolerance, "threads": torch.get_num_threads()}
            )
            + "\n"
        )


def within(error: float, tolerance: float, what: str = "error") -> None:
    """assert error < tolerance, recording both (LONGSTRAW_TOLERANCE_LOG)."""
    error = float(error)
    _record(what, error, tolerance)
    assert error < tolerance, f"{what}: {error:.3g} is not below its tolerance {tolerance:.3g}"


def above(value: float, floor: float, what: str) -> None:
    """assert value > floor: a difference that must be there (the prompt-side term, a wrong gradient)."""
    assert float(value) > floor, f"{what}: {float(value):.3g} is not above {floor:.3g}"


def close(actual: torch.Tensor, expected: torch.Tensor, rtol: float, atol: float, what: str = "elementwise") -> None:
    """torch.testing.assert_close's rule, |a - e| <= atol + rtol |e| for every element, recorded as the
    largest fraction of its bound any element uses (1 = at the bound)."""
    assert actual.shape == expected.shape, (what, actual.shape, expected.shape)
    a, e = actual.detach().double(), expected.detach().double()
    diff, bound = (a - e).abs(), atol + rtol * e.abs()
    used = float(torch.where(diff == 0, 0.0, diff / bound).max()) if a.numel() else 0.0
    _record(what, used, 1.0)
    assert used <= 1.0, f"{what}: an element uses {used:.3g} of its bound {atol:.3g} + {rtol:.3g} |expected|"


# ----------------------------------------------------------------------------------------------- thread count


def fixed_threads() -> int | None:
    """LONGSTRAW_TEST_THREADS as an int (None when unset): the thread count the tests run at."""
    value = os.environ.get("LONGSTRAW_TEST_THREADS")
    return int(value) if value else None


_real_rank_main = None


def install_fixed_threads() -> None:
    """With LONGSTRAW_TEST_THREADS=N: this process on N threads, subprocesses told so (OMP_NUM_THREADS), and
    the ranks `run_ranks` starts (which give each rank its share of the cores otherwise) spawned on N threads,
    forked on one: GNU OpenMP cannot run a parallel region in a process forked after its parent ran one (it
    hangs), so a forked rank is single-threaded whatever N (as on 2 cores anyway)."""
    global _real_rank_main
    threads = fixed_threads()
    if threads is None:
        return
    from longstraw.cp import launch

    torch.set_num_threads(threads)
    os.environ["OMP_NUM_THREADS"] = str(threads)
    if _real_rank_main is None:
        _real_rank_main, launch._rank_main = launch._rank_main, rank_main_at_fixed_threads


class _AtThreads:
    def __init__(self, fn, threads):
        self.fn, self.threads = fn, threads

    def __call__(self, *args):
        torch.set_num_threads(self.threads)
        return self.fn(*args)


def rank_main_at_fixed_threads(rank, world, port, fn, args, results, forked):
    """`longstraw.cp.launch._rank_main` with `fn` run at the fixed thread count (a forked rank: one, as launch
    keeps it). A forked rank inherits this module with `_real_rank_main` set; a spawned one imports it afresh
    and finds launch's own."""
    from longstraw.cp import launch

    (_real_rank_main or launch._rank_main)(
        rank, world, port, _AtThreads(fn, 1 if forked else fixed_threads()), args, results, forked
    )
