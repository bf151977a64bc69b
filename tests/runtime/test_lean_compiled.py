"""The lean runtime's compiled forward (`compiled.compile_runner`) against transformers' own
forward: the same logits through prefill, feeds over a cache with holes and tree feeds, and the
same greedy tokens through the engine, on every architecture the runtime takes, with one batch
row and several, one fed token and many; the compiled graphs really run (and only in inference
mode); a weight changed after compiling sends forwards back to the eager forward; where it
cannot be compiled, a reason, and the eager forward decodes.

Each model compiles once per session (AOTInductor, into the session's compile cache: 15-40 s a
graph here), on its own copy: the shared models of `test_lean.py` stay uncompiled."""

import copy
import os
import time

import pytest
import torch

from cllm import greedy_decode, jacobi_decode
from cllm.runtime import open_runtime
from cllm.runtime.lean import LeanRuntime, compiled
from tests.decoding.conftest import random_prompt
from tests.runtime.test_lean import LEAN_ARCHS, SETTINGS, assert_same_logits, feeds, lean_model, padded_batch

NOT_HERE = compiled.why_not_compiled(lean_model("llama"))  # no C++ compiler, an older torch
pytestmark = pytest.mark.skipif(NOT_HERE is not None, reason=f"no compiled forward here: {NOT_HERE}")

_COMPILED: dict[str, LeanRuntime] = {}


def compiled_runtime(arch: str) -> LeanRuntime:
    """The lean runtime of a copy of `arch`'s model, its forward compiled."""
    if arch not in _COMPILED:
        _COMPILED[arch] = fresh(arch)
        assert _COMPILED[arch].compile() is None
    return _COMPILED[arch]


def fresh(arch: str, dtype: torch.dtype = torch.float32) -> LeanRuntime:
    """The lean runtime of a new copy of `arch`'s model (nothing compiled)."""
    with torch.inference_mode(False):
        return LeanRuntime(copy.deepcopy(lean_model(arch, dtype)))


def reference(runtime: LeanRuntime):
    """The same model on transformers' forward."""
    return open_runtime(runtime.model, "transformers")


def live(runtime: LeanRuntime):
    """The runtime's compiled forward while its weights are the ones compiled, else None."""
    forward = runtime.runner.compiled
    return forward if forward is not None and forward.current() else None


class Counting:
    """Counts calls of the compiled graphs: `one_row` and `rows` (batches of two rows or more)."""

    def __init__(self, runtime):
        self.forward = live(runtime)
        self.graphs = {name: getattr(self.forward, name) for name in ("one_row", "rows")}
        self.graphs = {name: graph for name, graph in self.graphs.items() if graph is not None}
        self.counts = dict.fromkeys(("one_row", "rows"), 0)

    @property
    def calls(self):
        return sum(self.counts.values())

    def __enter__(self):
        for name, graph in self.graphs.items():
            def counted(*args, name=name, graph=graph):
                self.counts[name] += 1
                return graph(*args)

            setattr(self.forward, name, counted)
        return self

    def __exit__(self, *exc):
        for name, graph in self.graphs.items():
            setattr(self.forward, name, graph)


@pytest.mark.parametrize("arch", LEAN_ARCHS)
@torch.inference_mode()
def test_the_compiled_forward_computes_transformers_logits_through_feeds_holes_and_trees(arch):
    runtime = compiled_runtime(arch)
    assert "compiled forward" in runtime.describe()
    with Counting(runtime) as counted:
        got = feeds(runtime, (7, 3, 4))  # a prefill of 3 x 7 = 21 tokens: compiled too
    assert counted.calls == 5  # every forward ran the compiled forward
    assert_same_logits(got, feeds(reference(runtime), (7, 3, 4)))


@pytest.mark.parametrize("arch", LEAN_ARCHS)
@torch.inference_mode()
def test_one_row_and_one_token_forwards_compute_transformers_logits(arch):
    """One batch row runs its own graph; one fed token runs padded to two, and the padding leaves
    no trace in the cache: the forwards after it see what transformers' cache holds."""
    runtime = compiled_runtime(arch)
    ids = random_prompt(8, 6)[0].tolist()
    fed = torch.randint(2, 50, (4,), generator=torch.Generator().manual_seed(8)).tolist()

    def run(on):
        session = on.session()
        rows, first = session.open([ids])
        logits = [first.logits, session.feed(rows, [fed[:1]]).logits]
        session.keep(rows, [[0]])
        logits.append(session.feed(rows, [fed[1:2]]).logits)
        session.keep(rows, [[0]])
        logits.append(session.feed(rows, [fed], parents=[[-1, 0, 0, 1]]).logits)  # node 2 hangs off node 0
        session.keep(rows, [[0, 2]])
        logits.append(session.feed(rows, [fed[:3]]).logits)
        return [x.clone() for x in logits]

    with Counting(runtime) as counted:
        got = run(runtime)
    assert counted.counts == {"one_row": 5, "rows": 0}
    want = run(reference(runtime))
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("name", list(SETTINGS))
@pytest.mark.parametrize("arch", LEAN_ARCHS)
def test_the_engine_on_the_compiled_forward_gives_transformers_greedy_tokens(arch, name):
    runtime = compiled_runtime(arch)
    ids, mask, eos = padded_batch(runtime.model)
    expected = greedy_decode(reference(runtime), ids, mask, max_new_tokens=40, eos_token_id=eos).new_tokens
    alone = greedy_decode(reference(runtime), ids[2:], mask[2:], max_new_tokens=40, eos_token_id=eos).new_tokens
    with Counting(runtime) as counted:
        got = jacobi_decode(runtime, ids, mask, max_new_tokens=40, eos_token_id=eos,
                            generator=torch.Generator().manual_seed(0), **SETTINGS[name])
        one = jacobi_decode(runtime, ids[2:], mask[2:], max_new_tokens=40, eos_token_id=eos,
                            generator=torch.Generator().manual_seed(0), **SETTINGS[name])
    assert got.new_tokens == expected and one.new_tokens == alone, (arch, name)
    assert eos in got.new_tokens[0]
    if name != "n=32":  # 32 tokens a step is past the compiled widths
        assert counted.calls > 0


