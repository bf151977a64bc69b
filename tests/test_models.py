"""Model/tokenizer loading: local checkpoints, clear errors, fingerprints."""

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from cllm.config import UserError
from cllm.models import fingerprint, load_model, resolve_dtype


def tiny_llama(seed=0):
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64)
    return LlamaForCausalLM(cfg)


def test_load_model_from_local_dir_in_eval_mode_and_dtype(tmp_path):
    tiny_llama().save_pretrained(tmp_path / "m")
    model = load_model(tmp_path / "m", dtype="bfloat16")
    assert not model.training
    assert next(model.parameters()).dtype == torch.bfloat16


def test_missing_dir_and_non_checkpoint_dir_are_user_errors(tmp_path):
    with pytest.raises(UserError, match="not found"):
        load_model(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(UserError, match="no config.json"):
        load_model(tmp_path / "empty")


def test_unknown_dtype_is_user_error():
    with pytest.raises(UserError, match="unknown dtype"):
        resolve_dtype("float8")


def test_fingerprint_tells_models_apart_and_is_stable(tmp_path):
    tiny_llama(0).save_pretrained(tmp_path / "a")
    tiny_llama(1).save_pretrained(tmp_path / "b")
    assert fingerprint(tmp_path / "a") == fingerprint(tmp_path / "a")
    assert fingerprint(tmp_path / "a") != fingerprint(tmp_path / "b")
    assert fingerprint(tiny_llama(0)) != fingerprint(tiny_llama(1))
