"""Our vLLM proposer's logic without vLLM: a fake of what vLLM passes (its config, each step's
kept tokens, the batch's token table, rows that move between steps), the drafts compared with
what the engine's own drafters chain; the Jacobi tail's hook on a stand-in model; the
environment and the server command vLLM is started with. The end-to-end runs are in
test_vllm_engine.py (marker `vllm`, in .venv-vllm)."""

import importlib
import json
import sys
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from cllm.cli import main
from cllm.core.errors import UserError
from cllm.decoding import RECOMMENDED_CONFIG
from cllm.decoding.draft_table import DraftTable
from cllm.decoding.jacobi.drafters import DraftContext, Drafters, PoolDrafter, TableDrafter, chained
from cllm.models import DRAFT_TABLE, SHIPPED, load_draft_table
from cllm.serving import vllm as engine
from cllm.serving import vllm_serve
from cllm.serving.config import ServeConfig
from cllm.serving.vllm import (
    CllmJacobiProposer,
    CllmProposer,
    engine_environment,
    jacobi_tail,
    speculative_config,
    vllm_drafters,
)

MAX_LEN = 64
TABLE = DraftTable(orders=(2,), next_token={(1, 2): 3, (2, 3): 4, (3, 4): 5, (4, 5): 6, (7, 7): 1, (7, 1): 2})


@pytest.fixture
def model_dir(tmp_path):
    """A folder vLLM could be given: a config and the draft table `cllm drafts` writes."""
    (tmp_path / "config.json").write_text(json.dumps({"max_position_embeddings": MAX_LEN}))
    TABLE.save(tmp_path / DRAFT_TABLE)
    return tmp_path


def vllm_config(model, k=8, max_model_len=MAX_LEN):
    """What vLLM hands a `custom_class` proposer (the fields it reads)."""
    return SimpleNamespace(speculative_config=SimpleNamespace(num_speculative_tokens=k),
                           model_config=SimpleNamespace(model=str(model), max_model_len=max_model_len))


class Batch:
    """vLLM's view of a batch: a token table (rows x max_model_len) and each row's length."""

    def __init__(self, rows):
        self.token_ids = np.zeros((8, MAX_LEN), dtype=np.int32)
        self.lengths = np.zeros(8, dtype=np.int32)
        for i, row in enumerate(rows):
            self.token_ids[i, : len(row)] = row
            self.lengths[i] = len(row)

    def propose(self, proposer, sampled):
        return proposer.propose(sampled, self.lengths, self.token_ids, slot_mappings=None)


def engine_chain(history, width, table=TABLE, tail=()):
    """The draft our engine's drafters chain for `history`: pool, then table (then the tail, if any)."""
    return chained(vllm_drafters(table, jacobi_tail=bool(tail)), DraftContext(list(history), carried=tail), width)[0]


def test_the_chain_is_made_of_the_engines_own_drafters():
    chain = vllm_drafters(TABLE)
    pool, table = chain
    engine_tree = Drafters.from_settings(RECOMMENDED_CONFIG, TABLE, sampling=False).tree
    assert isinstance(pool, PoolDrafter) and pool.min_ngram == engine_tree[0].min_ngram  # the engine's recycling pool
    assert isinstance(table, TableDrafter) and table.table is TABLE
    assert [type(d).__name__ for d in vllm_drafters(TABLE, jacobi_tail=True)] == ["PoolDrafter", "TableDrafter",
                                                                                 "CarriedDrafts"]
    assert vllm_drafters(None) == (pool,)


def test_each_row_drafts_what_the_engines_drafters_chain(model_dir):
    proposer = CllmProposer(vllm_config(model_dir, k=6))
    rows = [[9, 1, 2],  # the table alone: 3 4 5 6
            [5, 6, 8, 9, 5, 6],  # the pool: (5, 6) was followed by 8 9 (a 2-token match drafts k // 2)
            [4, 4, 4, 1, 2]]  # no 2-token match in the pool: the table
    drafts = Batch(rows).propose(proposer, [[r[-1]] for r in rows])
    assert drafts == [engine_chain(r, 6) for r in rows]
    assert drafts[0] == [3, 4, 5, 6] and drafts[1][:2] == [8, 9]
    assert all(len(d) <= 6 for d in drafts)


def test_the_shipped_models_table_drafts_through_the_proposer():
    model = SHIPPED["stdlib-coder"]
    if not (model / DRAFT_TABLE).is_file():
        pytest.skip("the shipped model has no draft table")
    table = load_draft_table(model)
    proposer = CllmProposer(vllm_config(model, k=8, max_model_len=512))
    history = [int(t) for t in torch.randint(1, 8000, (40,), generator=torch.Generator().manual_seed(0))]
    history += history[10:14]  # a repeat: the pool has a match
    assert Batch([history]).propose(proposer, [[history[-1]]]) == [engine_chain(history, 8, table)]


