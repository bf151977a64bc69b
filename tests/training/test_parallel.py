"""`cllm.training.distributed` and the shipped accelerate configs (examples/accelerate/): the options each
engine allows, the mixed precision accelerate is told, the DeepSpeed values train fills in. FSDP
and DeepSpeed need GPUs, so their configs are parsed and checked here, not run; DDP runs in
tests/training/test_train.py and tests/training/test_collect.py (2 gloo CPU processes)."""

import json
import pickle
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import transformers
from accelerate.commands.config.config_args import load_config_from_file
from accelerate.utils import DeepSpeedPlugin, DistributedType
from accelerate.utils.dataclasses import get_module_class_from_name

from cllm.core.errors import UserError
from cllm.training import distributed as parallel
from cllm.training.distributed import (
    Engine,
    check_engine,
    check_state_files,
    engine_of,
    fill_deepspeed_config,
    load_accelerate_state,
    mixed_precision,
)
from cllm.training.train import TrainConfig, train

ROOT = Path(__file__).parents[2]
EXAMPLES = ROOT / "examples" / "accelerate"
CONFIGS = {"ddp.yaml": DistributedType.MULTI_GPU, "fsdp.yaml": DistributedType.FSDP,
           "deepspeed_zero2.yaml": DistributedType.DEEPSPEED, "deepspeed_zero3.yaml": DistributedType.DEEPSPEED}


def launch_env(cfg) -> dict[str, str]:
    """The variables `accelerate launch` sets from a config that cllm.training.distributed reads."""
    return {"ACCELERATE_MIXED_PRECISION": cfg.mixed_precision or "no",
            "ACCELERATE_USE_FSDP": str(cfg.distributed_type == DistributedType.FSDP).lower(),
            "ACCELERATE_USE_DEEPSPEED": str(cfg.distributed_type == DistributedType.DEEPSPEED).lower()}


# ------------------------------------------------------------------------------------------
# The rules


@pytest.mark.parametrize("dtype, env, expected", [
    ("float32", {}, "no"),
    ("bfloat16", {}, "no"),  # one process: train's own autocast
    ("bfloat16", {"ACCELERATE_MIXED_PRECISION": "bf16"}, "no"),  # DDP: the same
    ("bfloat16", {"ACCELERATE_MIXED_PRECISION": "no"}, "no"),
    ("bfloat16", {"ACCELERATE_MIXED_PRECISION": "bf16", "ACCELERATE_USE_FSDP": "true"}, "bf16"),
    ("bfloat16", {"ACCELERATE_MIXED_PRECISION": "no", "ACCELERATE_USE_DEEPSPEED": "true"}, "bf16"),
    ("float32", {"ACCELERATE_MIXED_PRECISION": "no", "ACCELERATE_USE_FSDP": "true"}, "no"),
])
def test_accelerate_mixed_precision_follows_dtype_under_fsdp_and_deepspeed_only(dtype, env, expected):
    assert mixed_precision(dtype, env) == expected


@pytest.mark.parametrize("dtype, launched", [("float32", "bf16"), ("bfloat16", "fp16"), ("float32", "fp8")])
def test_a_launch_config_asking_another_precision_than_dtype_is_refused(dtype, launched):
    with pytest.raises(UserError, match=f"mixed precision '{launched}'"):
        mixed_precision(dtype, {"ACCELERATE_MIXED_PRECISION": launched})


def test_engine_of_reads_accelerates_distributed_type():
    def fake(kind, processes=8, stage=None):
        return SimpleNamespace(distributed_type=kind, num_processes=processes,
                               state=SimpleNamespace(deepspeed_plugin=SimpleNamespace(zero_stage=stage)))

    assert engine_of(fake(DistributedType.NO, 1)) == Engine("single")
    assert engine_of(fake(DistributedType.MULTI_CPU, 2)) == Engine("ddp")
    assert engine_of(fake(DistributedType.MULTI_GPU)) == Engine("ddp")
    assert engine_of(fake(DistributedType.FSDP)) == Engine("fsdp", accelerate_checkpoints=True)
    zero2 = engine_of(fake(DistributedType.DEEPSPEED, stage=2))
    zero3 = engine_of(fake(DistributedType.DEEPSPEED, stage=3))
    assert zero2.accelerate_checkpoints and not zero2.splits_weights
    assert zero3.splits_weights and zero3.label == "DeepSpeed ZeRO-3"


