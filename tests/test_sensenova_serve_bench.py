"""CPU checks of the HTTP load benchmark (``benchmarks/sensenova_serve.py``) and what it builds
on: the sharded serving checkpoint (read back by vLLM-Omni's own loader), the load scenario's
prompts and per-request records (``tests/e2e_serve.py``), the rows both sides make, and the
arguments it refuses. The servers themselves run on the GPU host only."""

from __future__ import annotations

import importlib.util
import json
import os
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _module(name: str, path: str):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


tiny = _module("make_tiny_checkpoints", os.path.join(ROOT, "examples", "make_tiny_checkpoints.py"))
driver = _module("e2e_serve", os.path.join(ROOT, "tests", "e2e_serve.py"))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
serve = _module("sensenova_serve", os.path.join(ROOT, "benchmarks", "sensenova_serve.py"))


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """The tiny SenseNova-U1 checkpoint twice from one seed: one file, and sharded (shards far
    smaller than the model, so several) with the end tokens silenced."""
    out = tmp_path_factory.mktemp("serve_ckpt")
    single, sharded = str(out / "single"), str(out / "sharded")
    tiny.write_sensenova_u1(single, seed=5)
    info = tiny.write_sensenova_u1(sharded, seed=5, shard_bytes=256 << 10,
                                   silent_tokens=serve.SILENT)
    return single, sharded, info


def test_sharded_checkpoint_has_every_tensor_once_and_an_index(checkpoints):
    from safetensors.torch import load_file

    single, sharded, info = checkpoints
    with open(os.path.join(sharded, "model.safetensors.index.json")) as f:
        index = json.load(f)
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 2, files
    assert files == sorted(f for f in os.listdir(sharded) if f.endswith(".safetensors"))
    assert not [f for f in os.listdir(sharded) if f.endswith(".partial")]
    n = len(files)
    assert all(f.startswith("model-") and f.endswith(f"-of-{n:05d}.safetensors") for f in files)
    whole = load_file(os.path.join(single, "model.safetensors"))
    parts = {}
    for f in files:
        tensors = load_file(os.path.join(sharded, f))
        assert set(tensors) == {k for k, v in index["weight_map"].items() if v == f}
        # At most the shard size unless one tensor alone is larger.
        size = sum(t.numel() * t.element_size() for t in tensors.values())
        assert size <= 256 << 10 or len(tensors) == 1, (f, size)
        parts.update(tensors)
    assert set(parts) == set(whole) and info["num_tensors"] == len(whole)
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size()
                                                  for t in parts.values())
    silent = [tiny.byte_level_tokenizer(tiny.SENSENOVA_SPECIAL_TOKENS).convert_tokens_to_ids(t)
              for t in serve.SILENT]
    head = "language_model.lm_head.weight"
    for name, t in whole.items():
        if name != head:
            assert torch.equal(parts[name], t), name
    assert torch.equal(parts[head][silent], torch.zeros_like(parts[head][silent]))
    keep = [i for i in range(whole[head].shape[0]) if i not in silent]
    assert torch.equal(parts[head][keep], whole[head][keep])
    assert whole[head][silent].abs().sum() > 0  # silencing changed something


def test_sharded_checkpoint_loads_through_vllm_omni_and_never_picks_an_end_token(checkpoints):
    """vLLM-Omni's loader reads the shards through their index: every parameter as from the
    single file, but the end tokens' ``lm_head`` rows, which are zero (logit 0 whatever the
    hidden state)."""
    from vllm_omni_graphdecode.testing import sensenova as rm

    single, sharded, _ = checkpoints
    a = rm.load_sensenova_pipeline(single)
    b = rm.load_sensenova_pipeline(sharded)
    pa, pb = dict(a.named_parameters()), dict(b.named_parameters())
    assert set(pa) == set(pb)
    head = "language_model.lm_head.weight"
    silent = [b.tokenizer.convert_tokens_to_ids(t) for t in serve.SILENT]
    for name in pa:
        if name != head:
            torch.testing.assert_close(pb[name], pa[name], rtol=0, atol=0, msg=name)
    assert torch.count_nonzero(pb[head][silent]) == 0
    keep = torch.ones(pb[head].shape[0], dtype=torch.bool)
    keep[silent] = False
    torch.testing.assert_close(pb[head][keep], pa[head][keep], rtol=0, atol=0)


