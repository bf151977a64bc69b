"""The llama.cpp runtime. Without llama.cpp (`make test`): how a fed tree becomes sequences (each
token in the sequences of the leaves below it, the first leaf's path in the row's own). With it
(marked `llamacpp`, `make test-llamacpp`): on the shipped target and CLLM exported to GGUF, f32
and q8_0, our greedy decoding and the engine (block sizes 1-32, recycling trees, the draft table,
blocks in flight, EOS inside a block) give exactly llama.cpp's own greedy tokens
(`llama_cpp.Llama.generate`, top_k=1) on the same file; the sequences hold exactly the kept
entries after every verb; the refusals are one line. The decoding suites run on this runtime too
(tests/decoding, the "@llamacpp" paths).
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from cllm.data.prompts import encode_prompts
from cllm.decoding import RECOMMENDED, greedy_decode, jacobi_decode
from cllm.decoding.sampling import sample_decode
from cllm.models import load_draft_table, load_model, load_tokenizer
from cllm.runtime.llamacpp import _tree
from tests.chisquare import chi_square
from tests.decoding.conftest import byte_tokenizer
from tests.decoding.law import exact_joint_law

NEW_TOKENS = 64


def test_a_tree_becomes_one_sequence_per_leaf_each_token_in_those_below_it():
    # 0 -> 1 -> 2, 0 -> 3, 4 (a second root); leaves 2, 3, 4
    tree = _tree([-1, 0, 1, 0, -1], 5)
    assert tree.depth == [0, 1, 2, 1, 0]
    assert tree.leaves == [2, 3, 4]
    assert tree.below == [[0, 1], [0], [0], [1], [2]]  # indices into the leaves, the first leaf first
    chain = _tree([-1, 0, 1], 3)
    assert chain.leaves == [2] and chain.below == [[0], [0], [0]]
    with pytest.raises(ValueError):
        _tree([-1, 2, 0], 3)  # a parent after its child
    with pytest.raises(ValueError):
        _tree([-1, 0], 3)


# ---------------------------------------------------------------------------- with llama.cpp


@pytest.fixture(scope="module")
def shipped(tmp_path_factory):
    """(role, type) -> (GGUF path, tokenizer, draft table) for the shipped target and CLLM, f32
    and q8_0 (llama.cpp's quantizer)."""
    from cllm.runtime.gguf import write_gguf
    from cllm.runtime.llamacpp_files import quantize

    folder, out = tmp_path_factory.mktemp("gguf"), {}
    for role, name in (("target", "stdlib-coder"), ("cllm", "stdlib-coder-cllm")):
        tokenizer = load_tokenizer(name)
        path = write_gguf(load_model(name), tokenizer, folder / f"{role}.gguf").path
        quantize(path, folder / f"{role}-q8_0.gguf", "q8_0", threads=2)
        table = load_draft_table(name)
        out[role, "f32"] = path, tokenizer, table
        out[role, "q8_0"] = folder / f"{role}-q8_0.gguf", tokenizer, table
    return out


def runtime(path):
    from cllm.runtime.llamacpp import LlamaCppRuntime

    return LlamaCppRuntime(path, threads=2, context=4096)


def llama_cpp_greedy(path, prompts: list[list[int]], eos: int, max_new_tokens: int = NEW_TOKENS) -> list[list[int]]:
    """llama.cpp's own greedy tokens after each prompt (llama-cpp-python's `generate`, top_k=1),
    f32 weights and KV cache, as the runtime's."""
    import llama_cpp

    cache = llama_cpp.GGML_TYPE_F32
    llm = llama_cpp.Llama(model_path=str(path), n_ctx=512, n_threads=2, n_threads_batch=2, n_gpu_layers=0, seed=0,
                          type_k=cache, type_v=cache, verbose=False)
    out = []
    for prompt in prompts:
        llm.reset()
        tokens = []
        for token in llm.generate(prompt, temp=0.0, top_k=1, repeat_penalty=1.0, reset=True):
            tokens.append(int(token))
            if token == eos or len(tokens) >= max_new_tokens:
                break
        out.append(tokens)
    return out


def prompts_of(tokenizer, count: int = 6) -> list[list[int]]:
    return [p.ids for p in encode_prompts("humaneval", tokenizer, limit=count, spread=True, keep=256)]


def decode_each(rt, prompts, eos, **settings) -> list[list[int]]:
    if not settings:
        return [greedy_decode(rt, torch.tensor([p]), max_new_tokens=NEW_TOKENS, eos_token_id=eos).new_tokens[0]
                for p in prompts]
    return [jacobi_decode(rt, torch.tensor([p]), max_new_tokens=NEW_TOKENS, eos_token_id=eos, **settings).new_tokens[0]
            for p in prompts]


@pytest.mark.llamacpp
@pytest.mark.parametrize("kind", ["f32", "q8_0"])
@pytest.mark.parametrize("role", ["target", "cllm"])
def test_greedy_and_the_engine_give_llama_cpps_own_greedy_tokens(shipped, role, kind):
    """f32: token for token. q8_0: llama.cpp quantizes each activation to 8 bits before its
    matrix products, so a difference in the last float bit (the order the attention sums cells
    in, which a Jacobi row's kept and freed entries change) can move a logit by a rounding step:
    the engine may part from greedy decoding only where greedy's top-2 logits are that close."""
    path, tokenizer, table = shipped[role, kind]
    eos, prompts = tokenizer.eos_token_id, prompts_of(tokenizer)
    rt = runtime(path)
    want = decode_each(rt, prompts, eos)  # our greedy decoding on llama.cpp's forward
    if kind == "f32":  # is llama.cpp's own (its generate crashes on quantized files here: AMX, see the runtime)
        assert want == llama_cpp_greedy(path, prompts, eos)
    for settings in (dict(RECOMMENDED, draft_table=table), dict(block_size=16, recycle=8, recycle_budget=None,
                                                                  blocks_in_flight=2)):
        assert decode_each(rt, prompts, eos, **settings) == want  # exact: a quantized file decodes one token a forward
        got = decode_each(rt, prompts, eos, **{**settings, "exact": False})  # drafts verified by wide forwards anyway
        for prompt, w, g in zip(prompts, want, got, strict=True):
            margin = parting_margin(rt, prompt, w, g)
            assert margin is None or (kind == "q8_0" and margin < Q8_NEAR_TIE), (kind, settings, margin)


@pytest.mark.llamacpp
def test_the_kv_cache_is_f32_for_an_f32_file_and_llama_cpps_f16_for_a_quantized_one(shipped):
    f32, q8 = runtime(shipped["target", "f32"][0]), runtime(shipped["target", "q8_0"][0])
    assert f32.f32_cache and f32.batch_invariant
    assert not q8.f32_cache and not q8.batch_invariant
    assert "f16 KV cache" in q8.describe()


Q8_NEAR_TIE = 0.05  # logits: what a rounding step of a q8_0 activation moved them by here, at most


def parting_margin(rt, prompt: list[int], want: list[int], got: list[int]) -> float | None:
    """None where two outputs are equal; else greedy's top-2 logit margin where they first part."""
    if want == got:
        return None
    k = next(i for i, (a, b) in enumerate(zip(want + [-1], got + [-2])) if a != b)
    session = rt.session()
    rows, out = session.open([prompt + want[:k]])
    session.close(rows)
    top = out.logits[0, -1].topk(2).values
    return float(top[0] - top[1])


@pytest.mark.llamacpp
@pytest.mark.parametrize("block_size", [1, 2, 3, 5, 8, 16, 32])
def test_plain_jacobi_at_every_block_size_gives_llama_cpps_greedy_tokens(shipped, block_size):
    path, tokenizer, _ = shipped["target", "f32"]
    eos, prompts = tokenizer.eos_token_id, prompts_of(tokenizer, 3)
    assert decode_each(runtime(path), prompts, eos, block_size=block_size) == llama_cpp_greedy(path, prompts, eos)


@pytest.mark.llamacpp
def test_an_eos_inside_a_block_ends_the_output_there(shipped):
    path, tokenizer, table = shipped["target", "f32"]
    prompts = prompts_of(tokenizer, 3)
    rt = runtime(path)
    for prompt, full in zip(prompts, llama_cpp_greedy(path, prompts, tokenizer.eos_token_id), strict=True):
        eos = full[10]  # a token the output makes mid-block: it ends the output there
        want = full[: full.index(eos) + 1]
        got = decode_each(rt, [prompt], eos, **RECOMMENDED, draft_table=table)[0]
        assert got == want and decode_each(rt, [prompt], eos, block_size=16)[0] == want


@pytest.mark.llamacpp
def test_every_verb_leaves_llama_cpp_holding_exactly_the_kept_entries(shipped):
    import llama_cpp

    rt = runtime(shipped["target", "f32"][0])

    def span(session, row):  # the positions llama.cpp holds for the row's sequence
        seq = session._rows[row].seq
        return (llama_cpp.llama_memory_seq_pos_min(rt._unified.memory, seq),
                llama_cpp.llama_memory_seq_pos_max(rt._unified.memory, seq))

    session = rt.session()
    rows, out = session.open([[5, 6, 7, 8], [9, 10]])
    assert out.logits.shape == (2, 1, rt.vocab_size) and [span(session, r) for r in rows] == [(0, 3), (0, 1)]
    fed = session.feed(rows, [[11, 12, 13], [14, 15, 16, 17]], parents=[[-1, 0, 0], [-1, 0, 1, 0]])
    assert fed.logits.shape == (2, 4, rt.vocab_size)
    session.keep(rows, [[0, 2], [0, 3]])  # each row keeps a path off its first branch
    assert [session.length(r) for r in rows] == [6, 4] and [span(session, r) for r in rows] == [(0, 5), (0, 3)]
    free = len(rt._unified.free)
    session.feed(rows, [[1], [2, 3]])
    session.keep(rows, [[], [0, 1]])
    assert [session.length(r) for r in rows] == [6, 6] and len(rt._unified.free) == free
    session.rewind(rows, [2, 6])
    assert [span(session, r) for r in rows] == [(0, 1), (0, 5)]
    session.close(rows[:1])
    assert session.rows() == rows[1:] and len(rt._unified.free) == free + 1
    # the surviving row reads as if alone: its next token is the one a fresh row's prefill gives
    alone = rt.session()
    ids, first = alone.open([[9, 10, 14, 17, 2, 3]])
    again = session.feed(rows[1:], [[4]]).logits[0, 0]
    check = alone.feed(ids, [[4]]).logits[0, 0]
    assert torch.equal(again.argmax(), check.argmax()) and torch.allclose(again, check, atol=1e-4)


@pytest.mark.llamacpp
def test_hidden_states_a_missing_file_and_a_partial_feed_are_refused_in_one_line(shipped, tmp_path):
    from cllm.runtime.llamacpp import LlamaCppRuntime

    rt = runtime(shipped["target", "f32"][0])
    session = rt.session()
    with pytest.raises(ValueError, match="no hidden states"):
        session.open([[1, 2]], hidden=True)
    rows, _ = session.open([[1, 2], [3]])
    with pytest.raises(ValueError, match="every open row"):
        session.feed(rows[:1], [[4]])
    with pytest.raises(ValueError, match="no GGUF file"):
        LlamaCppRuntime(tmp_path / "none.gguf")
    (tmp_path / "bad.gguf").write_bytes(b"not a model")
    with pytest.raises(ValueError, match="could not load"):
        LlamaCppRuntime(tmp_path / "bad.gguf")


LAW_VOCAB, LAW_LENGTH, LAW_ROWS, LAW_CHUNK = 4, 3, 4000, 50
LAW_PROMPT = [2, 0, 2, 2, 1, 3, 2]


@pytest.mark.llamacpp
@pytest.mark.parametrize("settings", [dict(block_size=3, temperature=1.0), dict(block_size=4, temperature=0.8,
                                                                              top_p=0.9, guess="repeat")],
                         ids=["n3-T1", "n4-T0.8-topp0.9-repeat"])
def test_sampling_on_llama_cpp_has_the_exact_autoregressive_law(tmp_path, settings):
    """Jacobi sampling and AR sampling on llama.cpp's forward, 4000 rows each (batches of 50, a
    generator per row), against the exact law of the first 3 tokens by enumeration from the
    transformers model's own logits (`tests/decoding/law.py`, as `tests/decoding/test_sampling.py`
    does on the torch runtimes): the runtime's logits must give the model's law."""
    from cllm.runtime.gguf import write_gguf

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=LAW_VOCAB, hidden_size=32, intermediate_size=64,
                                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                         max_position_embeddings=64)).float().eval()
    with torch.no_grad():  # much sharper than a random init: the law then depends on the context
        model.lm_head.weight.mul_(8)
    rt = runtime(write_gguf(model, byte_tokenizer(LAW_VOCAB), tmp_path / "law.gguf").path)
    law = exact_joint_law(model, LAW_PROMPT, LAW_LENGTH, temperature=settings["temperature"],
                          top_p=settings.get("top_p"))
    for seed, decode in enumerate((jacobi_decode, sample_decode)):
        kwargs = settings if decode is jacobi_decode else {k: v for k, v in settings.items()
                                                           if k in ("temperature", "top_p")}
        counts = Counter()
        for start in range(0, LAW_ROWS, LAW_CHUNK):
            generators = [torch.Generator().manual_seed(1_000_003 * seed + i) for i in range(start, start + LAW_CHUNK)]
            out = decode(rt, torch.tensor([LAW_PROMPT]).expand(LAW_CHUNK, -1), generator=generators,
                         max_new_tokens=LAW_LENGTH, **kwargs)
            counts.update(tuple(t[:LAW_LENGTH]) for t in out.new_tokens)
        result = chi_square(counts, law)
        assert not result.rejects(), f"{decode.__name__} {settings}: {result}"


