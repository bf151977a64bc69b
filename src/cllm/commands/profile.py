"""`cllm profile`: time a decoding step of k fed tokens on a random-weight model of a named
shape (up to 13B), and print the table of t(k), t(k)/t(1) and each method's predicted tokens/s.

The measuring is `cllm.profiling.profile`; this module shows its steps and prints its table.
"""

from __future__ import annotations

from pathlib import Path

from cllm.core.progress import echo_log
from cllm.profiling.profile import PROFILE_JSON, PROFILE_TABLE, markdown, profile
from cllm.profiling.profile import ProfileConfig as Config


def run(config: Config) -> int:
    with echo_log("cllm.profiling", "cllm profile: "):
        result = profile(config)
    print(markdown(result), end="")
    if config.out is not None:
        out = Path(config.out)
        print(f"cllm profile: wrote {out / PROFILE_JSON} and {out / PROFILE_TABLE}")
    return 0