def test_every_id_of_the_released_vocabulary_decodes_and_prompts_encode_as_before():
    """At the released vocabulary (151,936 ids) the tokenizer's fillers make an answer of random
    ids decode to text (without them, ids past the 264 bytes and special tokens decode to
    nothing, and every text answer at the released shape compared equal as an empty string),
    while the special tokens keep their ids and a chat prompt encodes to the same ids."""
    import random

    bare = tiny.byte_level_tokenizer(tiny.SENSENOVA_SPECIAL_TOKENS,
                                     chat_template=tiny.QWEN_CHAT_TEMPLATE)
    full = tiny.byte_level_tokenizer(tiny.SENSENOVA_SPECIAL_TOKENS,
                                     chat_template=tiny.QWEN_CHAT_TEMPLATE, vocab_size=151936)
    assert len(bare) == 264 and len(full) == 151936
    for token in tiny.SENSENOVA_SPECIAL_TOKENS:
        assert full.convert_tokens_to_ids(token) == bare.convert_tokens_to_ids(token), token
    assert (full.eos_token_id, full.pad_token_id) == (bare.eos_token_id, bare.pad_token_id)
    prompt = [{"role": "user", "content": driver.load_prompt(2, 500) + " <w300> \u00fc\n\n"}]
    ids = [bare.apply_chat_template(prompt, add_generation_prompt=True, tokenize=False)]
    assert full(ids)["input_ids"] == bare(ids)["input_ids"]
    assert max(full(ids)["input_ids"][0]) < 264  # bytes and special tokens only
    picked = random.Random(0).sample(range(264, 151936), 64)
    assert bare.decode(picked, skip_special_tokens=True) == ""
    text = full.decode(picked, skip_special_tokens=True)
    assert text == "".join(f"<w{i}>" for i in picked)
    assert full.decode(picked[:3] + picked[:1]) != full.decode(picked[:4])  # ids tell apart
    with pytest.raises(ValueError, match="vocab_size 100"):
        tiny.byte_level_tokenizer(tiny.SENSENOVA_SPECIAL_TOKENS, vocab_size=100)


def test_the_checkpoints_tokenizer_covers_its_models_vocabulary(checkpoints):
    from transformers import AutoTokenizer

    single, sharded, _ = checkpoints
    for path in (single, sharded):
        with open(os.path.join(path, "config.json")) as f:
            vocab = json.load(f)["llm_config"]["vocab_size"]
        tokenizer = AutoTokenizer.from_pretrained(path)
        assert len(tokenizer) == vocab, path
        assert tokenizer.decode([vocab - 1]) == f"<w{vocab - 1}>"


def test_cfg_and_overrides_together_are_refused(tmp_path):
    with pytest.raises(TypeError, match="num_layers"):
        tiny.write_sensenova_u1(str(tmp_path / "x"), cfg=tiny.sensenova_config(384), num_layers=3)


def test_load_prompts_are_distinct_and_of_the_asked_length():
    prompts = [driver.load_prompt(i, 500) for i in range(16)]
    assert len(set(prompts)) == 16
    assert all(len(p.encode()) == 500 for p in prompts)
    assert driver.load_prompt(3, 500) == prompts[3]  # the same in every run
    assert len(driver.load_prompt(0, 7)) == 7


def _answers(kind: str, n: int):
    """``n`` callables shaped like the driver's request functions (their return value's keys,
    the i-th reporting ``i + 1`` seconds), each returning only once all ``n`` are running: they
    finish only if they were sent at once (a barrier, not a clock)."""
    import threading

    import numpy as np

    together = threading.Barrier(n, timeout=60)

    def one(i):
        together.wait()  # BrokenBarrierError unless all n run at the same time
        if kind == "text":
            return {"text": f"answer {i} " * 40, "s": float(i + 1)}
        return {"think_text": "t" * (300 + i), "s": float(i + 1),
                "image": np.full((16, 16, 3), i, dtype=np.uint8)}
    return [(lambda i=i: one(i)) for i in range(n)]


