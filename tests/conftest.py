"""Every test leaves no child process behind: whatever a failing test did not stop is killed here."""

import pytest

from tests.procs import reap_all


@pytest.fixture(autouse=True)
def _reap_processes():
    yield
    reap_all()
