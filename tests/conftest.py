"""Checks every test gets: structlog's configuration is left as found.

A control plane run inside the test process must log through
``tests.daemon_helpers.plane_logging``; a cached logger configured by one test writes
to that test's file for the rest of the session, and later tests' ``capture_logs``
see nothing (the unit tests of health, membership and memory failed that way, only when
run after the in-process integration tests)."""

from __future__ import annotations

import pytest
import structlog


@pytest.fixture(autouse=True)
def _structlog_left_as_found():
    yield
    assert not structlog.get_config()["cache_logger_on_first_use"], (
        "this test configured structlog with cached loggers and left it so; run an in-process "
        "control plane under tests.daemon_helpers.plane_logging")