def test_only_inference_mode_runs_the_compiled_forward():
    """The graphs run in inference mode (where every decoding entry point runs): elsewhere (no_grad)
    the eager runner runs."""
    runtime = compiled_runtime("llama")
    ids = random_prompt(3, 8)[0].tolist()

    def run():
        session = runtime.session()
        rows, _ = session.open([ids])
        return session.feed(rows, [ids[:4]]).logits.clone()

    with Counting(runtime) as counted:
        with torch.no_grad():
            plain = run()
        assert counted.calls == 0
        with torch.inference_mode():
            inferred = run()
        assert counted.calls == 2
    torch.testing.assert_close(inferred, plain, rtol=1e-4, atol=1e-4)


def test_compiled_without_batches_one_row_runs_compiled_and_a_batch_eagerly():
    """`compile(batches=False)` (one prompt at a time: generate, chat, load_for_decoding) compiles
    only the one-row graph; a batch still decodes exactly, eagerly."""
    runtime = fresh("llama")
    assert runtime.compile(batches=False) is None
    assert live(runtime).rows is None
    ids, mask, eos = padded_batch(runtime.model)
    expected = greedy_decode(reference(runtime), ids, mask, max_new_tokens=24).new_tokens
    forward = live(runtime)
    taken = []  # the rows of each forward the compiled graph took
    forward.takes = lambda rows, tokens, takes=forward.takes: takes(rows, tokens) and not taken.append(rows)
    try:
        with Counting(runtime) as counted:
            got = jacobi_decode(runtime, ids, mask, max_new_tokens=24, generator=torch.Generator().manual_seed(0),
                                **SETTINGS["recycling"])
            # while two rows or more decode, eagerly; a row left alone at the end may run compiled
            assert set(taken) <= {1} and counted.calls == len(taken) and got.new_tokens == expected
            batch_calls = len(taken)
            one = jacobi_decode(runtime, ids[2:], mask[2:], max_new_tokens=24, **SETTINGS["recycling"])
            assert counted.counts["one_row"] == len(taken) > batch_calls and one.new_tokens == expected[2:]
    finally:
        del forward.takes


def test_a_weight_changed_after_compiling_sends_forwards_to_the_eager_forward():
    runtime = fresh("llama")
    model = runtime.model
    assert runtime.compile() is None
    prompt = random_prompt(4, 10)
    with torch.no_grad():
        model.model.layers[0].mlp.up_proj.weight.mul_(-1.5)  # a real change, as training makes
    assert live(runtime) is None and "compiled" not in runtime.describe()
    expected = greedy_decode(reference(runtime), prompt, max_new_tokens=24).new_tokens
    assert jacobi_decode(runtime, prompt, max_new_tokens=24, block_size=4).new_tokens == expected
    assert runtime.compile() is None and live(runtime) is not None  # compiled anew
    assert jacobi_decode(runtime, prompt, max_new_tokens=24, block_size=4).new_tokens == expected
    attention = model.model.layers[0].self_attn
    with torch.inference_mode(False), torch.no_grad():  # a weight replaced, as loading a checkpoint can
        attention.v_proj.weight = torch.nn.Parameter(attention.v_proj.weight * 2)
    assert live(runtime) is None


def test_where_the_forward_cannot_compile_a_reason_and_the_eager_forward_decodes(monkeypatch, tmp_path):
    assert "float32" in compiled.why_not_compiled(lean_model("llama", torch.bfloat16))
    runtime = fresh("qwen2")
    monkeypatch.setattr(compiled.shutil, "which", lambda name: None)
    assert "C++ compiler" in runtime.compile()
    monkeypatch.undo()

    def broken(runner, batch_rows, path):
        raise RuntimeError("C++ compile error\nmore detail")

    monkeypatch.setattr(compiled, "_build", broken)
    monkeypatch.setattr(compiled, "cache_dir", lambda: tmp_path)  # nothing cached: it builds
    assert runtime.compile() == "compiling failed: C++ compile error"
    assert live(runtime) is None and "compiled" not in runtime.describe()
    prompt = random_prompt(5, 6)
    expected = greedy_decode(reference(runtime), prompt, max_new_tokens=16).new_tokens
    assert jacobi_decode(runtime, prompt, max_new_tokens=16, block_size=4).new_tokens == expected


