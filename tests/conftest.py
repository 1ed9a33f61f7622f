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


def engine_test_refusal(version: str | None = None, amx: bool | None = None) -> str | None:
    """Why the installed vLLM (or `version`) cannot run the engine tests' float32 tiny models on this CPU (`amx`:
    None asks torch, as vLLM does): engines/vllm_plugin/cpu_refusals.py. None where it can, or without vLLM's
    CPU build."""
    import torch

    if version is None:
        try:
            import vllm
            from vllm.platforms import current_platform
        except ImportError:
            return None
        if not current_platform.is_cpu():
            return None
        version = vllm.__version__
    from routing_replay.engines.vllm_plugin.cpu_refusals import moe_dtype_refusal

    return moe_dtype_refusal(version, torch.float32, amx)


def pytest_collection_modifyitems(config, items):
    """The engine tests (marked vllm and slow) skipped with one reason where the installed vLLM release refuses
    their float32 MoE models on this CPU (vLLM CPU 0.27 on AMX CPUs), instead of one load error per engine."""
    engine = [it for it in items if it.get_closest_marker("vllm") and it.get_closest_marker("slow")
              and not it.get_closest_marker("gpu")]
    reason = engine_test_refusal() if engine else None
    if reason is None:
        return
    config.stash[_REFUSAL] = (reason, len(engine))
    for it in engine:
        it.add_marker(pytest.mark.skip(reason=reason))


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    refusal = config.stash.get(_REFUSAL, None)
    if refusal is not None:
        terminalreporter.write_line(f"routing-replay: {refusal[1]} vLLM engine tests skipped: {refusal[0]}",
                                    yellow=True, bold=True)


_REFUSAL = pytest.StashKey()