@pytest.mark.parametrize("option, message", [
    (dict(eval_count=16), "--eval-count 0"),
    (dict(lora=True), "no --lora"),
    (dict(model_rollouts=True), "no --rollout-prompts"),
])
def test_engines_that_split_the_weights_refuse_what_decodes_on_one_process(option, message):
    options = {"eval_count": 0, "lora": False, "model_rollouts": False, **option}
    for engine in (Engine("fsdp", accelerate_checkpoints=True), Engine("deepspeed", 3, accelerate_checkpoints=True)):
        with pytest.raises(UserError, match=message):
            check_engine(engine, **options)
    for engine in (Engine("single"), Engine("ddp"), Engine("deepspeed", 2, accelerate_checkpoints=True)):
        check_engine(engine, **options)  # every process holds the whole model


def test_train_refuses_evaluation_under_fsdp_before_loading_anything(tmp_path, monkeypatch):
    monkeypatch.setattr(parallel, "engine_of", lambda accelerator: Engine("fsdp", accelerate_checkpoints=True))
    with pytest.raises(UserError, match="under FSDP every process holds only a part"):
        train(TrainConfig(data=str(tmp_path / "missing"), out=str(tmp_path / "out"), eval_count=4))
    assert not (tmp_path / "out").exists()


def test_deepspeed_values_train_decides_are_filled_where_auto_and_refused_where_they_disagree():
    ds = {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": 2}
    fill_deepspeed_config(ds, micro_batch=4, accumulation=2, grad_clip=1.0)
    assert ds == {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2, "gradient_clipping": 1.0}
    with pytest.raises(UserError, match="gradient_accumulation_steps = 2 where cllm train needs 4"):
        fill_deepspeed_config({"gradient_accumulation_steps": 2}, micro_batch=4, accumulation=4, grad_clip=1.0)
    with pytest.raises(UserError, match="optimizer"):
        fill_deepspeed_config({"optimizer": {"type": "AdamW"}}, micro_batch=4, accumulation=1, grad_clip=1.0)


# ------------------------------------------------------------------------------------------
# The shipped configs


@pytest.mark.parametrize("name", CONFIGS)
def test_example_config_parses_and_its_mixed_precision_agrees_with_dtype_bfloat16(name):
    cfg = load_config_from_file(str(EXAMPLES / name))  # accelerate's own reader: unknown keys fail
    assert cfg.distributed_type == CONFIGS[name]
    assert cfg.num_machines == 1 and isinstance(cfg.num_processes, int) and cfg.num_processes >= 1
    assert not cfg.use_cpu
    env = launch_env(cfg)
    sharded = cfg.distributed_type != DistributedType.MULTI_GPU
    assert mixed_precision("bfloat16", env) == ("bf16" if sharded else "no")
    if cfg.mixed_precision not in (None, "no"):  # a config that says bf16 refuses --dtype float32
        with pytest.raises(UserError, match="pass --dtype bfloat16"):
            mixed_precision("float32", env)


def test_fsdp_config_shards_fully_and_wraps_llama_decoder_layers():
    fsdp = load_config_from_file(str(EXAMPLES / "fsdp.yaml")).fsdp_config
    assert fsdp["fsdp_sharding_strategy"] == "FULL_SHARD"
    assert fsdp["fsdp_auto_wrap_policy"] == "TRANSFORMER_BASED_WRAP"
    # found by name in the model, as accelerate's auto-wrap policy finds it
    tiny = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2))
    assert get_module_class_from_name(tiny, fsdp["fsdp_transformer_layer_cls_to_wrap"]) is not None
    assert fsdp["fsdp_use_orig_params"] is True  # the optimizer is built before wrapping
    assert fsdp["fsdp_cpu_ram_efficient_loading"] is False  # train loads the model on every process
    assert fsdp["fsdp_state_dict_type"] in ("SHARDED_STATE_DICT", "FULL_STATE_DICT")


