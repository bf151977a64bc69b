"""Names the commands' configs share with the modeling code: the files Medusa heads and an EAGLE
head are saved as, and the distances consistency training measures. No torch, so that a
config names them without loading the modules that use them (`heads`, `eagle`, `losses`)."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

Distance = Literal["fkl", "rkl", "jsd", "argmax"]

# Medusa heads (`heads`), in a checkpoint's medusa/ folder
MEDUSA_DIR = Path("medusa")  # relative to a checkpoint directory
MEDUSA_CONFIG_FILE = "medusa_config.json"
MEDUSA_WEIGHTS_FILE = "medusa_heads.safetensors"

# an EAGLE head (`eagle`), in a checkpoint's eagle/ folder
EAGLE_DIR = Path("eagle")  # relative to a checkpoint directory
EAGLE_CONFIG_FILE = "eagle_config.json"
EAGLE_WEIGHTS_FILE = "eagle_head.safetensors"
EAGLE_DRAFT_CONFIG_FILE = "config.json"  # the layer as a one-layer Llama (EAGLE-1 / vLLM layout)
