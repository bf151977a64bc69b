"""`cllm serve`'s settings refuse what the server cannot do, in one line, before any model loads."""

import pytest

from cllm.cli import main


@pytest.mark.parametrize("flag", ["--eagle", "--medusa"])
def test_serve_refuses_heads_in_one_line_before_loading_the_model(tmp_path, capsys, flag):
    """Medusa / EAGLE heads decode one prompt at a time (`cllm generate`, `cllm chat`); the
    server batches rows on the Jacobi engine."""
    # a model that does not exist: the refusal comes first, from the flags alone
    code = main(["serve", "--model", str(tmp_path / "nope"), "--port", "0", flag, "auto"])
    out, err = capsys.readouterr()
    assert code == 2 and out == "" and err.count("\n") == 1 and "Traceback" not in err
    assert err.startswith(f"cllm serve: error: {flag}: heads are decoded by cllm generate / cllm chat"), err
