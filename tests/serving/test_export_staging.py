"""`cllm export`'s temporary files: the unquantized GGUF and the staged side folder live in one
staging folder beside the GGUF, removed on SIGTERM, and the next export to the same GGUF removes
one a SIGKILL left; the GGUF appears last, so a GGUF present means its side folder is complete.
Each export runs in a subprocess, held at a chosen step (the quantizer or the side folder,
replaced in that subprocess only by a stand-in that says so and waits) until the test kills it.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from cllm.cli import main
from cllm.runtime.gguf import read_source
from tests.serving.test_export import checkpoint, gguf, tokenizer  # noqa: F401 - fixtures

WAIT = 120  # seconds: a bound against hangs, never a speed requirement

# `cllm export` with the step named by argv[1] held: it prints "held" and waits to be killed
HELD_EXPORT = textwrap.dedent("""
    import sys, time
    import cllm.serving.export as export
    from cllm.cli import main

    def held(*args, **kwargs):
        print("held", flush=True)
        time.sleep(600)

    step = sys.argv[1]
    if step == "quantize":
        export.unavailable, export.quantize = (lambda: None), held
    else:
        export.claim_folder = held
    sys.exit(main(sys.argv[2:]))
""")


def held_export(step: str, *args: str) -> subprocess.Popen:
    """An export subprocess, returned once it is held at `step`."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    process = subprocess.Popen([sys.executable, "-c", HELD_EXPORT, step, "export", *args], env=env,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    line = process.stdout.readline()
    if line.strip() != "held":
        process.kill()
        pytest.fail(f"the export did not reach {step}: {line!r} {process.communicate(timeout=WAIT)[1][-2000:]}")
    return process


def leftovers(folder: Path, name: str) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.name.startswith(f".{name}."))


@pytest.mark.llamacpp
def test_a_killed_quantized_export_leaves_files_the_next_export_removes(checkpoint, tmp_path):  # noqa: F811
    out = tmp_path / "q.gguf"
    args = ["--model", str(checkpoint), "--gguf", str(out), "--quantize", "q8_0"]
    process = held_export("quantize", *args)
    assert leftovers(tmp_path, out.name)  # the unquantized file, staged
    process.send_signal(signal.SIGKILL)
    process.communicate(timeout=WAIT)
    assert leftovers(tmp_path, out.name) and not out.exists()  # what SIGKILL leaves
    assert main(["export", *args]) == 0
    assert leftovers(tmp_path, out.name) == []
    assert read_source(out)["quantize"] == "q8_0"
    assert (tmp_path / "q.cllm" / "tokenizer.json").is_file()


@pytest.mark.llamacpp
def test_a_terminated_export_leaves_nothing_behind(checkpoint, tmp_path):  # noqa: F811
    out = tmp_path / "q.gguf"
    process = held_export("quantize", "--model", str(checkpoint), "--gguf", str(out), "--quantize", "q8_0")
    process.send_signal(signal.SIGTERM)
    _, err = process.communicate(timeout=WAIT)
    assert process.returncode != 0 and "Traceback" not in err
    assert sorted(p.name for p in tmp_path.iterdir()) == []


@pytest.mark.llamacpp
def test_a_gguf_present_means_its_side_folder_is_complete(checkpoint, tmp_path):  # noqa: F811
    out, side = tmp_path / "m.gguf", tmp_path / "m.cllm"
    process = held_export("side", "--model", str(checkpoint), "--gguf", str(out))
    process.send_signal(signal.SIGKILL)
    process.communicate(timeout=WAIT)
    assert not out.exists() or (side / "tokenizer.json").is_file()
    assert main(["export", "--model", str(checkpoint), "--gguf", str(out)]) == 0
    assert read_source(out) and (side / "tokenizer.json").is_file() and leftovers(tmp_path, out.name) == []


@pytest.mark.llamacpp
def test_an_export_running_to_the_same_gguf_is_refused_and_left_alone(checkpoint, tmp_path, capsys):  # noqa: F811
    out = tmp_path / "q.gguf"
    args = ["--model", str(checkpoint), "--gguf", str(out), "--quantize", "q8_0"]
    process = held_export("quantize", *args)
    try:
        staged = leftovers(tmp_path, out.name)
        assert main(["export", *args]) == 2
        err = capsys.readouterr().err.strip()
        assert "another cllm export" in err and len(err.splitlines()) == 1
        assert leftovers(tmp_path, out.name) == staged
    finally:
        process.kill()
        process.communicate(timeout=WAIT)


@pytest.mark.llamacpp
def test_temporary_looking_files_not_an_exports_are_kept_and_reported(checkpoint, tmp_path, caplog):  # noqa: F811
    out = tmp_path / "m.gguf"
    mine = tmp_path / ".m.gguf.abc123"
    mine.mkdir()
    (mine / "source.gguf").write_text("mine")
    assert main(["export", "--model", str(checkpoint), "--gguf", str(out)]) == 0
    assert (mine / "source.gguf").read_text() == "mine"
    assert ".m.gguf.abc123" in caplog.text and "not provably" in caplog.text


@pytest.mark.llamacpp
def test_a_lookup_cache_inside_a_side_folder_yet_to_be_made_is_refused(checkpoint, tmp_path, capsys):  # noqa: F811
    out = tmp_path / "m.gguf"
    cache = tmp_path / "m.cllm" / "lookup.bin"
    assert main(["export", "--model", str(checkpoint), "--gguf", str(out), "--lookup-cache", str(cache)]) == 2
    err = capsys.readouterr().err.strip()
    assert "side folder" in err and len(err.splitlines()) == 1
    assert not out.exists() and not (tmp_path / "m.cllm").exists()