def test_loaded_sends_all_at_once_and_records_each_latency_the_wall_time_and_no_pixels():
    text = driver._loaded(_answers("text", 4))
    assert len(text["answers"]) == 4 and text["latency_s"] == [1.0, 2.0, 3.0, 4.0]
    assert isinstance(text["wall_s"], float) and text["wall_s"] >= 0  # recorded, not judged
    assert text["answers"][0]["text_chars"] == len("answer 0 " * 40)
    assert len(text["answers"][0]["text"]) == 200
    think = driver._loaded(_answers("think", 2))
    first = think["answers"][0]
    assert "image" not in first and first["image_shape"] == [16, 16, 3]
    assert first["think_chars"] == 300 and len(first["think_text"]) == 200
    assert think["answers"][0]["image_sha256"] != think["answers"][1]["image_sha256"]
    json.dumps(think)  # what result.json holds


def _side(text_wall, think_wall, text_lat, think_lat, counters=None):
    def kind(wall, lat):
        return {"wall_s": wall, "latency_s": lat, "answers": [{"s": s} for s in lat]}
    snaps = [{"counters": counters, "fallbacks": {}}] if counters else []
    return {"rc": 0, "result": {"requests": {
        "sensenova_load_warmup": {"wall_s": 1.0, "latency_s": [1.0], "answers": [{}]},
        "sensenova_load_text_2": kind(text_wall, text_lat),
        "sensenova_load_think_2": kind(think_wall, think_lat)}, "final_stats": snaps}}


def test_rows_compare_the_two_sides_wall_times_and_latencies():
    args = serve.argparse.Namespace(n=2, size=1024)
    sides = {"release": _side(10.0, 40.0, [5.0, 10.0], [20.0, 40.0]),
             "plugin": _side(2.0, 16.0, [2.0, 2.0], [15.0, 16.0],
                             {"sensenova_u1.batch_forward": 3, "sensenova_u1.batch_requests": 5,
                              "sensenova_u1.graph_replay": 9})}
    rows = {r["case"]: r for r in serve.rows(sides, args)}
    assert set(rows) == {"sensenova_serve_text_n2", "sensenova_serve_think_t2i_1024_n2"}
    think = rows["sensenova_serve_think_t2i_1024_n2"]
    assert (think["eager_ms"], think["ours_ms"], think["speedup"]) == (40000, 16000, 2.5)
    assert (think["eager_p50_ms"], think["eager_p99_ms"]) == (40000, 40000)
    assert (think["ours_p50_ms"], think["ours_p99_ms"]) == (16000, 16000)
    assert think["plugin_counters_whole_run"] == {"sensenova_u1.batch_forward": 3,
                                                  "sensenova_u1.batch_requests": 5}
    assert rows["sensenova_serve_text_n2"]["speedup"] == 5.0
    # One side alone: its column, no ratio.
    only = {r["case"]: r for r in serve.rows({"release": sides["release"]}, args)}
    assert only["sensenova_serve_text_n2"]["ours_ms"] is None
    assert only["sensenova_serve_text_n2"]["speedup"] is None


def test_step_side_rows_compare_continuous_batching_with_the_release():
    """The ``step`` side (``--step-execution``): rows of their own, ``_step``, against the same
    release, with the step counters; request mode's rows stay as they were."""
    args = serve.argparse.Namespace(n=2, size=1024)
    sides = {"release": _side(10.0, 40.0, [5.0, 10.0], [20.0, 40.0]),
             "plugin": _side(2.0, 16.0, [2.0, 2.0], [15.0, 16.0]),
             "step": _side(2.5, 20.0, [2.0, 2.5], [10.0, 20.0],
                           {"sensenova_u1.step_tick": 700, "sensenova_u1.step_request": 4,
                            "sensenova_u1.batch_forward": 1, "sensenova_u1.graph_replay": 9})}
    rows = {r["case"]: r for r in serve.rows(sides, args)}
    assert set(rows) == {"sensenova_serve_text_n2", "sensenova_serve_think_t2i_1024_n2",
                         "sensenova_serve_text_n2_step", "sensenova_serve_think_t2i_1024_n2_step"}
    step = rows["sensenova_serve_think_t2i_1024_n2_step"]
    assert (step["eager_ms"], step["ours_ms"], step["speedup"]) == (40000, 20000, 2.0)
    assert (step["ours_p50_ms"], step["ours_p99_ms"]) == (20000, 20000)
    assert step["plugin_counters_whole_run"] == {"sensenova_u1.step_tick": 700,
                                                 "sensenova_u1.step_request": 4}
    assert rows["sensenova_serve_think_t2i_1024_n2"]["speedup"] == 2.5
    without = {r["case"] for r in serve.rows({"release": sides["release"]}, args)}
    assert without == {"sensenova_serve_text_n2", "sensenova_serve_think_t2i_1024_n2"}


