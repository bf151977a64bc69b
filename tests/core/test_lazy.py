"""Lazy packages (`cllm.core.lazy`): every public name loads on first use, as it did eagerly."""

import importlib
import subprocess
import sys
import types

import pytest

LAZY = ["cllm.decoding", "cllm.models", "cllm.runtime", "cllm.training.medusa", "cllm.training.eagle"]


@pytest.mark.parametrize("name", LAZY)
def test_every_public_name_loads_and_is_listed(name):
    package = importlib.import_module(name)
    for public in package.__all__:
        assert getattr(package, public) is not None
    assert set(package.__all__) <= set(dir(package))
    with pytest.raises(AttributeError):
        package.no_such_name  # noqa: B018


def test_a_name_shared_with_its_submodule_stays_the_function():
    """`medusa/medusa2.py` defines `medusa2`: importing the submodule first must not rebind the name."""
    code = ("import types, cllm.training.medusa.medusa2\nfrom cllm.training.medusa import medusa2\n"
            "print(isinstance(medusa2, types.ModuleType))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.stdout.strip() == "False", result.stderr
    assert not isinstance(importlib.import_module("cllm.training.medusa").medusa2, types.ModuleType)
