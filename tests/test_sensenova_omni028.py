"""The backport patches applied to vllm-omni 0.28.0's real SenseNova-U1 code, on CPU.

vllm-omni 0.28.0's source is unpacked beside the test venv (``$VENV/omni-0.28.0``, by
``scripts/setup_env.sh``), not installed. This test runs this same file as a child process with
that tree first on ``sys.path``, so ``vllm_omni`` there is 0.28's, on the venv's vllm 0.30 (its
SenseNova-U1 modules import and run there; vllm-omni only warns about the version pair). The
child builds the tiny model from 0.28's classes and reports JSON; the test asserts on it.

0.24 and 0.26 carry the same SenseNova-U1 code as 0.28 (compared as syntax trees when this backport was written);
0.26 itself is exercised on the GPU host (test_sensenova_gpu.py).
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
OMNI_028 = Path(sys.prefix) / "omni-0.28.0"


@pytest.fixture(scope="module")
def report():
    if not (OMNI_028 / "vllm_omni").is_dir():
        pytest.skip(f"vllm-omni 0.28.0 source not found at {OMNI_028} (scripts/setup_env.sh "
                    f"unpacks it)")
    env = dict(os.environ, PYTHONPATH="", VLLM_OMNI_GRAPHDECODE="0")
    proc = subprocess.run([sys.executable, str(Path(__file__)), "--child", str(OMNI_028)],
                          capture_output=True, text=True, env=env, timeout=900)
    lines = [l for l in proc.stdout.splitlines() if l.startswith("REPORT ")]
    assert proc.returncode == 0 and lines, proc.stdout[-3000:] + proc.stderr[-6000:]
    return json.loads(lines[-1][len("REPORT "):])


def test_child_imported_vllm_omni_028_sources(report):
    assert report["omni_version"] == "0.28.0"
    assert "omni-0.28.0" in report["pipeline_file"]


def test_028_layout_is_the_backport_and_single_token_mask_is_zeros_not_none(report):
    assert report["layout"] == "backport"
    # Why the paged branch is keyed on the plugin's own keyword: 0.28 hands attention an
    # all-zeros mask for one query token, never None.
    assert report["decode_mask"] == "zeros"


def test_028_paged_think_matches_eager_across_bucket_and_tail(report):
    r = report["think"]
    assert r["same_text"] and r["same_t_idx"] and r["steps"] == 70
    assert r["max_logit_diff"] < 1e-4 and r["max_cache_diff"] < 1e-5
    assert r["capacity"] == 96 and r["paged_requests"] == 1 and r["fallbacks"] == {}


def test_028_think_in_multi_token_launches_matches_eager(report):
    k8 = report["think_k8"]
    assert k8["same_text"] and k8["same_t_idx"] and k8["max_cache_diff"] < 1e-4
    assert k8["launches"] > 0 and k8["fallbacks"] == {}


def test_028_paged_text_matches_eager(report):
    assert report["text"]["same"] and report["text"]["paged_steps"] == 70


def test_028_sleep_level_2_clear_releases_through_graph_runners(report):
    r = report["sleep"]
    assert r["runner_has_release_method"] is False
    assert r["worker_sleep_clears_graph_runners"] is True
    assert r["released"] and r["after_release_matches_eager"]


def test_028_fused_step_equals_the_models_own_step(report):
    r = report["fused"]
    # Same math in fp32 (plain-torch kernels): equal to rounding of the fp32 sums.
    assert r["steps"] == 70 and r["max_logit_diff"] < 1e-5 and r["max_cache_diff"] < 1e-6
    # Rope tables: once per step (t once, h and w once each) instead of once per layer.
    assert r["rope_calls_last_step"]["fused"] == {"rotary_emb": 1, "rotary_emb_hw": 2}
    assert r["rope_calls_last_step"]["plain"] == {"rotary_emb": r["layers"],
                                                  "rotary_emb_hw": 2 * r["layers"]}
    assert r["describe"] == "rope once per step + fused norms + SiLU"
    assert not r["cpu_fused"] and "not CUDA" in " ".join(r["cpu_reasons"])


def test_028_moved_signature_is_refused_untouched(report):
    r = report["refused"]
    assert "_ar_step: expected (self, next_token" in r["message"] and r["untouched"]


# ---------------------------------------------------------------------------------- the child

def test_028_denoising_branch_steps_equal_the_pipelines_own(report):
    """vllm-omni 0.28's layout computes the rope tables in every layer; the plugin's generation
    forward must still equal the pipeline's (three steps of each of the two CFG branches)."""
    r = report["denoise"]
    assert "image denoising: each CFG branch's step replayed" in r["summary"], r["summary"]
    assert r["steps"] == r["eager_steps"] == 6 and r["equal"]
    assert r["static_steps"] == 6 and r["fallbacks"] == {}