@pytest.mark.llamacpp
@pytest.mark.parametrize("sequences", [5, 9, 64])
def test_rows_share_out_the_sequences_their_trees_may_hold_and_stay_greedy(shipped, sequences):
    """4 rows decoding together with recycling (up to 8 drafts each): with 5 sequences no tree
    may branch (the rows hold 4), with 9 each may have 2 leaves; the output stays greedy's."""
    from cllm.runtime.llamacpp import LlamaCppRuntime

    path, tokenizer, table = shipped["target", "f32"]
    rt = LlamaCppRuntime(path, threads=2, context=4096, sequences=sequences)
    prompts = prompts_of(tokenizer, 4)
    session = rt.session()
    rows, _ = session.open(prompts)
    assert session.tree_leaves(rows) == [1 + (sequences - 4) // 4] * 4
    session.close(rows)
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    out = jacobi_decode(rt, ids, mask, max_new_tokens=NEW_TOKENS, eos_token_id=tokenizer.eos_token_id, **RECOMMENDED,
                        draft_table=table)
    assert out.new_tokens == decode_each(rt, prompts, tokenizer.eos_token_id)


@pytest.mark.llamacpp
def test_a_server_runtime_moves_a_row_alone_into_a_stream_when_others_join_and_every_row_stays_greedy(shipped):
    """streams=4: the first row opens alone in the unified context (its drafts verified as a
    tree); rows that join open in streams of their own and move it there (its entries copied);
    a fifth row, no stream free, opens unified beside them (one decode per context a forward).
    Every row's tokens are llama.cpp's greedy ones, and a stream row never holds a tree."""
    from cllm.decoding import BatchDecoder
    from cllm.runtime.llamacpp import LlamaCppRuntime

    path, tokenizer, table = shipped["cllm", "f32"]
    eos = tokenizer.eos_token_id
    prompts = prompts_of(tokenizer, 5)
    rt = LlamaCppRuntime(path, threads=2, streams=4)
    decoder = BatchDecoder(rt, eos_token_id=eos, draft_table=table, **RECOMMENDED)
    rows = {0: decoder.add(torch.tensor([prompts[0]]), max_new_tokens=NEW_TOKENS)[0]}
    layout = decoder.session._rows
    assert not layout[rows[0]].ctx.streams and decoder.session.tree_leaves([rows[0]])[0] > 1
    decoder.step()
    decoder.step()
    for i in (1, 2, 3):
        rows[i] = decoder.add(torch.tensor([prompts[i]]), max_new_tokens=NEW_TOKENS)[0]
    assert all(layout[r].ctx.streams for r in rows.values())  # the first one moved
    decoder.step()
    rows[4] = decoder.add(torch.tensor([prompts[4]]), max_new_tokens=NEW_TOKENS)[0]
    assert not layout[rows[4]].ctx.streams  # the streams are full
    assert decoder.session.tree_leaves([rows[3], rows[4]])[0] == 1
    while decoder.step():
        pass
    expected = llama_cpp_greedy(path, prompts, eos)
    assert [decoder.tokens(rows[i]) for i in range(5)] == expected


@pytest.mark.llamacpp
def test_a_row_in_a_stream_refuses_a_tree_and_takes_a_one_leaf_tree_as_a_chain(shipped):
    from cllm.runtime.llamacpp import LlamaCppRuntime

    rt = LlamaCppRuntime(shipped["target", "f32"][0], threads=2, streams=2)
    session = rt.session()
    rows, _ = session.open([[5, 6, 7], [8, 9]])  # two at once: streams
    assert session.tree_leaves(rows) == [1, 1]
    with pytest.raises(ValueError, match="a chain, not a tree"):
        session.feed(rows, [[1, 2, 3], [4]], parents=[[-1, 0, 0], [-1]])
    chain = session.feed(rows, [[1, 2], [4]], parents=[[-1, 0], [-1]]).logits
    session.keep(rows, [[0, 1], [0]])
    assert [session.length(r) for r in rows] == [5, 3]
    _, alone = rt.session().open([[5, 6, 7, 1, 2]])  # the streams are taken: unified
    assert torch.allclose(chain[0, 1], alone.logits[0, -1], atol=1e-4)


def test_free_streams_between_fed_rows_are_filled_only_when_every_row_feeds_as_many():
    from types import SimpleNamespace

    from cllm.runtime.llamacpp import _gaps, _merged

    streams = SimpleNamespace(streams=True, free=[1, 4, 6, 7])
    assert _gaps(streams, [0, 2, 3, 5], [4, 4, 4, 4]) == [1, 4]  # not 6, 7: past the last fed stream
    assert _gaps(streams, [0, 2, 3, 5], [4, 2, 4, 4]) == []  # unequal chains are split anyway
    assert _gaps(SimpleNamespace(streams=True, free=[]), [0, 2], [4, 4]) == []  # held by another session's row
    assert _gaps(SimpleNamespace(streams=False, free=[1]), [0, 2], [4, 4]) == []
    assert _merged([7, 3, 9], [0, 2, 5], [1, 4]) == [7, -2, 3, -5, 9]


@pytest.mark.llamacpp
def test_a_filled_gap_leaves_no_entries_and_the_rows_read_as_if_alone(shipped):
    import llama_cpp

    from cllm.runtime.llamacpp import LlamaCppRuntime

    rt = LlamaCppRuntime(shipped["target", "f32"][0], threads=2, streams=4)
    session = rt.session()
    rows, _ = session.open([[5, 6, 7], [8, 9], [10, 11, 12, 13]])  # streams 0, 1, 2
    session.close(rows[1:2])  # stream 1 free, between the other two
    fed = session.feed([rows[0], rows[2]], [[1, 2], [3, 4]]).logits
    memory = rt._streams.memory
    assert llama_cpp.llama_memory_seq_pos_max(memory, 1) == -1  # the filler is gone
    session.keep([rows[0], rows[2]], [[0, 1], [0, 1]])
    for row, prompt, out in ((rows[0], [5, 6, 7, 1, 2], fed[0]), (rows[2], [10, 11, 12, 13, 3, 4], fed[1])):
        _, alone = rt.session().open([prompt])
        assert torch.allclose(out[-1], alone.logits[0, -1], atol=1e-4)
        assert session.length(row) == len(prompt)