def test_drafts_stop_at_k_and_at_the_models_length(model_dir):
    proposer = CllmProposer(vllm_config(model_dir, k=2))
    assert Batch([[9, 1, 2]]).propose(proposer, [[2]]) == [[3, 4]]
    short = CllmProposer(vllm_config(model_dir, k=8, max_model_len=5))
    assert Batch([[9, 1, 2]]).propose(short, [[2]]) == [[3, 4]]  # 3 tokens + 2 drafts = the model's 5 positions
    assert Batch([[8, 9, 1, 1, 2]]).propose(short, [[2]]) == [[]]


def test_rows_mid_prefill_or_laid_out_otherwise_get_no_draft(model_dir):
    proposer = CllmProposer(vllm_config(model_dir))
    assert Batch([[9, 1, 2], [9, 1, 2]]).propose(proposer, [[], [2]]) == [[], [3, 4, 5, 6]]
    assert Batch([[9, 1, 2]]).propose(proposer, [[7]]) == [[]]  # the kept token is not the row's last: no guessing
    assert proposer.counts["rows_skipped"] == 1


def test_a_row_whose_drafting_fails_drafts_nothing_and_its_neighbours_still_draft(model_dir, monkeypatch):
    proposer = CllmProposer(vllm_config(model_dir))
    draft = proposer.draft
    monkeypatch.setattr(proposer, "draft", lambda history, tail=(): 1 / 0 if history[0] == 8 else draft(history, tail))
    assert Batch([[8, 1, 2], [9, 1, 2]]).propose(proposer, [[2], [2]]) == [[], [3, 4, 5, 6]]
    assert proposer.counts["rows_failed"] == 1


def test_the_jacobi_tail_is_the_targets_predictions_after_the_first_rejected_draft():
    # drafted 3 4 5 6; the target predicted 3 4 9 1 2 (after the context, +3, +3 4, +3 4 5, +3 4 5 6)
    assert jacobi_tail([3, 4, 9, 1, 2], [3, 4, 5, 6], [3, 4, 9]) == [1, 2]
    assert jacobi_tail([3, 4, 5, 6, 7], [3, 4, 5, 6], [3, 4, 5, 6, 7]) == []  # every draft accepted
    assert jacobi_tail([8, 4, 5], [3, 4], [8]) == [4, 5]
    assert jacobi_tail([3, 4, 9, 1, 2], [3, 4, 5, 6], [3, 4, 7]) == []  # sampled, not argmax: no tail
    assert jacobi_tail([3, 4], [3, 4, 5, 6], [3]) == []  # not this row's run


def forward(proposer, predicted):
    """What the hook sees when vLLM's verifying forward computes its logits: one row per
    verified position, the argmax at `predicted`."""
    logits = torch.zeros(len(predicted), 20)
    logits[torch.arange(len(predicted)), torch.tensor(predicted)] = 1.0
    proposer._capture(None, (), logits)


def test_rows_that_move_between_steps_keep_their_jacobi_tail(model_dir):
    proposer = CllmJacobiProposer(vllm_config(model_dir, k=4))
    a, b = [9, 1, 2], [7, 7]
    first = Batch([a, b]).propose(proposer, [[2], [7]])
    assert first == [[3, 4, 5, 6], [1, 2, 3, 4]]
    # vLLM condensed its batch: b is row 0 now. Its forward verified b's drafts (4 + 1
    # positions), then a's: b kept 1 (rejected 2: predicted 9 instead), a kept 3 4 then 8
    forward(proposer, [1, 9, 10, 11, 12] + [3, 4, 8, 13, 14])
    b2, a2 = b + [1, 9], a + [3, 4, 8]
    second = Batch([b2, a2]).propose(proposer, [[1, 9], [3, 4, 8]])
    assert second[0][:3] == [10, 11, 12] and second[1][:2] == [13, 14]  # no n-gram or table draft: each row's tail
    assert second == [engine_chain(b2, 4, tail=[10, 11, 12]), engine_chain(a2, 4, tail=[13, 14])]
    assert proposer.counts["jacobi"] == 5


def test_the_tail_fills_what_the_n_grams_and_the_table_leave_at_its_own_positions(model_dir):
    proposer = CllmJacobiProposer(vllm_config(model_dir, k=6))
    assert proposer.draft([9, 1, 2], [20, 21, 22, 23, 24, 25]) == [3, 4, 5, 6, 24, 25]  # the table's 4, then the tail
    assert proposer.draft([8, 8], [20, 21]) == [20, 21]
    assert proposer.counts == {"table": 4, "jacobi": 4}


def test_a_forward_that_does_not_add_up_drops_the_tails_not_the_drafts(model_dir):
    proposer = CllmJacobiProposer(vllm_config(model_dir, k=4))
    Batch([[9, 1, 2]]).propose(proposer, [[2]])
    forward(proposer, [3, 4, 8, 13])  # 4 positions for a draft of 4 (5 expected): vLLM trimmed it
    assert Batch([[9, 1, 2, 3, 4, 8]]).propose(proposer, [[3, 4, 8]]) == [engine_chain([9, 1, 2, 3, 4, 8], 4)]
    assert proposer.counts["tails_skipped"] == 1


class StandIn(torch.nn.Module):
    """A model with vLLM's shape where the tail looks: a `logits_processor` module."""

    def __init__(self, processor=True):
        super().__init__()
        if processor:
            self.logits_processor = torch.nn.Identity()