def test_028_step_execution_serves_requests_that_join_each_as_alone(report):
    """vllm-omni 0.28's step engine parts (its scheduler, its runner's stepwise path) and 0.28's
    pipeline with the plugin's continuous batching (issue #41)."""
    r = report["steps"]
    assert "step execution declared" in r["declared"], r["declared"]
    assert "admits" in r["widened"]
    assert r["equal"] and r["requests"] == 3 and r["shared_launches"]
    assert r["fallbacks"] == {}


def _method_source(path: Path, cls: str, name: str) -> str:
    """A method's source read from the file: 0.28's worker module itself does not import on
    vllm 0.30 (it needs ``vllm.inputs.preprocess``), and only its text is needed here."""
    import ast

    text = path.read_text()
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.ClassDef) and node.name == cls:
            for item in node.body:
                if isinstance(item, ast.FunctionDef) and item.name == name:
                    return ast.get_source_segment(text, item) or ""
    return ""


def _fused_vs_plain(st, hook, kernels, lm, tok, ids) -> dict:
    """The fused step (rope tables once per step, fused norms + SiLU) with plain-torch kernels
    against the model's own step, both paged, same tokens: the same math, so equal in fp32."""
    import torch

    from vllm_omni_graphdecode.testing.fused_reference import reference_fusion

    pipe = st.build_pipeline(lm, tok)
    out, cache_fused, t_idx = st.prefill(pipe, ids)
    _, cache_plain, _ = st.prefill(pipe, ids)
    fused = hook.paged_decoder(lm, kernel=kernels.REFERENCE, buckets=(32, 64), graphs=False,
                               fusion=reference_fusion(lm), kv_writer=None)
    plain = hook.paged_decoder(lm, kernel=kernels.REFERENCE, buckets=(32, 64), graphs=False,
                               fusion=None, kv_writer=None)
    calls = {"rotary_emb": 0, "rotary_emb_hw": 0}
    handles = []
    for layer in lm.model.layers:
        for name in calls:
            def count(*_, name=name):
                calls[name] += 1
            handles.append(getattr(layer.self_attn, name).register_forward_hook(count))
    fused.begin(cache_fused)
    plain.begin(cache_plain)
    token = out.logits[:, -1].argmax(-1)
    diffs, per_step = [], {}
    with torch.inference_mode():
        for step in range(70):  # 20 + 70 tokens: buckets 32 -> 64 -> tail
            before = dict(calls)
            a = fused.step(token, t_idx + 1 + step).clone()
            per_step["fused"] = {n: calls[n] - before[n] for n in calls}
            before = dict(calls)
            b = plain.step(token, t_idx + 1 + step)
            per_step["plain"] = {n: calls[n] - before[n] for n in calls}
            diffs.append((a - b).abs().max().item())
            token = a[:, -1].argmax(-1)
    for h in handles:
        h.remove()
    fused.write_back(cache_fused)
    plain.write_back(cache_plain)
    cache_diff = max(max((x.keys - y.keys).abs().max().item(),
                         (x.values - y.values).abs().max().item())
                     for x, y in zip(cache_fused.layers, cache_plain.layers))
    on_cpu = hook.Fusion.select(lm, hook.detect_layout(lm), "cpu")
    result = {"max_logit_diff": max(diffs), "steps": len(diffs), "max_cache_diff": cache_diff,
              "rope_calls_last_step": per_step, "layers": len(lm.model.layers),
              "describe": " + ".join(fused.model.fusion.describe()),
              "cpu_reasons": on_cpu.reasons, "cpu_fused": on_cpu.active}
    fused.release()
    plain.release()
    return result


