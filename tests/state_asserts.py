"""Assertions on captured resident states shared by the test files."""

from tolerances import close


def assert_same_state(a, b, rtol):
    """Two captures of one prompt hold the same tensors, layer by layer: within rtol of each element, or of
    the tensor's largest where an element is near zero."""
    for ea, eb in zip(a.layers, b.layers, strict=True):
        for ta, tb in zip(ea.tensors(), eb.tensors(), strict=True):
            close(ta, tb, rtol=rtol, atol=rtol * float(tb.abs().max()), what="state")
