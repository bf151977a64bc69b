"""The size study's table (`scripts/gpu_scale_study.sh`): one row per target size, target against
its own CLLM, read from the files the runs wrote; written as Markdown and JSON with the machine in
the header.

Each run folder holds `pretrain/` (`cllm pretrain`: pretrain_summary.json, pretrain_config.json,
pretrain_log.jsonl) and `distill/` (`cllm distill`: evaluation.json, model/train_summary.json).
Tokens per forward are evaluation.json's: plain greedy Jacobi on the held-out prompts, new tokens
over forward passes of a row (prefill included), over all completions and over those that do not
end in a loop. This script measures nothing itself.

    python scripts/scale_table.py --run 30m=runs/scale-study/30m --run 120m=... --out OUT
    python scripts/scale_table.py --merge A/scale_table.json B/scale_table.json --out DIR
"""

from __future__ import annotations

import argparse
import json
import platform
import shutil
import subprocess
import sys
from pathlib import Path

MODELS = ("target", "cllm")
TABLE = "scale_table"  # OUT/scale_table.md and OUT/scale_table.json


# ---------------------------------------------------------------------------------- reading runs


def _json(path: Path) -> dict:
    return json.loads(path.read_text())


def _val_curve(log: Path) -> list[list[float]]:
    """[step, validation loss] at each of pretraining's evaluations."""
    if not log.is_file():
        return []
    records = (json.loads(line) for line in log.read_text().splitlines() if line.strip())
    return [[r["step"], r["val_loss"]] for r in records if r.get("val_loss") is not None]


def read_run(name: str, folder: Path) -> dict:
    """One size's row: its pretraining and its distillation, target and CLLM side by side."""
    pre, dist = folder / "pretrain", folder / "distill"
    summary, config = _json(pre / "pretrain_summary.json"), _json(pre / "pretrain_config.json")
    ev = _json(dist / "evaluation.json")
    trained = _json(dist / "model" / "train_summary.json")["summary"]
    prompts = ev["settings"]["prompts"]
    quality = ev["quality"]["sets"][prompts]  # model -> its measures on the held-out set
    block_sizes = [str(n) for n in ev["settings"]["block_sizes"]]
    models = {m: {"tokens_per_forward": {n: ev["tokens_per_forward"][m][n] for n in block_sizes},
                  "tokens_per_forward_not_looping": {n: quality[m]["tpf_not_looping"][n] for n in block_sizes},
                  "looping": ev["looping"][m], "degenerate": ev["degenerate"][m],
                  "val_loss": ev["ar_loss"][m], "target_nll": quality[m]["target_nll"]}
              for m in MODELS}
    gain = {key: {n: _minus(models["cllm"][key][n], models["target"][key][n]) for n in block_sizes}
            for key in ("tokens_per_forward", "tokens_per_forward_not_looping")}
    curve = _val_curve(pre / "pretrain_log.jsonl")
    return {
        "size": name, "parameters": summary["parameters"],
        "shape": {k: config[k] for k in ("layers", "width", "heads", "mlp_width", "context", "vocab_size")},
        "pretrain": {"steps": summary["steps"], "batch_size": config["batch_size"], "lr": config["lr"],
                     "bf16": config["bf16"], "tokens_seen": summary["tokens_seen"],
                     "train_tokens": summary["train_tokens"],
                     "epochs": round(summary["tokens_seen"] / summary["train_tokens"], 2),
                     "val_loss": summary["final_val_loss"], "best_val_loss": min((v for _, v in curve), default=None),
                     "val_loss_curve": curve, "train_time_s": summary["train_time_s"]},
        "distill": {"steps": trained["steps"], "records": trained["records"], "train_time_s": trained["train_time_s"],
                    "eval_prompts": prompts, "prompts_evaluated": ev["prompts_evaluated"],
                    "eval_max_new_tokens": ev["settings"]["max_new_tokens"],
                    "cllm_jacobi_equals_greedy": ev["cllm_jacobi_equals_greedy"],
                    "token_agreement": ev["token_agreement"]},
        "block_sizes": block_sizes, "target": models["target"], "cllm": models["cllm"], "gain": gain,
        "corpus": summary["corpus"]["train"],
    }


