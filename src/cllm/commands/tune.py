"""`cllm tune`: measure a model's step cost on this machine and write its decode defaults (block
size, fed-token budget) beside it, where `cllm.models.load_for_decoding` finds them.

The measuring and the rule are `cllm.profiling.tune`; this module shows its steps and prints
what it chose.
"""

from __future__ import annotations

from cllm.core.progress import echo_log
from cllm.profiling.tune import TuneConfig as Config
from cllm.profiling.tune import defaults_path, tune


def run(config: Config) -> int:
    with echo_log("cllm.profiling", "cllm tune: "):
        record = tune(config)
    ks, ratios = record["measured"]["k"], record["measured"]["ratio"]
    print("| k | " + " | ".join(map(str, ks)) + " |\n|---|" + "---|" * len(ks))
    print("| t(k)/t(1) | " + " | ".join(f"{r:.2f}" for r in ratios) + " |")
    print(f"cllm tune: {record['why']}")
    print(f"cllm tune: wrote {defaults_path(config)}")
    return 0