def _child(omni_path: str) -> dict:
    sys.path[:0] = [omni_path, str(REPO), str(HERE)]
    import torch

    from vllm_omni_graphdecode import config
    from vllm_omni_graphdecode.core import stats
    from vllm_omni_graphdecode.core.patching import HookRefused
    from vllm_omni_graphdecode.hooks import sensenova_u1 as hook
    from vllm_omni_graphdecode.ops import attention as kernels
    from vllm_omni_graphdecode.testing import sensenova as st, common

    settings = {"VLLM_OMNI_GRAPHDECODE": "sensenova_u1",
                "VLLM_OMNI_GRAPHDECODE_BUCKETS": "32,64",
                "VLLM_OMNI_GRAPHDECODE_PRECAPTURE_BUCKETS": "32",
                # every step's logits are compared: one launch per token returns them
                "VLLM_OMNI_GRAPHDECODE_TOKENS_PER_LAUNCH": "1"}
    cfg = config.parse(settings)
    tok = st.build_tokenizer()
    lm = st.build_lm(banned_ids=st.stop_ids(tok))
    ids = st.prompt_ids(tok, 20)
    out = {"omni_version": common.omni_version(), "pipeline_file": st.pipeline_module().__file__}

    def paged(runner=None):
        pipe = st.build_pipeline(lm, tok)
        hook.install(pipe, cfg, runner, kernel=kernels.REFERENCE, graphs=False)
        return pipe

    eager = st.build_pipeline(lm, tok)
    out["layout"] = hook.detect_layout(lm, type(eager)).name

    masks = []
    attn = lm.model.layers[0].self_attn
    handle = attn.register_forward_pre_hook(
        lambda m, a, kw: masks.append(kw.get("attention_mask")), with_kwargs=True)
    _, cache, t_idx = st.prefill(eager, ids)
    with torch.inference_mode():
        eager._ar_step(torch.tensor([5]), t_idx, cache)
    handle.remove()
    mask = masks[-1]
    out["decode_mask"] = ("none" if mask is None else
                          "zeros" if not bool(mask.abs().sum()) else "nonzero")

    e_logits = st.record_ar_steps(eager)
    want = st.run_think(eager, ids, 70)
    stats.reset()
    pipe = paged()
    p_logits = st.record_ar_steps(pipe)
    got = st.run_think(pipe, ids, 70)
    out["think"] = {
        "same_text": got[2] == want[2], "same_t_idx": got[1] == want[1], "steps": len(p_logits),
        "max_logit_diff": max((a - b).abs().max().item() for a, b in zip(p_logits, e_logits)),
        "max_cache_diff": max(max((a.keys - b.keys).abs().max().item(),
                                  (a.values - b.values).abs().max().item())
                              for a, b in zip(got[0].layers, want[0].layers)),
        "capacity": getattr(pipe, hook.STATE_ATTR).decoder.cache.capacity,
        "paged_requests": stats.get(hook.MODEL, "paged_request"),
        "fallbacks": stats.fallbacks(hook.MODEL),
    }

    stats.reset()
    pipe = st.build_pipeline(lm, tok)
    hook.install(pipe, config.parse({**settings, "VLLM_OMNI_GRAPHDECODE_TOKENS_PER_LAUNCH": "8"}),
                 None, kernel=kernels.REFERENCE, graphs=False)
    got = st.run_think(pipe, ids, 70)
    out["think_k8"] = {
        "same_text": got[2] == want[2], "same_t_idx": got[1] == want[1],
        "max_cache_diff": max(max((a.keys - b.keys).abs().max().item(),
                                  (a.values - b.values).abs().max().item())
                              for a, b in zip(got[0].layers, want[0].layers)),
        "launches": stats.get(hook.MODEL, "token_launch"),
        "fallbacks": stats.fallbacks(hook.MODEL),
    }

    stats.reset()
    out["text"] = {"same": st.run_text(paged(), ids, 70) == st.run_text(eager, ids, 70),
                   "paged_steps": stats.get(hook.MODEL, "paged_eager_step")}

    out["fused"] = _fused_vs_plain(st, hook, kernels, lm, tok, ids)

    from vllm_omni.diffusion.worker.diffusion_model_runner import DiffusionModelRunner

    runner = object.__new__(DiffusionModelRunner)
    pipe = paged(runner)
    st.run_think(pipe, ids, 40)
    state = getattr(pipe, hook.STATE_ATTR)
    had = state.decoder is not None and state.decoder.nbytes > 0
    if hasattr(runner, "graph_runners"):  # DiffusionWorker.sleep(level=2), verbatim
        runner.graph_runners.clear()
    released = had and state.decoder is None
    again = st.run_think(pipe, ids, 40)
    ref = st.run_think(eager, ids, 40)
    out["sleep"] = {
        "runner_has_release_method": hasattr(DiffusionModelRunner, "release_captured_graphs"),
        "worker_sleep_clears_graph_runners": "model_runner.graph_runners.clear()" in
            _method_source(Path(omni_path) / "vllm_omni/diffusion/worker/diffusion_worker.py",
                           "DiffusionWorker", "sleep"),
        "released": released,
        "after_release_matches_eager": again[2] == ref[2] and again[1] == ref[1],
    }
    base = st.pipeline_module().SenseNovaU1Pipeline

    class Moved(base):
        def _ar_step(self, token, position, cache):
            return base._ar_step(self, token, position, cache)

    fresh = st.build_lm(banned_ids=st.stop_ids(tok))
    pipe = st.build_pipeline(fresh, tok, cls=Moved)
    try:
        hook.install(pipe, cfg, None)
        message = ""
    except HookRefused as exc:
        message = str(exc)
    out["refused"] = {
        "message": message,
        "untouched": "_ar_step" not in vars(pipe)
        and all("forward_und" not in vars(l.self_attn) and "_forward_und" not in vars(l)
                for l in fresh.model.layers),
    }
    out["denoise"] = _denoise_vs_eager(st, hook, kernels, config, stats)
    out["steps"] = _step_execution(st, hook, config, stats)
    return out


