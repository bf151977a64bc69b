"""Installing cllm keeps the torch a user already has (the build for their machine).

The check is pip's own resolver, offline: `pip install --dry-run --no-index --report` of the
requirements that pyproject.toml declares (base + the `report` extra), in this test
environment with its torch made to read 2.5.1 (and the dependencies whose newer releases need a
newer torch made to read their last release for it, `TORCH_2_5_RELEASES`). Those are
distribution records (`METADATA` only) in a folder put on PYTHONPATH, ahead of site-packages:
pip takes the first record of a name on sys.path as the installed one. Every other requirement
is met by the packages this environment has (the suite's own); with no index, no find-links
and no pip config, pip can download nothing, so a requirement the installed set does not meet
fails the resolution instead of being fetched. The control shows the check can fail: the old
`torch==2.13.0` pin is unresolvable against that torch 2.5.1.

What it does not show: that torch 2.5 *runs* here. transformers 5 disables a torch older than
2.6 when imported (pip cannot see that: transformers does not require torch), so with torch
2.5 the README says to add 'transformers<5', and `cllm` names the clash in one line
(`cllm.models.version_problem`, tests/models/test_loading.py).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

tomllib = pytest.importorskip("tomllib")  # Python 3.11+

ROOT = Path(__file__).resolve().parents[1]


def declared(extras: tuple[str, ...] = ("report",)) -> list[str]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    return project["dependencies"] + [r for e in extras for r in project["optional-dependencies"][e]]


# What a torch-2.5 environment holds where this one's newer releases require a newer torch:
# accelerate 1.16 requires torch >= 2.6, so such a user has accelerate 1.15 (its own requirements,
# as released). A dependency that raises its torch floor later fails the test below until its
# last release for torch 2.5 is added here.
TORCH_2_5_RELEASES = {
    "accelerate": ("1.15.0", ["numpy>=1.17", "packaging>=20.0", "psutil", "pyyaml", "torch>=2.0.0",
                              "huggingface_hub>=0.21.0", "safetensors>=0.4.3"]),
}


def _record(site: Path, name: str, version: str, requires: list[str] = ()) -> None:
    """A distribution record (METADATA only) that pip takes for an installed package."""
    record = site / f"{name}-{version}.dist-info"
    record.mkdir(parents=True)
    lines = ["Metadata-Version: 2.1", f"Name: {name}", f"Version: {version}"]
    lines += [f"Requires-Dist: {r}" for r in requires]
    (record / "METADATA").write_text("\n".join(lines) + "\n")


def dry_run(requirements: list[str], fake_torch: str, tmp_path: Path) -> tuple[subprocess.CompletedProcess, dict]:
    site = tmp_path / "site"
    _record(site, "torch", fake_torch)
    for name, (version, requires) in TORCH_2_5_RELEASES.items():
        _record(site, name, version, requires)
    report = tmp_path / "report.json"
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")}
    env.update(PYTHONPATH=str(site), PIP_CONFIG_FILE=os.devnull, PIP_NO_INDEX="1",
               PIP_DISABLE_PIP_VERSION_CHECK="1", PIP_NO_INPUT="1")
    result = subprocess.run([sys.executable, "-m", "pip", "install", "--dry-run", "--quiet", "--report",
                             str(report), *requirements], capture_output=True, text=True, env=env, timeout=300)
    return result, json.loads(report.read_text()) if report.is_file() else {}


def test_the_declared_requirements_keep_an_installed_torch_2_5(tmp_path):
    requirements = declared()
    assert not any(r.replace(" ", "").startswith("torch==") for r in requirements)
    result, report = dry_run(requirements, "2.5.1", tmp_path)
    assert result.returncode == 0, result.stderr
    planned = {item["metadata"]["name"].lower(): item["metadata"]["version"] for item in report["install"]}
    assert "torch" not in planned, planned  # nothing to install: the torch there satisfies cllm
    assert planned == {}, planned  # and the test environment holds everything else


@pytest.mark.parametrize("torch_requirement", ["torch==2.13.0", "torch>=2.6"])
def test_control_a_pinned_or_newer_torch_is_unresolvable_against_it(torch_requirement, tmp_path):
    """The old pin fails; so does `torch>=2.6`, which the real torch of this environment (2.13)
    meets: pip saw the 2.5.1 record, not the real torch."""
    requirements = [r for r in declared() if not r.startswith("torch")] + [torch_requirement]
    result, _ = dry_run(requirements, "2.5.1", tmp_path)
    assert result.returncode != 0
    assert f"requirement {torch_requirement}" in result.stderr
