"""SenseNova-U1 requests decoding together (issue #22), on the GPU host: vllm-omni's real pipeline
from the tiny checkpoint, bf16 on CUDA, the batched step captured as CUDA graphs with vLLM's Triton
decode attention (``batch_kv``).

The claims, each a test below:

* a request's answer in a batch is its answer alone, bit for bit (text, think text, image), in
  whatever row it lands: the step runs at a fixed row count and every kernel reduces a row on its
  own;
* the batched step's logits are the pipeline's eager step's within the fused step's bound (3% of
  the largest logit, the bound ``tests/test_sensenova_gpu.py`` holds the batch-1 fused step to);
  the greedy tokens agree except after a near tie;
* a captured launch equals the same launch run eagerly, token for token;
* with ``..._SENSENOVA_STEP=rowgemv`` the batched step's linear layers read the plugin's 16-row
  GEMM, and the claims above hold for it too;
* the same requests give the same answers in two processes (batched, and the batch-1 path with
  its tuned GEMVs);
* base -> LoRA -> base: the last base answer is the first one;
* device memory is flat from batch 5 to batch 20, every batch after the first on the worker
  threads the first made (no new cuBLAS handle, and no new 32 MiB workspace).
"""

import gc
import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch

from vllm_omni_graphdecode import config
from vllm_omni_graphdecode.core import stats
from vllm_omni_graphdecode.decode.batch import kv as batch_kv, turns, workers
from vllm_omni_graphdecode.decode.batch.decoder import BatchDecoder
from vllm_omni_graphdecode.decode.sampling import RowSampling
from vllm_omni_graphdecode.hooks import sensenova_u1 as hook
from vllm_omni_graphdecode.hooks.sensenova_u1 import batch as batch_mod
from vllm_omni_graphdecode.testing import sensenova as rm, common

from test_sensenova_batch import _answer, _batch, _request  # noqa: F401 (shared request builders)
from test_sensenova_denoise import checkpoint  # noqa: F401 - the tiny checkpoint fixture

pytestmark = pytest.mark.gpu

MODEL = hook.MODEL
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TIE = 0.125  # bf16 logits: a top-2 gap this small may flip between attention kernels
BOUND = 0.03  # of the largest eager logit: the fused step's bound


def _cfg(**env):
    return config.parse(common.with_suite_overrides({
        "VLLM_OMNI_GRAPHDECODE": "sensenova_u1",
        "VLLM_OMNI_GRAPHDECODE_BUCKETS": "256,512,1024,2048",
        "VLLM_OMNI_GRAPHDECODE_PRECAPTURE_BUCKETS": "256,512,1024,2048", **env}))


def _pipeline(checkpoint, cfg=None, rows=8, **install):  # noqa: F811
    pipe = rm.load_sensenova_pipeline(checkpoint, device="cuda", dtype=torch.bfloat16)
    if cfg is not False:
        hook.install(pipe, cfg or _cfg(), None, rows=rows, **install)
    return pipe


def _mixed():
    return [_request(0, "a red cube on a table", text=60),
            _request(1, "two cats and a dog in the rain", text=150),
            _request(2, "x", text=33),
            _request(3, "a sampled answer", text=90, do_sample=True, temperature=0.8),
            _request(4, "a think image of a boat", think=True),
            _request(5, "a plain image of a tree")]


def test_gpu_a_batch_answers_as_each_request_alone_bit_for_bit(checkpoint):  # noqa: F811
    pipe = _pipeline(checkpoint)
    wiring = getattr(pipe, hook.STATE_ATTR)
    assert wiring.batch.graphs and "Triton decode attention" in wiring.batch.describe()
    requests = _mixed()
    together = [_answer(o) for o in pipe.forward(_batch(requests))]
    rows, launches = stats.get(MODEL, "batch_rows"), stats.get(MODEL, "batch_launch")
    assert stats.get(MODEL, "batch_capture") >= 1
    # Alone, in another order: each request sits in row 0 now.
    alone = {i: _answer(pipe.forward(_batch([requests[i]]))) for i in (5, 3, 1, 4, 0, 2)}
    assert together == [alone[i] for i in range(len(requests))]
    assert rows > launches, "the loops never decoded in one launch"
    assert stats.fallbacks(MODEL) == {}