def _denoise_vs_eager(st, hook, kernels, config, stats) -> dict:
    """0.28's whole pipeline from the tiny checkpoint: every denoising branch step through the
    plugin's static-buffer step (the backport layout: rope tables in every layer) against the
    pipeline's own, for a text-to-image request with CFG 4 (cond and uncond branches; 0.28's CFG
    mixin asks for vllm-omni's classifier-free-guidance group, which ``setup_runtime`` makes)."""
    import tempfile

    import torch

    tmp = st.write_tiny_checkpoints(tempfile.mkdtemp(prefix="omni028_ckpt_"))
    ckpt = os.path.join(tmp, "sensenova_u1")
    request = st.image_request(num_steps=3)

    def run(pipe):
        return st.generate_image(pipe, request)[1]

    want = run(st.load_sensenova_pipeline(ckpt, dtype=torch.bfloat16))
    stats.reset()
    pipe = st.load_sensenova_pipeline(ckpt, dtype=torch.bfloat16)
    summary = hook.install(pipe, config.parse({"VLLM_OMNI_GRAPHDECODE": "sensenova_u1",
                                               "VLLM_OMNI_GRAPHDECODE_SENSENOVA_DENOISE": "graph"}),
                           None, kernel=kernels.REFERENCE, graphs=False, image_graphs=False)
    got = run(pipe)
    return {"summary": summary, "steps": len(got), "eager_steps": len(want),
            "equal": len(got) == len(want) and all(torch.equal(a, b) for a, b in zip(got, want)),
            "static_steps": stats.get("sensenova_u1_image", "static_step"),
            "fallbacks": stats.fallbacks("sensenova_u1_image")}


def _step_execution(st, hook, config, stats) -> dict:
    """0.28's own step engine parts (its ``StepScheduler``, its runner's stepwise path) around
    0.28's pipeline from the tiny checkpoint, with the plugin's step execution: a text answer
    and an image start together, a second text answer joins two steps later; each answer
    against the same request alone in request mode."""
    import tempfile

    import torch

    from vllm_omni.diffusion.sched import step_scheduler
    from vllm_omni_graphdecode.decode.batch import kv as batch_kv
    from vllm_omni_graphdecode.hooks.sensenova_u1 import steps

    from test_sensenova_batch import _answer, _batch, _request

    cfg = config.parse({"VLLM_OMNI_GRAPHDECODE": "sensenova_u1",
                        "VLLM_OMNI_GRAPHDECODE_SENSENOVA_DENOISE": "off",
                        "VLLM_OMNI_GRAPHDECODE_BUCKETS": "64,128",
                        "VLLM_OMNI_GRAPHDECODE_PRECAPTURE_BUCKETS": "64",
                        "VLLM_OMNI_GRAPHDECODE_TOKENS_PER_LAUNCH": "4"})
    tmp = st.write_tiny_checkpoints(tempfile.mkdtemp(prefix="omni028_steps_"))
    ckpt = os.path.join(tmp, "sensenova_u1")
    pipe = st.load_sensenova_pipeline(ckpt, dtype=torch.float32)
    declared = hook.declare_batching(st.pipeline_module(), cfg)
    hook.install(pipe, cfg, None, rows=4, batch_attention=batch_kv.REFERENCE, graphs=False,
                 image_graphs=False)
    widened = steps.widen_step_admission(step_scheduler, cfg)
    requests = [_request(0, "a text answer", text=16), _request(1, "a plain image"),
                _request(2, "joins later", text=24)]
    alone = {r.request_id: _answer(pipe.forward(_batch([r]))) for r in requests}
    stats.reset()
    server = st.StepServer(pipe, max_num_seqs=4)
    server.add(requests[0])
    server.add(requests[1])
    server.tick()
    server.tick()
    server.add(requests[2])
    together = {rid: _answer(o) for rid, o in server.run().items()}
    return {"declared": declared, "widened": widened, "equal": together == alone,
            "requests": len(together), "shared_launches":
            stats.get("sensenova_u1", "batch_rows") > stats.get("sensenova_u1", "batch_launch"),
            "fallbacks": stats.fallbacks("sensenova_u1")}


if __name__ == "__main__" and sys.argv[1:2] == ["--child"]:
    print("REPORT " + json.dumps(_child(sys.argv[2])), flush=True)
