"""`cllm import`'s settings (`ImportConfig`): a GGUF file in, a checkpoint folder out. No torch
here: `cllm import --help` reads this before anything heavy loads."""

from __future__ import annotations

from dataclasses import dataclass, field

from cllm.core.errors import UserError
from cllm.core.options import MODEL_DATA, RUN, Dtype, Force


@dataclass
class ImportConfig(Force, Dtype):
    """`cllm import FILE.gguf --out DIR`: the GGUF's weights dequantized into a checkpoint folder
    (safetensors, config, generation config, tokenizer with the GGUF's chat template) that the
    torch runtimes and training load. Options: the input file, the folder, and the groups'
    --dtype (of the written weights) and --force (replace a folder an earlier import wrote, or
    write into one holding other files)."""

    file: str | None = field(default=None, metadata={"positional": True, "metavar": "FILE.gguf",
        "section": MODEL_DATA, "help": "the GGUF file to import: any quantization transformers "
        "dequantizes; needs the gguf package (default: none, it is required)"})
    out: str | None = field(default=None, metadata={"section": RUN, "help": "the checkpoint folder to write: a new "
        "or empty one, or --force (default: none, it is required)"})

    def __post_init__(self) -> None:
        super().__post_init__()
        if not self.file:
            raise UserError("the GGUF file to import is required: cllm import FILE.gguf --out DIR")
        if not self.out:
            raise UserError("--out DIR is required: the checkpoint folder to write")