def _prefilled(pipe, ids):
    out, cache, t_idx = rm.prefill(pipe, ids)
    return out.logits, cache, t_idx


ROWGEMV = {"VLLM_OMNI_GRAPHDECODE_SENSENOVA_STEP": "rowgemv"}
# Named, not left to the default: a run under GRAPHDECODE_TEST_SENSENOVA_STEP keeps it on cuBLAS.
CUBLAS = {"VLLM_OMNI_GRAPHDECODE_SENSENOVA_STEP": "fused"}


def test_gpu_rowgemv_batch_reads_the_row_gemm_and_answers_as_alone(checkpoint):  # noqa: F811
    """``..._SENSENOVA_STEP=rowgemv`` with the batched step (rows above 1): its linear layers
    read the plugin's 16-row GEMM (``ops/rows_gemm.py``), none kept on cuBLAS, and a request's
    answer in a batch is its answer alone, bit for bit, as with cuBLAS."""
    from vllm_omni_graphdecode.ops.rows_gemm import RowsLinears

    stats.reset()
    pipe = _pipeline(checkpoint, cfg=_cfg(**ROWGEMV))
    wiring = getattr(pipe, hook.STATE_ATTR)
    assert isinstance(wiring.batch.linears, RowsLinears)
    assert wiring.batch._decoder().model.fusion.gemv is wiring.batch.linears
    assert "bf16 row GEMMs" in wiring.batch.describe()
    requests = _mixed()
    together = [_answer(o) for o in pipe.forward(_batch(requests))]
    assert stats.get(MODEL, "batch_capture") >= 1
    alone = {i: _answer(pipe.forward(_batch([requests[i]]))) for i in (5, 3, 1, 4, 0, 2)}
    assert together == [alone[i] for i in range(len(requests))]
    assert stats.fallbacks(MODEL) == {}
    assert not any("kept on cuBLAS" in k or "unavailable" in k
                   for k in stats.degraded_paths(MODEL)), stats.degraded_paths(MODEL)


@pytest.mark.parametrize("env", [CUBLAS, ROWGEMV], ids=["cublas", "rowgemv"])
def test_gpu_batched_logits_match_the_pipelines_eager_step(checkpoint, env):  # noqa: F811
    """Three rows decoding 80 tokens together, one token per launch: each step's logits of a
    row against the pipeline's own eager step fed the same token over its ``DynamicCache``
    (the batched step's linear layers through cuBLAS, and through the 16-row GEMM)."""
    pipe = _pipeline(checkpoint, cfg=_cfg(VLLM_OMNI_GRAPHDECODE_TOKENS_PER_LAUNCH="1", **env),
                     rows=4)
    wiring = getattr(pipe, hook.STATE_ATTR)
    decoder = wiring.batch._decoder()
    eager = _pipeline(checkpoint, cfg=False)
    prompts = [rm.prompt_ids(pipe.tokenizer, n, seed=n, device="cuda") for n in (30, 45, 12)]
    records = [[] for _ in prompts]
    steps = 80

    def member(i):
        def run():
            with torch.inference_mode():
                logits, cache, t_idx = _prefilled(pipe, prompts[i])
                row = decoder.join(cache)
                token = int(logits[0, -1].argmax())
                fed = []
                for s in range(steps):
                    fed.append(token)
                    token = row.next(token, t_idx + 1 + s)
                    records[i].append(decoder.programs[False].output[row.index].float().clone())
                decoder.leave(row, write_back=False)
                return fed
        return run

    feds = turns.Turns(decoder.launch).run([member(i) for i in range(len(prompts))])
    assert all(isinstance(f, list) for f in feds), feds
    parted = 0
    with torch.inference_mode():
        for i, ids in enumerate(prompts):
            out, cache, t_idx = rm.prefill(eager, ids)
            for s, token in enumerate(feds[i]):
                index = torch.tensor([[t_idx + 1 + s], [0], [0]], device="cuda")
                step = eager.language_model(input_ids=torch.tensor([[token]], device="cuda"),
                                            indexes=index, past_key_values=cache, use_cache=True)
                want = step.logits[0, -1].float()
                got = records[i][s]
                worst = float((got - want).abs().max())
                assert worst <= BOUND * float(want.abs().max()), f"row {i} step {s}: {worst}"
                if int(got.argmax()) != int(want.argmax()):
                    top = want.topk(2).values
                    assert float(top[0] - top[1]) < TIE, f"row {i} step {s}: not a near tie"
                    parted += 1
    assert parted <= 2