def test_step_side_starts_the_server_with_step_execution(tmp_path, monkeypatch):
    """What the ``step`` server is started with: the plugin on, ``--step-execution`` and at
    least 16 rows, as users start continuous batching."""
    seen = {}

    def fake_driver(cmd, env, out, label):
        seen.update(cmd=cmd, env=env)
        return 0, 1.0, None

    monkeypatch.setattr(serve, "run_driver", fake_driver)
    args = serve.argparse.Namespace(out=str(tmp_path), n=8, size=1024, steps=50, text_tokens=16,
                                    text_prompt_chars=100, init_timeout=60, request_timeout=60,
                                    batch_wait_ms=0.0, plugin_env=[])
    side = serve.run_side("step", args, str(tmp_path / "ckpt"))
    assert side["serve_args"] == serve.MODEL_ARGS + ["--step-execution", "--max-num-seqs", "16"]
    assert seen["env"]["VLLM_OMNI_GRAPHDECODE"] == "1"
    assert "--serve-arg=--step-execution" in seen["cmd"]


def test_plugin_env_reaches_the_plugins_servers_only_and_is_named_in_the_rows(tmp_path,
                                                                              monkeypatch):
    """``--plugin-env VLLM_OMNI_GRAPHDECODE_SENSENOVA_STEP=rowgemv``: the step server starts with
    it, the release's without any plugin setting, and the rows name it."""
    seen = {}

    def fake_driver(cmd, env, out, label):
        seen[label] = env
        return 0, 1.0, None

    monkeypatch.setattr(serve, "run_driver", fake_driver)
    monkeypatch.setenv("VLLM_OMNI_GRAPHDECODE_FP8", "all")  # the caller's own: never passed on
    out = tmp_path / "out"
    argv = ["--out", str(out), "--sides", "release,step", "--tiny", "--device", "cpu", "--n", "2",
            "--checkpoint", str(tmp_path / "ckpt"),
            "--plugin-env", "VLLM_OMNI_GRAPHDECODE_SENSENOVA_STEP=rowgemv"]
    assert serve.main(argv) == 0
    assert seen["step"]["VLLM_OMNI_GRAPHDECODE_SENSENOVA_STEP"] == "rowgemv"
    assert "VLLM_OMNI_GRAPHDECODE_FP8" not in seen["step"]
    assert seen["release"]["VLLM_OMNI_GRAPHDECODE"] == "0"
    assert not any(k.startswith("VLLM_OMNI_GRAPHDECODE_") for k in seen["release"])
    record = json.loads((out / "sensenova-serve.json").read_text())
    assert record["sides"]["step"]["env"]["VLLM_OMNI_GRAPHDECODE_SENSENOVA_STEP"] == "rowgemv"
    assert serve.rows(record["sides"], serve.argparse.Namespace(n=2, size=1024)) == []  # no result
    side = _side(10.0, 40.0, [5.0, 10.0], [20.0, 40.0])
    rows = serve.rows({"release": side, "step": {**side, "env": record["sides"]["step"]["env"]}},
                      serve.argparse.Namespace(n=2, size=1024))
    assert rows and all(r["plugin_env"] == {"VLLM_OMNI_GRAPHDECODE_SENSENOVA_STEP": "rowgemv"}
                        for r in rows if r["case"].endswith("_step"))


@pytest.mark.parametrize("argv, message", [
    (["--plugin-env", "SENSENOVA_STEP=rowgemv"],
     "--plugin-env 'SENSENOVA_STEP=rowgemv': expected VLLM_OMNI_GRAPHDECODE_NAME=VALUE"),
    (["--plugin-env", "VLLM_OMNI_GRAPHDECODE_STATS_FILE=/x"],
     "NAME not one this benchmark sets (VLLM_OMNI_GRAPHDECODE_STATS_FILE)"),
    (["--sides", "release,turbo"],
     "--sides release,turbo: unknown ['turbo']; accepted: release, plugin, step"),
    (["--tiny", "--size", "40"], "--size 40: the tiny model needs a multiple of 16"),
])
def test_bad_arguments_name_the_value_and_what_is_accepted(tmp_path, capsys, argv, message):
    with pytest.raises(SystemExit) as exc:
        serve.main(["--out", str(tmp_path)] + argv)
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


