"""The committed benchmark folders can be rerun in place with the commands their documents give
(`--out benchmarks/...`): each keeps the marker of the command that wrote it, without which that
command refuses the folder as someone else's."""

from pathlib import Path

import pytest

from cllm.core.outputs import check_folder

ROOT = Path(__file__).resolve().parents[1]
WRITTEN_BY = {"bench.json": "bench", "profile.json": "profile"}


def _run_folders() -> list[tuple[Path, str]]:
    found = {}
    for name, command in WRITTEN_BY.items():
        for path in (ROOT / "benchmarks").rglob(name):
            found[path.parent] = command
    return sorted(found.items())


def test_there_are_benchmark_folders() -> None:
    assert len(_run_folders()) >= 10


@pytest.mark.parametrize(("folder", "command"), _run_folders(), ids=lambda v: str(v).split("benchmarks/")[-1])
def test_a_benchmark_folder_accepts_its_own_command(folder: Path, command: str) -> None:
    assert check_folder(folder, command) == folder