@pytest.mark.parametrize("env", [CUBLAS, ROWGEMV], ids=["cublas", "rowgemv"])
def test_gpu_a_captured_launch_equals_the_same_launch_run_eagerly(checkpoint, env):  # noqa: F811
    pipes = [_pipeline(checkpoint, cfg=_cfg(**env), rows=4, graphs=g) for g in (True, False)]
    prompts = [rm.prompt_ids(pipes[0].tokenizer, n, seed=n, device="cuda") for n in (20, 37, 9)]
    results = []
    for pipe in pipes:
        decoder = getattr(pipe, hook.STATE_ATTR).batch._decoder()
        assert decoder.graphs == (pipe is pipes[0])

        def member(ids, pipe=pipe, decoder=decoder):
            def run():
                with torch.inference_mode():
                    logits, cache, t_idx = _prefilled(pipe, ids)
                    row = decoder.join(cache, RowSampling(0.9, 5) if ids.shape[1] == 37
                                       else RowSampling())
                    token = int(logits[0, -1].argmax())
                    out = []
                    for s in range(96):
                        token = row.next(token, t_idx + 1 + s)
                        out.append(token)
                    decoder.leave(row, write_back=False)
                    return out
            return run

        results.append(turns.Turns(decoder.launch).run([member(ids) for ids in prompts]))
    assert results[0] == results[1]


SCRIPT = textwrap.dedent("""
    import hashlib, json, sys, torch
    sys.path.insert(0, {root!r}); sys.path.insert(0, {tests!r})
    from vllm_omni_graphdecode import config
    from vllm_omni_graphdecode.hooks import sensenova_u1 as hook
    from vllm_omni_graphdecode.testing import sensenova as rm, common
    from test_sensenova_batch import _answer, _batch, _request
    answers = {{}}
    for rows in (1, 4):
        cfg = config.parse(common.with_suite_overrides({{
            "VLLM_OMNI_GRAPHDECODE": "sensenova_u1",
            "VLLM_OMNI_GRAPHDECODE_SENSENOVA_INTREE": "takeover", **json.loads(sys.argv[1])}}))
        pipe = rm.load_sensenova_pipeline({ckpt!r}, device="cuda", dtype=torch.bfloat16)
        hook.install(pipe, cfg, None, rows=rows)
        requests = [_request(0, "a red cube on a table", text=300),
                    _request(1, "a think image of a boat", think=True)]
        outs = pipe.forward(_batch(requests)) if rows > 1 else [
            pipe.forward(_batch([r])) for r in requests]
        for i, out in enumerate(outs):
            a = _answer(out)
            answers[f"{{rows}}-{{i}}"] = (a if isinstance(a, str)
                                          else [hashlib.sha256(a[0]).hexdigest(), a[1]])
    print("ANSWERS " + json.dumps(answers))
""")


@pytest.mark.parametrize("env", [{}, {"VLLM_OMNI_GRAPHDECODE_FP8": "on"},
                                 {"VLLM_OMNI_GRAPHDECODE_SENSENOVA_STEP": "rowgemv"}],
                         ids=["bf16", "fp8", "rowgemv"])
