"""Every plugin variable parses its documented values and rejects the rest by name."""

import pytest

from vllm_omni_graphdecode import config
from vllm_omni_graphdecode.hooks import MODEL_KEYS

ALL = set(MODEL_KEYS)
LIST = "comma list of " + ", ".join(MODEL_KEYS)


def test_defaults_leave_the_plugin_off():
    cfg = config.parse({})
    assert cfg.models == frozenset()
    assert not cfg.enabled
    assert cfg.precapture is True and cfg.verify is False
    assert cfg.fa_version == "auto" and cfg.sensenova_intree == "defer"
    assert cfg.buckets == (512, 1024, 2048, 4096, 8192)


@pytest.mark.parametrize("raw,models", [
    ("0", set()), ("", set()), ("off", set()),
    ("1", ALL), ("all", ALL),
    ("sensenova_u1", {"sensenova_u1"}), ("qwen_image_21", {"qwen_image_21"}),
    (" sensenova_u1 , qwen_image_21 ", {"sensenova_u1", "qwen_image_21"}),
])
def test_enable_variable_accepts_documented_values(raw, models):
    assert config.parse({"VLLM_OMNI_GRAPHDECODE": raw}).models == models


@pytest.mark.parametrize("var,raw,accepted", [
    ("VLLM_OMNI_GRAPHDECODE", "2", LIST),
    ("VLLM_OMNI_GRAPHDECODE", "sensenova", LIST),
    ("VLLM_OMNI_GRAPHDECODE", "sensenova_u1,flux", LIST),
    ("VLLM_OMNI_GRAPHDECODE", ",", LIST),
    ("VLLM_OMNI_GRAPHDECODE_VERIFY", "maybe", "1/true/yes/on or 0/false/no/off"),
    ("VLLM_OMNI_GRAPHDECODE_PRECAPTURE", "2", "1/true/yes/on or 0/false/no/off"),
    ("VLLM_OMNI_GRAPHDECODE_FA_VERSION", "4", "auto, 2, 3"),
    ("VLLM_OMNI_GRAPHDECODE_FA_VERSION", "fa3", "auto, 2, 3"),
    ("VLLM_OMNI_GRAPHDECODE_SENSENOVA_INTREE", "replace", "defer, takeover"),
    ("VLLM_OMNI_GRAPHDECODE_BUCKETS", "512,abc", "increasing positive multiples of 16"),
    ("VLLM_OMNI_GRAPHDECODE_BUCKETS", "1024,512", "increasing positive multiples of 16"),
    ("VLLM_OMNI_GRAPHDECODE_BUCKETS", "500", "increasing positive multiples of 16"),
    ("VLLM_OMNI_GRAPHDECODE_PRECAPTURE_BUCKETS", "0", "increasing positive multiples of 16"),
    ("VLLM_OMNI_GRAPHDECODE_PRECAPTURE_BUCKETS", "16384", "buckets listed in"),
    ("VLLM_OMNI_GRAPHDECODE_PRECAPTURE_BUCKETS", "1024, 16384", "buckets listed in"),
    ("VLLM_OMNI_GRAPHDECODE_FP8", "fp16",
     "off (default), on (every FP8 path but the lm_head), or a comma list of sensenova_decode, "
     "sensenova_denoise, qwen_image_21, sensenova_lm_head"),
    ("VLLM_OMNI_GRAPHDECODE_FP8", "sensenova_decode,qwen", "sensenova_denoise, qwen_image_21"),
    ("VLLM_OMNI_GRAPHDECODE_FP8", "sensenova_lm_head",
     "sensenova_lm_head together with sensenova_decode"),
    ("VLLM_OMNI_GRAPHDECODE_FP8", "on,sensenova_lm_head", "a comma list of"),
    ("VLLM_OMNI_GRAPHDECODE_MAX_ENTRIES", "0", "a positive integer"),
    ("VLLM_OMNI_GRAPHDECODE_MAX_ENTRIES", "many", "a positive integer"),
])
def test_invalid_value_names_variable_value_and_what_is_accepted(var, raw, accepted):
    with pytest.raises(config.ConfigError) as err:
        config.parse({var: raw})
    message = str(err.value)
    assert var in message
    assert accepted in message
    assert repr(raw) in message  # the raw value as set, not a parsed or normalised one


@pytest.mark.parametrize("raw,paths", [
    ("off", set()), ("0", set()), ("", set()), ("on", set(config.FP8_PATHS)),
    ("1", set(config.FP8_PATHS)), (" sensenova_decode ", {"sensenova_decode"}),
    ("qwen_image_21,sensenova_decode", {"qwen_image_21", "sensenova_decode"}),
    ("sensenova_denoise", {"sensenova_denoise"}),
    ("sensenova_decode,sensenova_lm_head", {"sensenova_decode", "sensenova_lm_head"}),
])
def test_fp8_variable_accepts_off_on_and_path_names(raw, paths):
    assert config.parse({"VLLM_OMNI_GRAPHDECODE_FP8": raw}).fp8 == paths
    assert config.parse({}).fp8 == frozenset()  # opt-in
    # The lm_head is named only: ``on`` keeps it bf16, as vLLM's --quantization fp8 does.
    assert "sensenova_lm_head" not in config.parse({"VLLM_OMNI_GRAPHDECODE_FP8": "on"}).fp8


