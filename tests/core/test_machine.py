"""`cllm.core.machine`: the thread-count rule and `in_passing_thread`."""

import threading

import pytest

from cllm.core.machine import in_passing_thread, threads_for_load


def test_in_passing_thread_returns_fns_result_computed_on_another_thread_that_ends():
    seen = {}

    def work():
        seen["thread"] = threading.current_thread()
        return 42

    assert in_passing_thread(work) == 42
    assert seen["thread"] is not threading.current_thread()
    assert not seen["thread"].is_alive()


def test_in_passing_thread_raises_fns_exception_on_the_callers_thread():
    class Boom(Exception):
        pass

    def work():
        raise Boom("bad input")

    with pytest.raises(Boom, match="bad input"):
        in_passing_thread(work)


@pytest.mark.parametrize("load, cores, wanted, threads",
                         [(None, 2, 2, 2), (0.0, 2, 2, 2), (1.2, 2, 2, 1), (5.0, 2, 2, 1), (0.3, 8, 4, 4)])
def test_threads_for_load_leaves_busy_cores_alone(load, cores, wanted, threads):
    assert threads_for_load(load, cores, wanted) == threads
