"""The runtime tests use the decoding tests' tiny models and their runtimes (`arch`)."""

from tests.decoding.conftest import arch  # noqa: F401 (a fixture)
