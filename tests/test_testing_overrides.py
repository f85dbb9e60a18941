"""``GRAPHDECODE_TEST_SENSENOVA_STEP`` (``testing/common.py``): a whole GPU run with SenseNova-U1's
decode step in another mode. The GPU tests' config builders put it under their own values, so a
test that names its step mode keeps it; a value the product setting refuses stops the run."""

import importlib

import pytest

from vllm_omni_graphdecode import config
from vllm_omni_graphdecode.testing import common

STEP = config.SENSENOVA_STEP_VAR


def test_unset_or_empty_overrides_nothing(monkeypatch):
    monkeypatch.delenv(common.SUITE_STEP_VAR, raising=False)
    assert common.suite_overrides() == {}
    monkeypatch.setenv(common.SUITE_STEP_VAR, "")
    assert common.suite_overrides() == {}
    assert common.with_suite_overrides({"VLLM_OMNI_GRAPHDECODE": "1"}) == {
        "VLLM_OMNI_GRAPHDECODE": "1"}


def test_rowgemv_names_the_products_decode_step_setting(monkeypatch):
    monkeypatch.setenv(common.SUITE_STEP_VAR, "rowgemv")
    assert common.suite_overrides() == {STEP: "rowgemv"}


def test_an_unknown_step_is_refused_naming_the_value_and_the_accepted_ones(monkeypatch):
    monkeypatch.setenv(common.SUITE_STEP_VAR, "cublas")
    with pytest.raises(ValueError) as refused:
        common.suite_overrides()
    message = str(refused.value)
    assert common.SUITE_STEP_VAR in message and "'cublas'" in message
    assert "accepted: auto, fused, tuned, rowgemv, exact" in message


def test_a_tests_own_step_mode_wins_over_the_override(monkeypatch):
    monkeypatch.setenv(common.SUITE_STEP_VAR, "rowgemv")
    assert common.with_suite_overrides({"VLLM_OMNI_GRAPHDECODE": "1"}) == {
        STEP: "rowgemv", "VLLM_OMNI_GRAPHDECODE": "1"}
    assert common.with_suite_overrides({STEP: "fused"}) == {STEP: "fused"}


@pytest.mark.parametrize("module", ["test_faults_gpu", "test_sensenova_batch_gpu",
                                    "test_sensenova_denoise_gpu", "test_sensenova_gpu"])
def test_a_gpu_config_builder_takes_the_override_unless_it_names_the_step(monkeypatch, module):
    cfg = importlib.import_module(module)._cfg
    monkeypatch.delenv(common.SUITE_STEP_VAR, raising=False)
    assert cfg().sensenova_step == config.parse({}).sensenova_step  # the product's default
    monkeypatch.setenv(common.SUITE_STEP_VAR, "rowgemv")
    assert cfg().sensenova_step == "rowgemv"
    assert cfg(**{STEP: "fused"}).sensenova_step == "fused"
    assert cfg(**{STEP: "exact"}).sensenova_step == "exact"