def test_buckets_alone_derive_the_precapture_buckets():
    cfg = config.parse({"VLLM_OMNI_GRAPHDECODE_BUCKETS": "256,1024,4096"})
    assert cfg.precapture_buckets == (256, 1024)  # those up to 2048
    cfg = config.parse({"VLLM_OMNI_GRAPHDECODE_BUCKETS": "4096,8192"})
    assert cfg.precapture_buckets == (4096,)  # none that short: the first bucket
    assert config.parse({}).precapture_buckets == (512, 1024, 2048)


def test_precapture_buckets_are_not_checked_with_precapture_off():
    cfg = config.parse({"VLLM_OMNI_GRAPHDECODE_BUCKETS": "256,1024",
                        "VLLM_OMNI_GRAPHDECODE_PRECAPTURE_BUCKETS": "512",
                        "VLLM_OMNI_GRAPHDECODE_PRECAPTURE": "0"})
    assert cfg.buckets == (256, 1024) and not cfg.precapture


def test_precapture_buckets_outside_the_buckets_say_what_to_change():
    with pytest.raises(config.ConfigError) as err:
        config.parse({"VLLM_OMNI_GRAPHDECODE_BUCKETS": "256,1024",
                      "VLLM_OMNI_GRAPHDECODE_PRECAPTURE_BUCKETS": "256, 512"})
    message = str(err.value)
    assert "VLLM_OMNI_GRAPHDECODE_PRECAPTURE_BUCKETS='256, 512'" in message
    assert "VLLM_OMNI_GRAPHDECODE_BUCKETS='256,1024'" in message
    assert "512 not among the buckets" in message
    assert "VLLM_OMNI_GRAPHDECODE_PRECAPTURE=0" in message  # one of the ways out


def test_every_setting_is_documented_in_readme_with_its_default():
    import pathlib

    readme = (pathlib.Path(__file__).parents[1] / "README.md").read_text()
    rows = {}
    for line in readme.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) >= 3 and cells[0].startswith("`VLLM_OMNI_GRAPHDECODE"):
            rows[cells[0].strip("`")] = cells[1]
    assert set(rows) == {s.var for s in config.SETTINGS}
    for setting in config.SETTINGS:
        shown = f"`{setting.default}`" if setting.default else "unset"
        assert rows[setting.var] == shown, (setting.var, rows[setting.var])


def test_get_parses_once_per_process(monkeypatch):
    monkeypatch.setenv("VLLM_OMNI_GRAPHDECODE", "sensenova_u1")
    first = config.get()
    monkeypatch.setenv("VLLM_OMNI_GRAPHDECODE", "qwen_image_21")
    assert config.get() is first
    assert first.models == {"sensenova_u1"}


@pytest.mark.parametrize("env,mode", [
    ({"VLLM_OMNI_GRAPHDECODE_FP8": "on"}, "fast"),
    ({"VLLM_OMNI_GRAPHDECODE_FP8": "sensenova_denoise"}, "fast"),
    ({"VLLM_OMNI_GRAPHDECODE_FP8": "sensenova_decode"}, "graph"),
    ({"VLLM_OMNI_GRAPHDECODE_FP8": "on", "VLLM_OMNI_GRAPHDECODE_SENSENOVA_DENOISE": "graph"}, "graph"),
    ({"VLLM_OMNI_GRAPHDECODE_FP8": "on", "VLLM_OMNI_GRAPHDECODE_SENSENOVA_DENOISE": "off"}, "off"),
    ({}, "graph"),
])
def test_fp8_for_sensenova_denoising_selects_the_fast_mode_unless_a_mode_is_set(env, mode):
    assert config.parse(env).sensenova_denoise == mode


@pytest.mark.parametrize("raw, parsed", [("1", 1), ("3", 3), ("all", None), (" ALL ", None)])
def test_denoising_steps_beside_decode_take_a_count_or_all_and_show_as_given(raw, parsed):
    var = "VLLM_OMNI_GRAPHDECODE_SENSENOVA_DENOISE_BESIDE_DECODE"
    cfg = config.parse({var: raw})
    assert cfg.sensenova_denoise_beside_decode == parsed
    shown = cfg.as_env()[var]
    assert config.parse({var: shown}) == cfg  # what doctor prints parses back to the same


@pytest.mark.parametrize("raw", ["0", "-1", "2.5", "none", ""])
def test_denoising_steps_beside_decode_refuse_anything_else_by_name(raw):
    var = "VLLM_OMNI_GRAPHDECODE_SENSENOVA_DENOISE_BESIDE_DECODE"
    with pytest.raises(config.ConfigError, match=f"{var}='{raw}' is not accepted; accepted: a "
                                                 f"positive number of steps, or all"):
        config.parse({var: raw})
