"""The skip mark of the tests that need Triton (its interpreter on the CPU, or a GPU)."""

import importlib.util

import pytest

needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                                  reason="Triton is not installed (pip install triton)")
