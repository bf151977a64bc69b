"""The runtime tests use the decoding tests' tiny models on the torch runtimes (`torch_arch`);
the llama.cpp runtime's own tests are in test_llamacpp.py."""

import pytest

from tests.decoding.conftest import torch_arch  # noqa: F401 (a fixture)


@pytest.fixture
def arch(torch_arch):  # noqa: F811
    """The lean and batched runtimes' tests: on the torch runtimes."""
    return torch_arch
