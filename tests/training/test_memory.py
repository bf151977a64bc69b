"""`cllm.training.memory`: parameter counts against the published ones and transformers', bytes against
hand-computed values, and docs/scale.md's tables against the code that prints them."""

import subprocess
import sys
from pathlib import Path

import pytest
from peft import LoraConfig, get_peft_model
from transformers import LlamaConfig, LlamaForCausalLM

from cllm.profiling.steptime import parameter_count, shape_config
from cllm.training.memory import SHAPES, Shape, activation_bytes, logit_bytes, tables, training_memory

DOCS = Path(__file__).parents[2] / "docs" / "scale.md"


def test_parameter_counts_are_the_published_ones():
    # Llama-3.2-1B, Llama-3.2-3B, Llama-2-7B, Llama-2-13B
    published = {"1B": 1_235_814_400, "3B": 3_212_749_824, "7B": 6_738_415_616, "13B": 13_015_864_320}
    assert {name: shape.params() for name, shape in SHAPES.items()} == published


@pytest.mark.parametrize("size", ["1b", "3b", "7b", "13b"])
def test_parameter_count_equals_transformers_on_the_same_shape(size):
    assert SHAPES[size.upper()].params() == parameter_count(shape_config(size))


def test_lora_count_equals_peft_all_linear_with_grouped_query_attention():
    shape = Shape("tiny", layers=2, hidden=64, intermediate=96, heads=8, kv_heads=2, vocab=50, tied=False)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=50, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                         num_attention_heads=8, num_key_value_heads=2))
    assert shape.params() == sum(p.numel() for p in model.parameters())
    peft = get_peft_model(model, LoraConfig(r=4, target_modules="all-linear", task_type="CAUSAL_LM"))
    assert shape.lora_params(4) == sum(p.numel() for p in peft.parameters() if p.requires_grad)
    # Llama-2-7B, r = 16: 32 layers x 16 x (q, o: 2 x 8192 + k, v: 2 x 8192 + gate, up, down: 3 x 15104)
    assert SHAPES["7B"].lora_params(16) == 32 * 16 * 78_080 == 39_976_960


def test_state_bytes_per_parameter_by_setup():
    p, t = 10**9, 10**7
    assert training_memory(p, "ddp", bf16=False) == training_memory(p, "ddp", bf16=False, processes=8)
    assert training_memory(p, "ddp", bf16=False).total == 16e9  # 4 + 4 + 8
    assert training_memory(p, "ddp").total == 18e9  # + autocast's bf16 copies
    assert training_memory(p, "fsdp", processes=8).total == 2e9  # 16 / 8
    assert training_memory(p, "zero2", processes=8).total == 2e9 + 14e9 / 8
    assert training_memory(p, "zero3", processes=8).total == 2e9
    lora = training_memory(p, "lora", trainable=t)
    assert (lora.weights, lora.grads, lora.optimizer) == (6e9 + 4e7, 4e7, 8e7)
    assert training_memory(p, "qlora", trainable=t).total == pytest.approx(0.516e9 + 16e7)
    with pytest.raises(ValueError, match="trainable"):
        training_memory(p, "lora")


def test_activation_and_logit_bytes_of_7b_per_1024_tokens():
    shape, tokens = SHAPES["7B"], 1024
    assert activation_bytes(shape, tokens, checkpointing=False) == 32 * 34 * 4096 * 1024
    assert activation_bytes(shape, tokens, checkpointing=True) == 32 * 2 * 4096 * 1024 + 34 * 4096 * 1024
    assert logit_bytes(shape, tokens) == 16 * 32000 * 1024


def test_docs_scale_tables_are_the_ones_the_code_prints():
    assert tables() in DOCS.read_text(), "regenerate with: python -m cllm.training.memory"


def test_memory_module_imports_no_torch():
    code = "import sys, cllm.training.memory; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