def test_gpu_the_same_requests_answer_the_same_in_two_processes(checkpoint, tmp_path, env):  # noqa: F811
    """The batch-1 path and the batched path, bf16, with FP8 weights (Marlin), and with
    ``rowgemv`` (the one-request step's bf16 row GEMV and the batched step's 16-row GEMM: block
    sizes from the weights' shapes, none from timing): two
    processes, the same answers (issue #22: two engine runs parted at think token 693). The two
    run at the same time (the tiny checkpoint needs little of the GPU), which halves the test's
    time: each process spends most of it importing the stack and capturing."""
    script = tmp_path / "answers.py"
    script.write_text(SCRIPT.format(root=ROOT, tests=os.path.join(ROOT, "tests"), ckpt=checkpoint))
    # Output to files, not pipes: a pipe nobody reads yet would stall the second process.
    logs = [(tmp_path / f"out-{i}.txt", tmp_path / f"err-{i}.txt") for i in range(2)]
    procs = []
    try:
        for out, err in logs:
            with open(out, "w") as fo, open(err, "w") as fe:
                procs.append(subprocess.Popen([sys.executable, str(script), json.dumps(env)],
                                              stdout=fo, stderr=fe, env=dict(os.environ)))
        runs = []
        for proc, (out, err) in zip(procs, logs):
            proc.wait(timeout=900)
            stdout, stderr = out.read_text(), err.read_text()
            line = next((l for l in stdout.splitlines() if l.startswith("ANSWERS ")), None)
            assert line, stdout[-2000:] + stderr[-4000:]
            runs.append(json.loads(line[len("ANSWERS "):]))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
    assert runs[0] == runs[1]
    assert set(runs[0]) == {"1-0", "1-1", "4-0", "4-1"}


@pytest.mark.parametrize("env", [CUBLAS, ROWGEMV], ids=["cublas", "rowgemv"])
def test_gpu_base_lora_base_in_the_batch_answers_the_first_base_answer(checkpoint,  # noqa: F811
                                                                       env):
    """``rowgemv``: the adapter's layers are handed back to the modules (counted under
    ``layer kept on cuBLAS``) while it is bound, and read by the row GEMM again after."""
    stats.reset()
    pipe = _pipeline(checkpoint, cfg=_cfg(**env), rows=4)
    requests = [_request(0, "a red cube on a table", text=120),
                _request(1, "two cats and a dog", text=80)]
    base = [_answer(o) for o in pipe.forward(_batch(requests))]
    wrappers = rm.add_lora_wrappers(pipe.language_model)
    common.bind_adapter(wrappers)
    adapted = [_answer(o) for o in pipe.forward(_batch(requests))]
    kept = sum(n for k, n in stats.degraded_paths(MODEL).items() if "kept on cuBLAS" in k)
    common.unbind_adapter(wrappers)
    again = [_answer(o) for o in pipe.forward(_batch(requests))]
    assert adapted != base, "the adapter changed nothing: the test would prove nothing"
    assert again == base
    assert stats.get(MODEL, "batch_lora_forward") == 2
    if env is ROWGEMV:
        assert kept > 0, stats.degraded_paths(MODEL)


def test_gpu_device_memory_is_flat_from_batch_5_to_20(checkpoint):  # noqa: F811
    """Also: every batch after the first runs on the worker threads the first made (no new
    thread, so no new cuBLAS handle or workspace; ``decode/batch/workers.py``)."""
    pipe = _pipeline(checkpoint, rows=4)
    requests = [_request(i, f"request number {i}", text=40 + 10 * i) for i in range(4)]
    free = {}
    for n in range(1, 21):
        pipe.forward(_batch(requests))
        if n == 1:
            made = workers.WORKERS.started
        if n in (5, 20):
            gc.collect()
            torch.cuda.synchronize()
            free[n] = torch.cuda.mem_get_info()[0]
    assert workers.WORKERS.started == made
    assert abs(free[5] - free[20]) <= 2 * 2**20, free



