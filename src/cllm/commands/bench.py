"""`cllm bench`: every decoding method on the same prompts, in one run: speed and quality.

The measuring is `cllm.bench` (the methods: `cllm.bench.config`; the run: `cllm.bench.run`);
this module loads the models, runs it (recording into OUT/progress.jsonl as it goes, resuming
from it), writes the report folder and prints the methods table and the run's notes.
"""

from __future__ import annotations

from pathlib import Path

from rich.console import Console
from transformers.utils import logging as hf_logging

from cllm.bench.config import BenchConfig as Config
from cllm.bench.log import PROGRESS
from cllm.bench.models import load_models
from cllm.bench.report import results_renderables
from cllm.bench.run import check_out_is_bench_folder, raise_on_violations, run_bench, write_report
from cllm.core.config import write_config
from cllm.core.progress import Progress


def run(config: Config) -> int:
    """Load, measure, write the report folder, print the table; an exactness violation (float32)
    raises `ExactnessError` once the report is written."""
    hf_logging.disable_progress_bar()  # one progress display: ours
    check_out_is_bench_folder(config)
    console = Console(highlight=False)
    progress = Progress(console)
    progress.line(f"loading {config.target}" + (f" and {config.cllm}" if config.cllm else ""))
    models = load_models(config)
    try:
        result = run_bench(config, models, progress=progress, log=True)
    except KeyboardInterrupt:
        console.print(f"\ninterrupted: what was measured is kept in {Path(config.out) / PROGRESS}; "
                      "the same command resumes from it")
        raise
    out = write_report(result, config.out, models.tokenizer, json_path=config.json)
    write_config(config, out / "config.json")
    for item in results_renderables(result.data, console.width):
        console.print(item)
    console.print(f"report: [bold]{out}[/] (bench.json, report.md, *.png, trajectory.html)")
    raise_on_violations(result)
    return 0