def _minus(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None else a - b


def machine(python: str | None = None) -> dict:
    """Where the study ran: platform, Python, torch, CUDA and its GPU, nvidia-smi's line."""
    info = {"platform": platform.platform(), "python": python or sys.version.split()[0]}
    try:
        import torch

        info["torch"] = torch.__version__
        info["cuda"] = torch.version.cuda if torch.cuda.is_available() else None
        info["gpu"] = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    except ImportError:  # the table does not need torch
        info["torch"] = None
    smi = shutil.which("nvidia-smi")
    if smi:
        done = subprocess.run([smi, "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"],
                              capture_output=True, text=True, timeout=30)
        info["nvidia_smi"] = done.stdout.strip() if done.returncode == 0 else f"failed: {done.stderr.strip()}"
    else:
        info["nvidia_smi"] = None
    return info


def read_seconds(path: Path | None) -> dict[str, int]:
    """The script's `stage<TAB>seconds` lines (the last one of a stage wins)."""
    if path is None or not path.is_file():
        return {}
    return {name: int(sec) for name, sec in (line.split("\t") for line in path.read_text().splitlines() if line)}


# ---------------------------------------------------------------------------------- the table


def build_table(rows: list[dict], machine_info: dict, *, stage_seconds: dict | None = None,
                settings: dict | None = None) -> dict:
    return {"machine": machine_info, "settings": settings or {}, "stage_seconds": stage_seconds or {},
            "rows": sorted(rows, key=lambda r: r["parameters"])}


def merge(tables: list[dict]) -> dict:
    """Several runs' tables as one (e.g. one device call per size): rows sorted by size, a
    size that appears twice kept from the later table; machines kept when they differ."""
    rows = {r["size"]: r for t in tables for r in t["rows"]}
    machines = [t["machine"] for t in tables]
    same = all(m == machines[0] for m in machines)
    return {"machine": machines[0] if same else machines,
            "settings": tables[-1].get("settings", {}),
            "stage_seconds": {k: v for t in tables for k, v in t.get("stage_seconds", {}).items()},
            "rows": sorted(rows.values(), key=lambda r: r["parameters"])}


def _pair(row: dict, key: str, n: str | None = None, digits: int = 2, percent: bool = False) -> str:
    """'target / CLLM' of one measure."""
    cells = []
    for m in MODELS:
        v = row[m][key] if n is None else row[m][key][n]
        cells.append("-" if v is None else f"{v:.0%}" if percent else f"{v:.{digits}f}")
    return " / ".join(cells)


def _signed(v: float | None) -> str:
    return "-" if v is None else f"{v:+.2f}"


def _machine_lines(info: dict | list[dict]) -> list[str]:
    infos = info if isinstance(info, list) else [info]
    lines = []
    for m in infos:
        gpu = m.get("nvidia_smi") or m.get("gpu") or "no GPU (nvidia-smi not found)"
        lines.append(f"Machine: {gpu}; torch {m.get('torch')} (CUDA {m.get('cuda')}), Python {m.get('python')}, "
                     f"{m.get('platform')}.")
    return lines


def markdown(table: dict) -> str:
    rows = table["rows"]
    sizes = sorted({n for r in rows for n in r["block_sizes"]}, key=int)
    lines = ["# The CLLM's own gain against the target's size", ""]
    lines += _machine_lines(table["machine"])
    if rows:
        c = rows[0]["corpus"]
        lines.append(f"Corpus: the Python {c['python']} standard library of the machine that ran it (train split "
                     f"{c['files']} files, {c['chars']:,} chars, sha256 `{c['sha256'][:8]}…`).")
    if table.get("settings"):
        lines.append("Settings: " + ", ".join(f"{k} {v}" for k, v in table["settings"].items()) + ".")
    lines += ["", "Each cell is target / CLLM. TPF: plain greedy Jacobi tokens per forward (new tokens over a row's "
              "forward passes, prefill included) on the held-out prompts, over all completions and over those "
              "that do not end in a loop; gain: CLLM - target. Val loss: nats/token on the "
              "held-out prompts' references.", ""]
    head = ["size", "parameters", "layers x width", "pretraining: tokens (epochs), val loss"]
    head += [f"TPF n={n}" for n in sizes] + [f"gain n={n}: all / not looping" for n in sizes]
    head += [f"TPF n={n}, not looping" for n in sizes]
    head += ["looping", "degenerate", "val loss", "distill: steps, records, prompts evaluated"]
    lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        p, d = r["pretrain"], r["distill"]
        cells = [r["size"], f"{r['parameters'] / 1e6:.3g}M", f"{r['shape']['layers']} x {r['shape']['width']}",
                 f"{p['tokens_seen'] / 1e6:.1f}M ({p['epochs']:.1f}), {p['val_loss']:.3f}"]
        cells += [_pair(r, "tokens_per_forward", n) if n in r["block_sizes"] else "-" for n in sizes]
        cells += [f"{_signed(r['gain']['tokens_per_forward'][n])} / "
                  f"{_signed(r['gain']['tokens_per_forward_not_looping'][n])}" if n in r["block_sizes"] else "-"
                  for n in sizes]
        cells += [_pair(r, "tokens_per_forward_not_looping", n) if n in r["block_sizes"] else "-" for n in sizes]
        cells += [_pair(r, "looping", percent=True), _pair(r, "degenerate", percent=True),
                  _pair(r, "val_loss", digits=3), f"{d['steps']}, {d['records']}, {d['prompts_evaluated']}"]
        lines.append("| " + " | ".join(cells) + " |")
    if table.get("stage_seconds"):
        lines += ["", "Wall seconds per stage (one run, for sizing the next; not a benchmark): "
                  + ", ".join(f"{k} {v}" for k, v in table["stage_seconds"].items()) + "."]
    return "\n".join(lines) + "\n"


def write(table: dict, out: Path) -> tuple[Path, Path]:
    out.mkdir(parents=True, exist_ok=True)
    md, js = out / f"{TABLE}.md", out / f"{TABLE}.json"
    js.write_text(json.dumps(table, indent=2) + "\n")
    md.write_text(markdown(table))
    return md, js


# ---------------------------------------------------------------------------------- command line


def _run_arg(text: str) -> tuple[str, Path]:
    name, sep, folder = text.partition("=")
    if not sep or not name or not folder:
        raise argparse.ArgumentTypeError(f"--run takes NAME=FOLDER, got {text!r}")
    return name, Path(folder)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--run", type=_run_arg, action="append", default=[], metavar="NAME=FOLDER",
                        help="one size: FOLDER holds pretrain/ and distill/ (repeat per size)")
    parser.add_argument("--merge", type=Path, nargs="+", default=[], metavar="TABLE_JSON",
                        help="join these scale_table.json files into one table instead")
    parser.add_argument("--seconds", type=Path, help="the study's stage<TAB>seconds file")
    parser.add_argument("--setting", action="append", default=[], metavar="KEY=VALUE",
                        help="a setting to name in the header (repeatable)")
    parser.add_argument("--out", type=Path, required=True, help="writes OUT/scale_table.md and .json")
    args = parser.parse_args(argv)
    if bool(args.run) == bool(args.merge):
        parser.error("give --run (one per size) or --merge, not both")
    if args.merge:
        table = merge([_json(p) for p in args.merge])
    else:
        settings = dict(s.partition("=")[::2] for s in args.setting)
        names = {name for name, _ in args.run}
        seconds = {k: v for k, v in read_seconds(args.seconds).items() if k.partition("/")[0] in names or "/" not in k}
        table = build_table([read_run(name, folder) for name, folder in args.run], machine(),
                            stage_seconds=seconds, settings=settings)
    md, js = write(table, args.out)
    print(md.read_text(), end="")
    print(f"-> {md}, {js}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
