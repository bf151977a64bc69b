"""Packages whose public names are imported on first use, so that importing one light module of
a package (a config dataclass, a constant) does not import torch through the package's
`__init__`. A package lists its names and the modules that define them once; static type
checkers read the same names from an `if TYPE_CHECKING:` import block beside it.
"""

from __future__ import annotations

import importlib
import sys
import types


class LazyPackage(types.ModuleType):
    """A package module whose `_exports` (public name -> defining module) load on first access."""

    _exports: dict[str, str]

    def __getattr__(self, name: str):
        exports = self.__dict__.get("_exports", {})
        if name not in exports:
            raise AttributeError(f"module {self.__name__!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(exports[name]), name)
        setattr(self, name, value)  # later look-ups skip this method
        return value

    def __setattr__(self, name: str, value) -> None:
        # Importing submodule `pkg.x` binds it as `pkg.x`; where `x` is also a public name defined
        # in that submodule (`medusa/medusa2.py`'s function `medusa2`), the name keeps meaning the
        # function, as it did when the package imported everything at once.
        exports = self.__dict__.get("_exports", {})
        if isinstance(value, types.ModuleType) and exports.get(name) == value.__name__:
            value = getattr(value, name)
        super().__setattr__(name, value)

    def __dir__(self) -> list[str]:
        return sorted(set(self.__dict__) | set(self.__dict__.get("_exports", {})))


def lazy_exports(package: str, exports: dict[str, str]) -> None:
    """Make the package module `package` (call with `__name__`) load each name of `exports`
    (public name -> module defining it) from its module on first use."""
    module = sys.modules[package]
    module.__class__ = LazyPackage
    module._exports = dict(exports)
