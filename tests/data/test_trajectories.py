"""Trajectory storage: Parquet round trip, canonical order, padding layout, damage detection and
meta validation."""

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from cllm.data.trajectories import (
    SCHEMA,
    TrajectoryError,
    TrajectoryMeta,
    TrajectoryReader,
    TrajectoryRecord,
    collate,
    completed_prompt_ids,
    read_meta,
    read_shard,
    shard_name,
    write_meta,
    write_shard,
)


def meta(**overrides):
    values = dict(model="m", model_fingerprint="abc", tokenizer_fingerprint="def", block_size=4,
                  max_new_tokens=8, guess="prompt", dtype="float32", seed=0, prompts="p.jsonl",
                  prompts_fingerprint="123", text_field="prompt", augment=False, eos_token_id=2,
                  pad_token_id=0, cllm_version="0.1.0")
    values.update(overrides)
    return TrajectoryMeta(**values)


def record(prompt_index, block_index, *, n=4, labels=None):
    fixed = [10 + prompt_index + i for i in range(n)]
    guess = [5] * n
    middle = fixed[:1] + guess[1:]
    return TrajectoryRecord(
        prompt_id=f"p{prompt_index}", prompt_index=prompt_index, block_index=block_index,
        prompt_len=3, prefix_ids=[1, 2, 3] + [7] * (4 * block_index), states=[guess, middle, fixed],
        fixed_point=fixed, labels=labels, augmented_states=[fixed[:2] + guess[2:]],
    )


@pytest.fixture
def directory(tmp_path):
    write_meta(tmp_path, meta())
    # written out of order, over two "processes": readers must restore canonical order
    write_shard(tmp_path / shard_name(1, 0), [record(1, 0), record(1, 1, n=2)],
                completed_prompt_ids=["p1"])
    write_shard(tmp_path / shard_name(0, 0), [record(0, 0, labels=[4, 5, 6])],
                completed_prompt_ids=["p0", "p9"], dropped=2)
    return tmp_path


def test_records_round_trip_through_parquet_in_canonical_order(directory):
    reader = TrajectoryReader(directory)
    assert reader.meta == meta()
    assert len(reader) == 3
    assert reader.records() == [record(0, 0, labels=[4, 5, 6]), record(1, 0), record(1, 1, n=2)]
    assert completed_prompt_ids(directory) == {"p0", "p1", "p9"}  # p9: all records dropped


def test_a_record_found_in_two_shards_is_an_error(directory):
    write_shard(directory / shard_name(2, 0), [record(1, 1, n=2)], completed_prompt_ids=["p1"])
    with pytest.raises(TrajectoryError, match="prompt 'p1' block 1 is in two shards"):
        TrajectoryReader(directory).records()


def test_token_columns_are_int32_lists(directory):
    schema = pq.read_schema(directory / shard_name(0, 0))
    assert schema.field("states").type == pa.list_(pa.list_(pa.int32()))
    assert schema.field("prefix_ids").type == pa.list_(pa.int32())


def test_batch_left_pads_prefix_and_right_pads_block_so_they_concatenate(directory):
    batch = next(TrajectoryReader(directory).batches(3))
    # rows: p0 block 0 (prefix 3, n 4), p1 block 0 (prefix 3, n 4), p1 block 1 (prefix 7, n 2)
    assert batch.prefix_ids.shape == (3, 7) and batch.states.shape == (3, 3, 4)
    assert batch.prefix_ids[0].tolist() == [0, 0, 0, 0, 1, 2, 3]
    assert batch.prefix_mask[0].tolist() == [0, 0, 0, 0, 1, 1, 1]
    assert batch.fixed_point[2].tolist() == [11, 12, 0, 0]
    assert batch.block_mask[2].tolist() == [1, 1, 0, 0]
    assert batch.num_states.tolist() == [3, 3, 3]
    last = batch.states[torch.arange(3), batch.num_states - 1]
    assert torch.equal(last, batch.fixed_point)
    assert batch.labels[0].tolist() == [4, 5, 6] and batch.label_lengths.tolist() == [3, 0, 0]