def test_a_later_compile_of_the_same_weights_loads_the_package_from_the_compile_cache():
    """Another process (here: another copy of the model) with the same weights loads what the
    first one built, and decodes with it exactly; other weights or another thread count are
    another package."""
    first = compiled_runtime("llama")
    runtime = fresh("llama")
    model = runtime.model
    assert runtime.compile() is None
    forward = live(runtime)
    assert forward.cached and "loaded from the compile cache" in runtime.describe()
    assert live(first).one_row is not forward.one_row  # a graph of its own
    prompt = random_prompt(6, 9)
    expected = greedy_decode(reference(runtime), prompt, max_new_tokens=24).new_tokens
    with Counting(runtime) as counted:
        assert jacobi_decode(runtime, prompt, max_new_tokens=24, block_size=4).new_tokens == expected
    assert counted.calls > 0
    key = compiled.fingerprint(model, batch_rows=False)
    assert key != compiled.fingerprint(model, batch_rows=True)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(threads + 1)
        assert compiled.fingerprint(model, batch_rows=False) != key
    finally:
        torch.set_num_threads(threads)
    with torch.no_grad():
        model.lm_head.weight[0, 0] += 1e-3
    assert compiled.fingerprint(model, batch_rows=False) != key


def test_a_damaged_package_is_built_again_and_an_unwritable_cache_builds_in_a_temporary_folder(
        monkeypatch, tmp_path):
    runtime = compiled_runtime("llama")
    model = runtime.model
    good = compiled.cache_dir() / f"{compiled.fingerprint(model, batch_rows=False)}.pt2"
    assert good.is_file()
    built = []

    def build(runner, batch_rows, path):  # what the real build writes, without the minute it takes
        built.append(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(good.read_bytes())

    monkeypatch.setattr(compiled, "_build", build)
    monkeypatch.setenv(compiled.CACHE_ENV, str(tmp_path / "cache"))
    damaged = tmp_path / "cache" / good.name
    damaged.parent.mkdir()
    damaged.write_bytes(b"not a package")
    graph, cached = compiled._graph(model, runtime.runner, batch_rows=False)
    assert not cached and built == [damaged] and damaged.read_bytes() == good.read_bytes()

    (tmp_path / "file").write_text("")
    monkeypatch.setenv(compiled.CACHE_ENV, str(tmp_path / "file" / "cache"))  # cannot be a folder
    built.clear()

    def build_once(runner, batch_rows, path):
        if not built:
            built.append(path)
            raise NotADirectoryError(path.parent)
        build(runner, batch_rows, path)

    monkeypatch.setattr(compiled, "_build", build_once)
    graph, cached = compiled._graph(model, runtime.runner, batch_rows=False)
    assert not cached and len(built) == 2 and tmp_path not in built[1].parents
    assert not built[1].exists()  # the temporary folder is gone, the loaded graph stays
    ids = random_prompt(3, 8)[0].tolist()

    def logits():
        session = runtime.session()
        rows, _ = session.open([ids])
        return session.feed(rows, [ids[:4]]).logits.clone()

    with torch.inference_mode():
        want = logits()
        live(runtime).one_row, saved = graph, live(runtime).one_row
        try:
            got = logits()
        finally:
            live(runtime).one_row = saved
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_a_build_deletes_partial_packages_that_killed_builds_left_and_keeps_fresh_ones(monkeypatch, tmp_path):
    cache = tmp_path / "cache"
    cache.mkdir()
    stale, fresh = cache / f"{'a1' * 20}.4242.partial.pt2", cache / f"{'c3' * 20}.4343.partial.pt2"
    package, other = cache / f"{'e5' * 20}.pt2", cache / "notes.partial.pt2"  # other: not a name a build writes
    for path in (stale, fresh, package, other):
        path.write_bytes(b"x" * 64)
    old = time.time() - compiled.PARTIAL_STALE_SECONDS - 60
    for path in (stale, package, other):  # a finished package stays, however old
        os.utime(path, (old, old))

    def export(*args, **kwargs):  # the build stops here: the sweep came first
        raise RuntimeError("export stopped by the test")

    monkeypatch.setattr(torch.export, "export", export)
    with pytest.raises(RuntimeError, match="stopped by the test"):
        compiled._build(LeanRuntime(lean_model("llama")).runner, False, cache / "f7a8.pt2")
    assert not stale.exists() and fresh.exists() and package.exists() and other.exists()
    assert compiled.sweep_partials(cache, stale=0) == [fresh] and package.exists() and other.exists()