def test_gpu_row_gemm_last_program_adding_equals_the_adding_launch_at_the_released_shapes():
    """``rows_gemm``'s ``counts`` (the last program of a block adds its parts): bit for bit the
    two-launch result at the released layer shapes, for 16 and 3 rows, with the residual and
    the SwiGLU the batched step uses; the counts are zero after every call."""
    from vllm_omni_graphdecode.ops import rows_gemm as rg

    g = torch.Generator(device="cuda").manual_seed(0)
    counts = torch.zeros(rg.COUNT_BLOCKS, dtype=torch.int32, device="cuda")
    for n, k, extra in ((4096, 4096, "res"), (4096, 12288, "res"), (24576, 4096, "swiglu"),
                        (6144, 4096, None)):
        w = (torch.randn(n, k, generator=g, device="cuda") * 0.02).bfloat16()
        cfg = rg.config_for(n, k)
        for m in (16, 3):
            x = torch.randn(m, k, generator=g, device="cuda").bfloat16()
            kw = ({"residual": torch.randn(m, n, generator=g, device="cuda").bfloat16()}
                  if extra == "res" else {"swiglu": True} if extra == "swiglu" else {})
            want = rg.rows_gemm(x, w, cfg, **kw)
            got = rg.rows_gemm(x, w, cfg, counts=counts, **kw)
            assert torch.equal(got, want), (n, k, m, extra)
            assert not counts.any(), (n, k, m)


def test_gpu_row_gemm_keeps_its_adding_launch_where_the_last_program_cannot_add():
    """The two fallbacks of the last-program adding, forced: a SwiGLU weight whose gate and up
    blocks do not pair (an odd number of blocks) and a ``RowsLinears`` whose first call is inside
    a graph capture (no count buffer made there): both run the adding launch, with the same
    bits as the eager call, and a buffer is made at the next call outside the capture."""
    from vllm_omni_graphdecode.ops import rows_gemm as rg

    g = torch.Generator(device="cuda").manual_seed(2)
    counts = torch.zeros(rg.COUNT_BLOCKS, dtype=torch.int32, device="cuda")
    w = (torch.randn(4160, 4096, generator=g, device="cuda") * 0.02).bfloat16()  # 65 blocks
    x = torch.randn(8, 4096, generator=g, device="cuda").bfloat16()
    cfg = rg.config_for(*w.shape)
    want = rg.rows_gemm(x, w, cfg, swiglu=True)
    assert torch.equal(rg.rows_gemm(x, w, cfg, swiglu=True, counts=counts), want)
    assert not counts.any()

    w = (torch.randn(4096, 12288, generator=g, device="cuda") * 0.02).bfloat16()  # split 4
    x = torch.randn(8, 12288, generator=g, device="cuda").bfloat16()
    r = torch.randn(8, 4096, generator=g, device="cuda").bfloat16()
    cfg = rg.config_for(*w.shape)
    want = rg.rows_gemm(x, w, cfg, residual=r)  # compiles the adding launch's variant
    linears = rg.RowsLinears("graphdecode-test")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        got = rg.rows_gemm(x, w, cfg, residual=r, counts=linears._counts_on(x.device))
    assert linears._counts.made == {}
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(got, want)
    made = linears._counts_on(x.device)
    assert made is not None and not made.any()


def _dependent_or_skip():
    from vllm_omni_graphdecode.ops.fp8 import gemv as row_gemv

    mode = row_gemv.dependent_launches("cuda")
    if mode is None:
        pytest.skip("no dependent launch on this GPU (compute capability 9.0+ and a Triton "
                    "with gdc_wait)")
    return mode


def test_gpu_row_gemm_dependent_launches_give_the_plain_launches_bits():
    """``rows_gemm``'s ``pdl``: a layer's chain at the released shapes (qkv, o_proj with the
    residual, gate-up's SwiGLU, down with the residual, each reading the one before) as
    dependent launches, eager and replayed from one graph, in both modes, equals the plain
    launches bit for bit at 16 and 3 rows; the count buffer is zero after."""
    from vllm_omni_graphdecode.ops import rows_gemm as rg

    _dependent_or_skip()
    g = torch.Generator(device="cuda").manual_seed(4)
    shapes = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (24576, 4096),
              "down": (4096, 12288)}
    w = {name: (torch.randn(*s, generator=g, device="cuda") * 0.02).bfloat16()
         for name, s in shapes.items()}
    counts = torch.zeros(rg.COUNT_BLOCKS, dtype=torch.int32, device="cuda")

    def layer(h, pdl):
        qkv = rg.rows_gemm(h, w["qkv"], rg.config_for(*shapes["qkv"]), counts=counts, pdl=pdl)
        h = rg.rows_gemm(qkv[:, :4096], w["o"], rg.config_for(*shapes["o"]), residual=h,
                         counts=counts, pdl=pdl)
        act = rg.rows_gemm(h, w["gate_up"], rg.config_for(*shapes["gate_up"]), swiglu=True,
                           counts=counts, pdl=pdl)
        return rg.rows_gemm(act, w["down"], rg.config_for(*shapes["down"]), residual=h,
                            counts=counts, pdl=pdl)

    for m in (16, 3):
        x = torch.randn(m, 4096, generator=g, device="cuda").bfloat16()
        want = layer(layer(x, None), None)
        for mode in ("prefetch", "wait"):
            assert torch.equal(layer(layer(x, mode), mode), want), (m, mode)
            static = x.clone()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                got = layer(layer(static, mode), mode)
            for _ in range(3):
                graph.replay()
            torch.cuda.synchronize()
            assert torch.equal(got, want), (m, mode)
            assert not counts.any(), (m, mode)


