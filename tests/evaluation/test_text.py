"""Measures of free-running text: repetition, loops, divergence, and Python parse rates (only for
prompt sets that are Python)."""

from cllm.data.prompts import load_prompts
from cllm.evaluation.text import (
    cut_at_function_end,
    ends_in_loop,
    first_divergence,
    function_parses,
    is_degenerate,
    is_python_set,
    opens_a_python_function,
    strip_eos,
)


def test_degenerate_means_one_token_ten_times_in_a_row():
    assert is_degenerate([1, 2] + [3] * 10 + [4])
    assert not is_degenerate([3] * 9 + [4] + [3] * 9)


def test_ends_in_loop_sees_short_periodic_tails_only():
    assert ends_in_loop([9, 8] + [1, 2, 3] * 8)
    assert ends_in_loop([5] * 24)
    assert not ends_in_loop(list(range(40)))
    assert not ends_in_loop([1, 2] * 5)  # too short to tell
    assert not ends_in_loop(list(range(9)) * 3)  # period 9 > 8
    assert ends_in_loop([1, 2, 3] * 6, min_length=16)  # the collector's shorter window


def test_first_divergence_and_eos_stripping():
    assert first_divergence([1, 2, 3], [1, 2, 4]) == 2
    assert first_divergence([1, 2], [1, 2, 3]) == 2
    assert first_divergence([], [1]) == 0
    assert strip_eos([4, 5, 0, 7], 0) == ([4, 5], True)
    assert strip_eos([4, 5], 0) == ([4, 5], False)


def test_cut_at_function_end_stops_at_the_next_top_level_line():
    prompt = 'def f(x):\n    """Doc."""'
    completion = "\n    y = x + 1\n\n    return y\n\ndef g(\n"
    assert cut_at_function_end(prompt, completion) == prompt + "\n    y = x + 1\n\n    return y\n\n"
    assert function_parses(prompt, completion)


def test_the_rest_of_the_prompts_last_line_is_never_a_cut_point():
    prompt = "def f(x):\n    return ("
    assert cut_at_function_end(prompt, "x)\nprint(1)\n") == prompt + "x)\n"


def test_unfinished_body_drops_its_partial_last_line():
    prompt = 'def f(x):\n    """Doc."""\n'
    assert cut_at_function_end(prompt, "    return x\n    if (") == prompt + "    return x\n"
    assert function_parses(prompt, "    return x\n    if (")
    assert not function_parses(prompt, "    return (x,\n    1")


def test_a_body_with_only_the_docstring_is_not_a_parsing_completion():
    prompt = 'def f(x):\n    """Doc."""'
    assert not function_parses(prompt, "\n\ndef g():\n    pass\n")
    assert function_parses("def f(x):\n", "    return x\n", finished=True)


def test_the_named_sets_are_python_and_prose_or_other_code_is_not():
    for name in ("humaneval", "stdlib-val"):
        assert is_python_set([p.text for p in load_prompts(name, limit=50)]), name
    assert not is_python_set(["Once upon a time", "Dear Sir,", "SELECT * FROM t WHERE"])
    assert not is_python_set(["int main(void) {", "fn main() {", "def f(x):"])  # one in three
    assert not is_python_set([])
    assert opens_a_python_function('def f(x):\n    """Double x."""')
    assert opens_a_python_function("class A:\n    def f(self):")
    assert not opens_a_python_function("x = 1")
