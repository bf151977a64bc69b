"""`cllm pretrain`: train the embedded target model from scratch on the stdlib corpus
(`cllm.training.pretrain`), or resume the run in --out; a line says where it landed and its
final losses. Ctrl-C saves a checkpoint and says how to resume (exit status 130).
"""

from __future__ import annotations

import json

from cllm.core.progress import echo_log
from cllm.training.cards import fmt
from cllm.training.pretrain import SUMMARY, pretrain
from cllm.training.pretrain import PretrainConfig as Config


def run(config: Config) -> int:
    try:
        with echo_log("cllm.training", "cllm pretrain: "):
            out = pretrain(config)
    except KeyboardInterrupt as stopped:
        print(f"\ncllm pretrain: {str(stopped) or 'interrupted'}")
        return 130
    summary = json.loads((out / SUMMARY).read_text())
    print(f"cllm pretrain: {summary['steps']} steps, {summary['parameters'] / 1e6:.2f}M parameters, "
          f"train loss {fmt(summary['final_train_loss'])}, validation loss {fmt(summary['final_val_loss'])} "
          f"({summary['train_time_s']:.0f} s) -> {out}")
    return 0
