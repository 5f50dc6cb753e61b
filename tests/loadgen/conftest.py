"""The load generator's tests drive the same shared live server as the HTTP tests."""

from tests.serve.conftest import srv  # noqa: F401 - a fixture