def test_batch_without_references_has_no_labels():
    batch = collate([record(0, 0)], pad_id=0)
    assert batch.labels is None and batch.label_lengths is None


def test_augmented_states_go_before_the_fixed_point_when_included():
    r = record(0, 0)
    batch = collate([r], pad_id=0, include_augmented=True)
    assert batch.num_states.item() == len(r.states) + len(r.augmented_states)
    assert batch.states[0, -1].tolist() == r.fixed_point


def test_truncated_shard_is_a_clear_error(directory):
    path = directory / shard_name(1, 0)
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    with pytest.raises(TrajectoryError, match=r"damaged trajectory shard .*shard-r001-00000") as exc:
        TrajectoryReader(directory).records()
    assert "\n" not in str(exc.value)
    with pytest.raises(TrajectoryError):
        completed_prompt_ids(directory)  # resuming refuses too


def test_corrupt_bytes_in_a_shard_give_a_clear_error_never_wrong_records(directory):
    path = directory / shard_name(1, 0)
    original, expected = path.read_bytes(), read_shard(path)
    outcomes = {"error": 0, "intact": 0}
    for at in range(0, len(original), 5):  # flip one byte at a time, all over the file
        data = bytearray(original)
        data[at] ^= 0xFF
        path.write_bytes(bytes(data))
        try:
            records = read_shard(path)
        except TrajectoryError as exc:
            assert "damaged trajectory shard" in str(exc) and "\n" not in str(exc)
            outcomes["error"] += 1
            continue
        # bytes nothing depends on (e.g. column statistics) may change harmlessly
        assert records == expected, f"flipping byte {at} gave wrong records"
        outcomes["intact"] += 1
    assert outcomes["error"] > outcomes["intact"]


def test_record_breaking_invariants_is_rejected_on_write_and_read(tmp_path):
    bad = TrajectoryRecord("p", 0, 0, 1, [1], states=[[1, 2], [3, 4]], fixed_point=[3, 5])
    with pytest.raises(ValueError, match="last state"):
        write_shard(tmp_path / shard_name(0, 0), [bad], completed_prompt_ids=["p"])
    # a shard written by something else that skips the checks
    table = pa.Table.from_pylist([dict(bad.__dict__)], schema=SCHEMA).replace_schema_metadata(
        {"cllm.schema_version": "1", "cllm.completed_prompt_ids": '["p"]',
         "cllm.num_records": "1", "cllm.dropped": "0"})
    pq.write_table(table, tmp_path / shard_name(0, 1))
    with pytest.raises(TrajectoryError, match="last state is not the fixed point"):
        read_shard(tmp_path / shard_name(0, 1))


def test_meta_mismatch_lists_settings_and_ignores_informational_names():
    assert meta().mismatches(meta(model="elsewhere/m", prompts="/abs/p.jsonl")) == []
    assert meta().mismatches(meta(block_size=8, seed=1)) == ["block_size: 4 != 8", "seed: 0 != 1"]


def test_missing_or_other_schema_meta_is_refused(tmp_path):
    with pytest.raises(TrajectoryError, match="not a trajectory directory"):
        read_meta(tmp_path)
    write_meta(tmp_path, meta())
    data = json.loads((tmp_path / "meta.json").read_text())
    (tmp_path / "meta.json").write_text(json.dumps({**data, "schema_version": 99}))
    with pytest.raises(TrajectoryError, match="schema version 99"):
        read_meta(tmp_path)


def test_meta_written_before_drop_loops_existed_still_reads(tmp_path):
    write_meta(tmp_path, meta())
    data = json.loads((tmp_path / "meta.json").read_text())
    del data["drop_loops"]
    (tmp_path / "meta.json").write_text(json.dumps(data))
    assert read_meta(tmp_path) == meta()  # off, as it was
    del data["seed"]  # a field without a default is still required
    (tmp_path / "meta.json").write_text(json.dumps(data))
    with pytest.raises(TrajectoryError, match="missing keys"):
        read_meta(tmp_path)


def test_reader_refuses_settings_other_than_expected(directory):
    with pytest.raises(TrajectoryError, match="block_size=4, expected 16"):
        TrajectoryReader(directory, expect={"block_size": 16})
