"""Whether the installed torch and transformers work together, read from the package records
(nothing is imported, so the check runs before any command imports transformers)."""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

from packaging.version import InvalidVersion, Version

from cllm.core.errors import UserError


def version_problem(torch_version: str, transformers_version: str) -> str | None:
    """Why this torch cannot run under this transformers, or None. Transformers 5 disables a
    torch older than 2.6 at import (everything then fails far from the cause); pip cannot see it,
    because transformers does not require torch. 4.56-4.57 take torch >= 2.1."""
    try:
        torch_v, tf_v = Version(torch_version), Version(transformers_version)
    except InvalidVersion:
        return None
    floor = (2, 6) if tf_v.major >= 5 else (2, 1)
    if torch_v.release >= floor:
        return None
    fix = ("pip install 'transformers>=4.56,<5' or a newer torch"
           if tf_v.major >= 5 and torch_v.release >= (2, 1) else "install a newer torch")
    return (f"transformers {transformers_version} needs torch >= {floor[0]}.{floor[1]}, "
            f"but torch {torch_version} is installed: {fix}")


def check_versions() -> None:
    """A one-line `UserError` when the installed torch and transformers do not work together
    (read from the package records: nothing is imported)."""
    try:
        problem = version_problem(version("torch"), version("transformers"))
    except PackageNotFoundError:
        return
    if problem:
        raise UserError(problem)
