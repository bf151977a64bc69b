"""For tests that need a reference file no one here wrote (`cllm.models.reference`): each skips
with the line that says how to fetch it ("needs SmolLM2-135M-Instruct Q4_1 (make smollm2)").

    @needs("smollm2")
    def test_...(): path = reference("smollm2")
"""

from __future__ import annotations

from pathlib import Path

import pytest

from cllm.models.reference import hint, reference_path


def needs(name: str) -> pytest.MarkDecorator:
    """Skip the test, saying what to run, unless reference file `name` has been fetched."""
    return pytest.mark.skipif(reference_path(name) is None, reason=hint(name))


def reference(name: str) -> Path:
    """The fetched file `name`; skips the test (saying what to run) when it is not there."""
    path = reference_path(name)
    if path is None:
        pytest.skip(hint(name))
    return path