def test_the_tails_hook_is_checked_against_the_vllm_release(model_dir, monkeypatch):
    proposer = CllmJacobiProposer(vllm_config(model_dir))
    monkeypatch.setitem(sys.modules, "vllm", SimpleNamespace(__version__="0.33.0"))
    with pytest.raises(UserError, match="vLLM 0.32.x internals.*this is vLLM 0.33.0"):
        proposer.load_model(StandIn())
    monkeypatch.setitem(sys.modules, "vllm", SimpleNamespace(__version__="0.32.0"))
    with pytest.raises(UserError, match="logits_processor"):
        proposer.load_model(StandIn(processor=False))
    model = StandIn()
    proposer.load_model(model)
    model.logits_processor(torch.eye(3)[[2, 0]])
    assert proposer._predicted.tolist() == [2, 0]
    CllmProposer(vllm_config(model_dir)).load_model(StandIn(processor=False))  # no tail: nothing hooked


def test_speculative_config_names_a_class_vllm_can_import(model_dir):
    config = speculative_config(model_dir)
    assert config == {"method": "custom_class", "model": "cllm.serving.vllm.CllmProposer", "num_speculative_tokens": 8}
    module, name = config["model"].rsplit(".", 1)  # as vLLM loads it
    assert getattr(importlib.import_module(module), name) is CllmProposer
    tail = speculative_config(model_dir, jacobi_tail=True, num_speculative_tokens=16)
    assert tail["model"].endswith(".CllmJacobiProposer") and tail["num_speculative_tokens"] == 16
    (model_dir / DRAFT_TABLE).write_bytes(b"not a table")
    with pytest.raises(UserError, match="cannot read draft table"):
        speculative_config(model_dir)


def test_the_cpu_environment_binds_threads_preloads_and_keeps_the_users_settings(monkeypatch):
    monkeypatch.setattr(engine, "tcmalloc", lambda: "libtcmalloc_minimal.so.4")
    cores = sorted(engine.os.sched_getaffinity(0))
    env, notes = engine_environment(1, environ={"LD_PRELOAD": "/x/libfoo.so"}, cuda=False)
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == str(cores[0]) and env["VLLM_CPU_NUM_OF_RESERVED_CPU"] == "0"
    assert env["VLLM_CPU_KVCACHE_SPACE"] == "1" and notes == []
    assert env["LD_PRELOAD"].split(":")[:2] == ["/x/libfoo.so", "libtcmalloc_minimal.so.4"]
    mine, _ = engine_environment(0, environ={"VLLM_CPU_KVCACHE_SPACE": "8", "VLLM_CPU_OMP_THREADS_BIND": "3"},
                                 cuda=False)
    assert mine["VLLM_CPU_KVCACHE_SPACE"] == "8" and mine["VLLM_CPU_OMP_THREADS_BIND"] == "3"
    assert engine_environment(0, environ={"A": "b"}, cuda=True) == ({"A": "b"}, [])
    monkeypatch.setattr(engine, "tcmalloc", lambda: None)
    _, notes = engine_environment(0, environ={}, cuda=False)
    assert any("libtcmalloc-minimal4" in n for n in notes)


def test_serve_maps_its_settings_onto_vllms_server(model_dir, monkeypatch):
    monkeypatch.setattr(engine, "vllm_installed", lambda: True)
    config = ServeConfig(model=str(model_dir), engine="vllm", port=8123, max_batch_size=16, api_key="sekret",
                         speculative_tokens=4, tensor_parallel_size=2, request_timeout=5.0)
    cmd, env, notes = vllm_serve.vllm_server(config)
    flags = dict(zip(cmd[3::2], cmd[4::2], strict=False))
    assert cmd[1:3] == ["-m", "vllm.entrypoints.openai.api_server"]
    assert flags["--host"] == "127.0.0.1" and flags["--port"] == "8123" and flags["--max-num-seqs"] == "16"
    assert flags["--max-model-len"] == str(MAX_LEN) and flags["--tensor-parallel-size"] == "2"
    assert json.loads(flags["--speculative-config"]) == speculative_config(model_dir, num_speculative_tokens=4)
    assert json.loads(flags["--override-generation-config"]) == {"max_new_tokens": 128}
    assert "sekret" not in " ".join(cmd) and env["VLLM_API_KEY"] == "sekret"
    assert notes[-1] == "not applied by vLLM's server: --request-timeout"
    plain = vllm_serve.vllm_server(ServeConfig(model=str(model_dir), engine="vllm", speculation="none"))[0]
    assert "--speculative-config" not in plain


def test_serve_engine_vllm_refuses_in_one_line_without_vllm(monkeypatch, capsys):
    monkeypatch.setattr(engine, "vllm_installed", lambda: False)
    assert main(["serve", "--engine", "vllm"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "make vllm" in err and "pip install 'cllm[vllm]'" in err
    with pytest.raises(ValueError, match="--tensor-parallel-size needs --engine vllm"):
        ServeConfig(tensor_parallel_size=2)
