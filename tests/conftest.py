"""Every test leaves no child process behind: whatever a failing test did not stop is killed here."""

from pathlib import Path

import pytest

from tests.procs import reap_all


@pytest.fixture(autouse=True)
def _reap_processes():
    yield
    reap_all()


@pytest.fixture(scope="module")
def outside(tmp_path_factory) -> Path:
    """A working directory outside the checkout (the shipping checks run what users install from there)."""
    d = tmp_path_factory.mktemp("outside")
    assert Path(__file__).resolve().parent.parent not in d.resolve().parents
    return d
