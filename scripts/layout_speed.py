"""One training micro-batch in both layouts: forward + backward time and the loss.

    python scripts/layout_speed.py --data runs/traj-2560 --threads 1

The same records (every block of the first prompts that have all of them) go through
`cllm.training.objective.micro_batch_loss` with the records layout (one row per record, its prefix once,
its states after it) and with `--layout packed` (one sequence per prompt: its clean text once,
then every state block), under `cllm distill`'s default objective (argmax GC against the frozen
target, KD x 10 on the fixed points). Prints the fastest of three timed repeats (after one
warm-up) per layout and setting, and both losses, which must agree.
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

from cllm.data.trajectories import TrajectoryReader
from cllm.models import load_model
from cllm.training.batches import Counts, make_micro_batch, prompt_chains
from cllm.training.config import Recipe, TrainConfig
from cllm.training.objective import FrozenTeacher, micro_batch_loss


def time_layout(model, teacher, records, draws, layout: str, states: int, block_size: int, pad_id: int,
                repeats: int) -> tuple[float, float]:
    """(fastest seconds of one forward + backward, the loss) of `records` in `layout`."""
    cfg = TrainConfig(recipe=Recipe(consistency="gc", distance="argmax", consistency_teacher="target", ar_weight=0,
                                    kd_weight=10, ar_target="fixed_points", states_per_record=states, skip_copies=True,
                                    state_schedule="progressive", layout=layout, label_smoothing=0))
    mb = make_micro_batch(records, draws, pad_id=pad_id, block_size=block_size, config=cfg)
    counts = Counts()
    counts.add(mb, cfg)
    times = []
    for _ in range(repeats + 1):
        model.zero_grad()
        start = time.perf_counter()
        parts = micro_batch_loss(model, mb, counts, cfg, pad_id, teacher=teacher)
        parts.total.backward()
        times.append(time.perf_counter() - start)
    return min(times[1:]), float(parts.total.detach())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", default="runs/traj-2560", help="trajectory directory written by `cllm collect`")
    ap.add_argument("--model", default="stdlib-coder", help="the model the trajectories were collected with")
    ap.add_argument("--settings", default="2x8,16x1",
                    help="comma-separated PROMPTSxSTATES: prompts per micro-batch, states per block")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    reader = TrajectoryReader(args.data)
    meta = reader.meta
    settings = [tuple(int(x) for x in s.split("x")) for s in args.settings.split(",")]
    blocks = meta.max_new_tokens // meta.block_size
    chains = [c for c in prompt_chains(reader.records()) if len(c) == blocks]
    model = load_model(args.model, dtype="float32").train()
    teacher = FrozenTeacher(copy=load_model(args.model, dtype="float32").eval())
    if len(chains) < max(p for p, _ in settings):
        sys.exit(f"layout_speed.py: error: {args.data} has {len(chains)} prompts with all {blocks} blocks, fewer "
                 f"than --settings asks for")
    for prompts, states in settings:
        records = [r for c in chains[:prompts] for r in c]
        states_held = max(len(r.states) for r in records)
        draws = torch.rand(len(records), states_held, generator=torch.Generator().manual_seed(0))
        (t_rec, loss_rec), (t_pack, loss_pack) = (
            time_layout(model, teacher, records, draws, layout, states, meta.block_size, meta.pad_token_id,
                        args.repeats)
            for layout in ("records", "packed"))
        print(f"{prompts} prompts x {blocks} blocks, {states} state(s) per block: records {t_rec:.2f} s, "
              f"packed {t_pack:.2f} s (x{t_rec / t_pack:.2f}); loss {loss_rec:.5f} / {loss_pack:.5f}", flush=True)


if __name__ == "__main__":
    main()
