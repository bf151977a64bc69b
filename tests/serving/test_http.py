"""The connection limits' sizing: a cap the open-file limit could not hold is never promised."""

import resource

import pytest

from cllm.serving.http import SPARE_FILES, room_for_connections


@pytest.fixture
def soft_limit():
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    yield soft, hard
    resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_the_soft_open_file_limit_is_raised_for_the_cap_or_the_cap_shrinks_to_it(soft_limit):
    _, hard = soft_limit
    if hard != resource.RLIM_INFINITY and hard < 512 + SPARE_FILES:
        pytest.skip(f"the hard open-file limit here ({hard}) is too low to test raising the soft one")
    resource.setrlimit(resource.RLIMIT_NOFILE, (300, hard))
    assert room_for_connections(512) == 512
    assert resource.getrlimit(resource.RLIMIT_NOFILE)[0] >= 512 + SPARE_FILES
    if hard != resource.RLIM_INFINITY:  # more than the hard limit allows: the cap shrinks to fit
        assert room_for_connections(hard) == hard - SPARE_FILES