def test_gpu_row_gemm_dependent_launch_of_an_unprefetchable_weight_only_waits_with_plain_bits():
    """The fallback of "prefetch": a weight whose rows are not in whole 16-byte units (K =
    4,100; a view one element in) is not ``prefetchable``, so its dependent launch only waits:
    the same bits as a plain launch, eager and replayed, split with the residual and not."""
    from vllm_omni_graphdecode.ops import rows_gemm as rg

    _dependent_or_skip()
    g = torch.Generator(device="cuda").manual_seed(5)
    base = (torch.randn(4096 * 4100 + 1, generator=g, device="cuda") * 0.02).bfloat16()
    for w in (base[:4096 * 4100].view(4096, 4100), base[1:].view(4096, 4100)[:, :4096]):
        assert not rg.prefetchable(w)
        k = w.shape[1]
        cfg = rg.config_for(*w.shape)
        counts = torch.zeros(rg.COUNT_BLOCKS, dtype=torch.int32, device="cuda")
        x = torch.randn(5, k, generator=g, device="cuda").bfloat16()
        r = torch.randn(5, 4096, generator=g, device="cuda").bfloat16()
        for kw in ({}, {"residual": r}):
            want = rg.rows_gemm(x, w, cfg, counts=counts, **kw)
            assert torch.equal(rg.rows_gemm(x, w, cfg, counts=counts, pdl="prefetch", **kw),
                               want), (tuple(w.stride()), kw.keys())
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                got = rg.rows_gemm(x, w, cfg, counts=counts, pdl="prefetch", **kw)
            graph.replay()
            torch.cuda.synchronize()
            assert torch.equal(got, want), (tuple(w.stride()), kw.keys())
            assert not counts.any()


def test_gpu_rowgemv_batch_dependent_launches_answer_as_plain_ones(checkpoint):  # noqa: F811
    """The batched step's 16-row GEMMs as dependent launches (``RowsLinears.pdl``, set before
    the first capture): the mixed batch's answers equal those of the same batch with plain
    launches, bit for bit, and each request's answer alone."""
    mode = _dependent_or_skip()
    answers = {}
    for pdl in (None, mode):
        stats.reset()
        pipe = _pipeline(checkpoint, cfg=_cfg(VLLM_OMNI_GRAPHDECODE_PRECAPTURE="0", **ROWGEMV))
        linears = getattr(pipe, hook.STATE_ATTR).batch.linears
        linears.pdl = pdl
        assert ("dependent launches" in linears.describe()) is (pdl is not None)
        requests = _mixed()
        answers[pdl] = [_answer(o) for o in pipe.forward(_batch(requests))]
        assert stats.get(MODEL, "batch_capture") >= 1
        if pdl is not None:
            alone = {i: _answer(pipe.forward(_batch([requests[i]]))) for i in (4, 1, 3)}
            assert [answers[pdl][i] for i in (4, 1, 3)] == [alone[i] for i in (4, 1, 3)]
        assert stats.fallbacks(MODEL) == {}
        del pipe, linears
        gc.collect()
        torch.cuda.empty_cache()
    assert answers[mode] == answers[None]
