"""Seconds of one training forward + backward (16 records) by states per record.

    python scripts/train_step_time.py --data runs/main/trajectories --states 1,4,8 --threads 1

k states of a record share one forward of its prefix (`cllm.rows.forward_shared_prefix`), so
the step grows much more slowly than the k-fold number of consistency pairs. Median of 3 steps
after one warm-up, on the first records of --data.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from cllm.batches import Counts, make_micro_batch
from cllm.data.trajectories import TrajectoryReader
from cllm.models import load_model
from cllm.objective import micro_batch_loss
from cllm.train import TrainConfig


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", default="runs/main/trajectories")
    ap.add_argument("--model", default="stdlib-coder")
    ap.add_argument("--states", default="1,4,8")
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    reader = TrajectoryReader(args.data)
    records, meta = reader.records(), reader.meta
    model = load_model(args.model, dtype="float32").train()
    for k in map(int, args.states.split(",")):
        config = TrainConfig(data=args.data, states_per_record=k, label_smoothing=0.0)
        times = []
        for step in range(4):
            batch = records[step * 16 : (step + 1) * 16]
            draws = torch.rand(16, max(len(r.states) for r in batch), generator=torch.Generator().manual_seed(step))
            mb = make_micro_batch(batch, draws, pad_id=meta.pad_token_id, block_size=meta.block_size, config=config)
            counts = Counts()
            counts.add(mb, config)
            start = time.perf_counter()
            micro_batch_loss(model, mb, counts, config, meta.pad_token_id).total.backward()
            times.append(time.perf_counter() - start)
            model.zero_grad(set_to_none=True)
        median = statistics.median(times[1:])
        print(f"states per record {k}: {median:.2f} s per 16-record forward + backward "
              f"({int(counts.gc)} GC positions)", flush=True)


if __name__ == "__main__":
    main()
