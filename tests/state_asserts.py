"""Assertions on captured resident states shared by the test files."""

import torch


def assert_same_state(a, b, rtol=1e-5, atol=1e-6):
    """Two captures of one prompt hold the same tensors, layer by layer."""
    for ea, eb in zip(a.layers, b.layers, strict=True):
        for ta, tb in zip(ea.tensors(), eb.tensors(), strict=True):
            torch.testing.assert_close(ta, tb, rtol=rtol, atol=atol)
