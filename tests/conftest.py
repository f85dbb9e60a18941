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


def pytest_addoption(parser):
    parser.addoption("--shuffle-seed", default=None,
                     help="run the test files in a random order and each file's tests in a random "
                          "order, from this seed (CI's second pass: a test that passes only after "
                          "another one fails there)")


def _shuffle(items, seed):
    import random

    rng = random.Random(seed)
    by_file: dict = {}
    for item in items:
        by_file.setdefault(item.fspath, []).append(item)
    files = list(by_file)
    rng.shuffle(files)
    items[:] = []
    for f in files:
        group = by_file[f]
        rng.shuffle(group)
        items.extend(group)


def pytest_report_header(config):
    seed = config.getoption("--shuffle-seed")
    return f"test order shuffled with seed {seed}" if seed is not None else None


def pytest_collection_modifyitems(config, items):
    seed = config.getoption("--shuffle-seed")
    if seed is not None:
        _shuffle(items, seed)
    reason = _cuda_reason()
    if reason is None:
        return
    skip = pytest.mark.skip(reason=reason)
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _fresh_plugin_state():
    """Each test starts with the plugin's process-wide config and stats cleared, and ends
    without the import hooks a test's ``register()`` left pending (a hook on a module no test
    had imported yet would otherwise fire in a later test) or the engine-side admission patch
    it made."""
    from vllm_omni_graphdecode import config
    from vllm_omni_graphdecode.core import loading, stats

    config.reset_for_tests()
    stats.reset()
    yield
    config.reset_for_tests()
    stats.reset()
    loading._finder.callbacks.clear()
    if loading._finder in sys.meta_path:
        sys.meta_path.remove(loading._finder)
    steps = sys.modules.get("vllm_omni_graphdecode.hooks.sensenova_u1.steps")
    if steps is not None:
        steps.undo_step_admission()


@pytest.fixture
def stats_warnings():
    """The messages the plugin logs at WARNING while the test runs (a handler on its logger:
    vllm's logging config may stop propagation to caplog)."""
    import logging

    from vllm_omni_graphdecode.core import stats

    records = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: records.append(record.getMessage())
    stats.logger.addHandler(handler)
    yield records
    stats.logger.removeHandler(handler)