@pytest.mark.parametrize("name, stage", [("deepspeed_zero2.yaml", 2), ("deepspeed_zero3.yaml", 3)])
def test_deepspeed_configs_leave_to_train_what_train_decides(name, stage):
    cfg = load_config_from_file(str(EXAMPLES / name))
    path = ROOT / cfg.deepspeed_config["deepspeed_config_file"]  # relative to the repository root
    # accelerate refuses mixed_precision beside a deepspeed_config_file: bf16 comes from --dtype
    assert cfg.mixed_precision is None
    raw = json.loads(path.read_text())
    assert raw["bf16"]["enabled"] == "auto" and "fp16" not in raw
    plugin = DeepSpeedPlugin(hf_ds_config=str(path))  # parses without deepspeed installed
    assert plugin.zero_stage == stage
    ds = plugin.deepspeed_config
    fill_deepspeed_config(ds, micro_batch=2, accumulation=4, grad_clip=0.5)
    assert (ds["train_micro_batch_size_per_gpu"], ds["gradient_accumulation_steps"],
            ds["gradient_clipping"]) == (2, 4, 0.5)
    plugin.set_mixed_precision("bf16")  # what Accelerator does with --dtype bfloat16
    assert ds["bf16"]["enabled"] is True
    if stage == 3:  # the export gathers the weights (accelerator.get_state_dict)
        assert ds["zero_optimization"]["stage3_gather_16bit_weights_on_model_save"] is True


def test_accelerate_state_resumes_only_with_its_folder_and_process_count(tmp_path):
    loaded = []
    accelerator = SimpleNamespace(num_processes=2, load_state=loaded.append)
    meta = {"accelerate_state": "state-00000005", "processes": 2}
    with pytest.raises(UserError, match="another engine"):
        load_accelerate_state(accelerator, tmp_path, meta)
    (tmp_path / "state-00000005").mkdir()
    with pytest.raises(UserError, match="checkpointed by 2 processes"):
        load_accelerate_state(SimpleNamespace(num_processes=4, load_state=loaded.append), tmp_path, meta)
    load_accelerate_state(accelerator, tmp_path, meta)
    assert loaded == [str(tmp_path / "state-00000005")]


def test_an_accelerate_state_folder_is_read_with_no_code_run_before_accelerate_loads_it(tmp_path):
    import torch.distributed.checkpoint as dcp

    from tests.training.test_train import Planted

    folder = tmp_path / "state-00000003"
    folder.mkdir()
    torch.save({"base_lrs": [0.1], "last_epoch": 3}, folder / "custom_checkpoint_0.pkl")
    with pytest.warns(UserWarning):  # one process, no process group: dcp says it saves alone
        dcp.save({"w": torch.ones(2, 3), "step": torch.tensor(3)}, checkpoint_id=str(folder / "model"))
    check_state_files(folder)  # what accelerate and torch.distributed.checkpoint write
    ran = tmp_path / "ran"
    torch.save(Planted(ran), folder / "custom_checkpoint_0.pkl")
    with pytest.raises(UserError, match="custom_checkpoint_0.pkl is not a checkpoint file"):
        check_state_files(folder)
    torch.save({"base_lrs": [0.1]}, folder / "custom_checkpoint_0.pkl")
    with open(folder / "model" / ".metadata", "wb") as fh:  # a plain pickle, read by pickle.load
        pickle.dump(Planted(ran), fh)
    with pytest.raises(UserError, match="not part of a checkpoint's metadata"):
        check_state_files(folder)
    assert not ran.exists()