def test_a_run_without_sides_writes_the_checkpoint_and_an_empty_record(tmp_path):
    """``--sides ''`` (the session's first step): the checkpoint only, written once."""
    out, ckpt = str(tmp_path / "out"), str(tmp_path / "ckpt")
    argv = ["--out", out, "--sides", "", "--tiny", "--device", "cpu", "--checkpoint", ckpt]
    assert serve.main(argv) == 0
    with open(os.path.join(out, "sensenova-serve.json")) as f:
        record = json.load(f)
    assert record["environment"]["checkpoint"]["written"] is True
    assert record["cases"] == [] and record["sides"] == {}
    assert os.path.exists(os.path.join(ckpt, "model.safetensors.index.json"))
    assert serve.main(argv) == 0
    with open(os.path.join(out, "sensenova-serve.json")) as f:
        again = json.load(f)
    assert again["environment"]["checkpoint"] == {"path": ckpt, "written": False}
    assert len(again["environment"]["commands"]) == 2


def test_each_side_records_the_versions_it_ran_on(tmp_path, monkeypatch):
    """The sides of one file may run in separate calls (the release on another torch): each
    side keeps the versions and GPU of its own run, not only the file's last."""
    monkeypatch.setattr(serve, "run_driver", lambda cmd, env, out, label: (0, 1.0, None))
    out = tmp_path / "out"
    argv = ["--out", str(out), "--sides", "step", "--tiny", "--device", "cpu", "--n", "2",
            "--checkpoint", str(tmp_path / "ckpt")]
    assert serve.main(argv) == 0
    record = json.loads((out / "sensenova-serve.json").read_text())
    machine = record["sides"]["step"]["machine"]
    assert machine["versions"] == record["environment"]["versions"]
    assert machine["versions"]["torch"] and set(machine) == {"gpu", "memory_mib", "driver",
                                                             "versions"}
    record["environment"]["versions"] = {"torch": "another"}  # a later call on another stack
    (out / "sensenova-serve.json").write_text(json.dumps(record))
    assert serve.main(argv[:3] + ["", *argv[4:]]) == 0
    again = json.loads((out / "sensenova-serve.json").read_text())
    assert again["sides"]["step"]["machine"] == machine


def test_release_side_from_an_earlier_file_is_recorded_as_such(tmp_path):
    """``--release-from FILE --sides ''``: the rows take FILE's release side, and say so."""
    earlier = tmp_path / "earlier.json"
    earlier.write_text(json.dumps({"environment": {"commands": ["python3 x --sides release"]},
                                   "sides": {"release": _side(10.0, 40.0, [5.0, 10.0],
                                                              [20.0, 40.0])}, "cases": []}))
    out = tmp_path / "out"
    argv = ["--out", str(out), "--sides", "", "--tiny", "--device", "cpu", "--n", "2",
            "--checkpoint", str(tmp_path / "ckpt"), "--release-from", str(earlier)]
    assert serve.main(argv) == 0
    record = json.loads((out / "sensenova-serve.json").read_text())
    assert record["environment"]["release_from"]["file"] == str(earlier)
    rows = {r["case"]: r for r in record["cases"]}
    assert rows["sensenova_serve_think_t2i_1024_n2"]["eager_ms"] == 40000
    with pytest.raises(SystemExit):
        serve.main(argv[:3] + ["release"] + argv[4:])


def test_without_tiny_the_checkpoint_takes_the_released_config(tmp_path, monkeypatch):
    """Not ``--tiny``: the checkpoint is written from ``sensenova_request.real_config()`` (here
    stood in by a 3-layer config, which the CPU can draw; the released shape is ~35 GB)."""
    import sensenova_request as sr

    small = tiny.sensenova_config(384, num_layers=3)
    monkeypatch.setattr(sr, "real_config", lambda: small)
    info = serve.write_checkpoint(str(tmp_path / "ckpt"), tiny=False, device="cpu")
    assert info["written"] is True
    with open(tmp_path / "ckpt" / "config.json") as f:
        assert json.load(f)["llm_config"]["num_hidden_layers"] == 3
    tiny_info = serve.write_checkpoint(str(tmp_path / "tiny"), tiny=True, device="cpu")
    with open(tmp_path / "tiny" / "config.json") as f:
        assert json.load(f)["llm_config"]["num_hidden_layers"] == 2
    assert info["num_tensors"] > tiny_info["num_tensors"]
