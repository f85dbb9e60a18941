"""Shared test setup: the GPU marker skips with its reason where there is no CUDA device."""

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _cuda_reason():
    try:
        import torch
    except ImportError:
        return "torch is not installed"
    if not torch.cuda.is_available():
        return "needs a CUDA GPU; this machine has none (run scripts/gpu/run_suite.sh on a GPU host)"
    return None


def pytest_collection_modifyitems(config, items):
    reason = _cuda_reason()
    if reason is None:
        return
    skip = pytest.mark.skip(reason=reason)
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _fresh_plugin_state():
    """Each test starts with the plugin's process-wide config and stats cleared."""
    from vllm_omni_graphdecode import config, stats

    config.reset_for_tests()
    stats.reset()
    yield
    config.reset_for_tests()
    stats.reset()
