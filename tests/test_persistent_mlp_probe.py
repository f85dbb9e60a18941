"""The persistent-MLP probe (``benchmarks/probes/persistent_mlp.py``, issue #42) on a machine
without a GPU: its kernels' bits (the MLP span's, the tail span's) against the two or three GEMV
launches under Triton's interpreter, their flags back at zero, their compile for sm_90 with the
acquire/release they rely on and the launches' sum layouts, and the residency cap. Whether they
are faster is what the probe measures on a GPU."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROBE = os.path.join(ROOT, "benchmarks", "probes", "persistent_mlp.py")

LOAD = f"""
import importlib.util, sys
spec = importlib.util.spec_from_file_location("persistent_mlp", {PROBE!r})
pm = importlib.util.module_from_spec(spec)
sys.modules["persistent_mlp"] = pm
spec.loader.exec_module(pm)
"""


def _probe():
    spec = importlib.util.spec_from_file_location("persistent_mlp", PROBE)
    module = importlib.util.module_from_spec(spec)
    sys.modules["persistent_mlp"] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def _run(script: str, interpret: bool) -> None:
    """``script`` in a fresh process (the interpreter must be chosen before Triton is
    imported); it prints ``ok`` last when every assertion held."""
    pytest.importorskip("triton")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(CUDA_VISIBLE_DEVICES="", PYTHONPATH=ROOT + os.pathsep + env.get("PYTHONPATH", ""))
    if interpret:
        env["TRITON_INTERPRET"] = "1"
    proc = subprocess.run([sys.executable, "-c", LOAD + script], capture_output=True, text=True,
                          env=env, timeout=600, cwd=ROOT, check=False)
    lines = proc.stdout.strip().splitlines()
    assert proc.returncode == 0 and lines and lines[-1] == "ok", proc.stderr[-3000:]


SAME_BITS = """
import torch
from vllm_omni_graphdecode.ops.fp8 import quant
from vllm_omni_graphdecode.ops.fp8.gemv import KernelConfig

g = torch.Generator().manual_seed(0)
k1, n1, n2 = 128, 256, 64  # act 128 wide
# gate-up: 16 blocks of 8 act values; down: 8 blocks, act in 4 chunks of 32 (4 blocks each), or
# gate-up 8 blocks of 16 values, down in 16 chunks of 8 (one block completes two).
for layout in (pm.Layout(KernelConfig(16, 64, 4), KernelConfig(8, 32, 4)),
               pm.Layout(KernelConfig(32, 64, 4), KernelConfig(8, 8, 4))):
    for fp8 in (False, True):
        wg = (torch.randn(n1, k1, generator=g) * k1 ** -0.5).bfloat16()
        wd = (torch.randn(n2, n1 // 2, generator=g) * 0.1).bfloat16()
        sg = sd = None
        if fp8:
            (wg, sg), (wd, sd) = quant.quantize_rows(wg), quant.quantize_rows(wd)
        flags = torch.zeros(pm.flag_words(n1 // 2, layout), dtype=torch.int32)
        act = torch.empty(n1 // 2, dtype=torch.bfloat16)
        for call in range(2):  # the second starts from the flags the first left
            x = torch.randn(k1, generator=g).bfloat16()
            res = torch.randn(n2, generator=g).bfloat16()
            out = torch.full((n2,), float("nan"), dtype=torch.bfloat16)
            pm.launch(x, wg, sg, wd, sd, res, act, out, flags, 1, layout, max_spins=64)
            want = pm.two_launches(x, wg, sg, wd, sd, res, layout)
            assert torch.equal(out, want), (layout, fp8, call, (out - want).abs().max())
            assert torch.equal(act, pm.gemv.gemv(x, wg, sg, None, layout.gate_up,
                                                 swiglu_out=True)), (layout, fp8, call)
            # Every chunk count and ``done`` back at zero, and no wait gave up (``stuck``).
            assert not flags.any(), (layout, fp8, call, flags.tolist())
print("ok")
"""


def test_one_launch_equals_the_gate_up_and_down_launches_bit_for_bit_and_leaves_flags_at_zero():
    """bf16 and FP8 weights, chunks narrower and wider than a gate-up block's act values, two
    calls each (the second proves the first put the flags back), one program under Triton's
    interpreter: the same act and output bits as ``gemv``'s two launches."""
    _run(SAME_BITS, interpret=True)


STUCK = """
import torch
from vllm_omni_graphdecode.ops.fp8.gemv import KernelConfig

# The interpreter runs programs one after another: program 0 waits for act that program 1
# has not computed, as a program that is not resident would never compute it.
layout = pm.Layout(KernelConfig(16, 64, 4), KernelConfig(8, 32, 4))
wg, wd = torch.randn(256, 128).bfloat16(), torch.randn(64, 128).bfloat16()
flags = torch.zeros(pm.flag_words(128, layout), dtype=torch.int32)
act, out = torch.empty(128, dtype=torch.bfloat16), torch.empty(64, dtype=torch.bfloat16)
pm.launch(torch.randn(128).bfloat16(), wg, None, wd, None, torch.zeros(64).bfloat16(), act,
          out, flags, 2, layout, max_spins=3)
assert flags[-1] == 1 and not flags[:-1].any(), flags.tolist()
print("ok")
"""


def test_a_wait_for_a_program_that_never_runs_marks_stuck_instead_of_hanging():
    _run(STUCK, interpret=True)


COMPILED = """
import re
import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget

kernel = pm._define(triton, tl)  # compiled mode: no interpreter in this process
ints = ("K1", "K2", "N2", "stride_wg", "stride_wd", "max_spins")
# The steps' blocks at SenseNova-U1's shapes: bf16 (the shape rule), FP8 (gemv_table.MEASURED).
for fp8, layout in ((False, pm.layouts("step")["bf16"]), (True, pm.layouts("step")["fp8"])):
    gu, dn = layout.gate_up, layout.down
    half, chunks = gu.block_n // 2, pm.MLP // dn.block_k
    consts = {"HAS_SCALE": fp8, "BLOCK_N1": gu.block_n, "BLOCK_K1": gu.block_k,
              "BLOCK_N2": dn.block_n, "BLOCK_K2": dn.block_k, "CHUNKS": chunks,
              "CHUNKS_P2": 1 << (chunks - 1).bit_length(), "SPAN": max(1, half // dn.block_k),
              "SHARE": min(half, dn.block_k)}
    types = {"flag_ptr": "*i32", "sg_ptr": "*fp32", "sd_ptr": "*fp32"}
    if fp8:
        types.update(wg_ptr="*fp8e4nv", wd_ptr="*fp8e4nv")
    sig = {n: "constexpr" if n in consts else types.get(n, "i32" if n in ints else "*bf16")
           for n in kernel.arg_names}
    # As a launch specialises them: pointers and sizes divisible by 16 (vector loads).
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(kernel.arg_names)
             if n not in consts}
    src = triton.compiler.ASTSource(
        fn=kernel, signature=sig, attrs=attrs,
        constexprs={(kernel.arg_names.index(n),): v for n, v in consts.items()})
    compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                              options={"num_warps": layout.num_warps, "num_stages": 1})
    ptx = compiled.asm["ptx"]
    assert compiled.asm["cubin"], fp8
    # gate-up counts its act values with release, down waits with an acquire load (what
    # Triton makes of atomic_add(flag, 0, sem="acquire")), ``done`` is acq_rel.
    assert re.search(r"atom\\.global\\.gpu\\.release\\.add", ptx), fp8
    assert re.search(r"ld\\.global\\.gpu\\.acquire\\.b32", ptx), fp8
    assert re.search(r"atom\\.global\\.gpu\\.acq_rel\\.add", ptx), fp8
    assert re.search(r"ld\\.global\\.cg\\.", ptx), fp8  # act through L2
print("ok")
"""


def test_kernel_compiles_for_hopper_with_release_counts_acquire_waits_and_act_read_through_l2():
    triton = pytest.importorskip("triton")
    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    if not os.path.exists(ptxas):
        pytest.skip(f"this Triton has no CUDA compiler to build sm_90 code ({ptxas})")
    try:
        from triton.compiler import ASTSource  # noqa: F401
    except ImportError as exc:
        pytest.skip(f"this Triton has no ahead-of-time compile API ({exc})")
    _run(COMPILED, interpret=False)


def test_resident_programs_is_the_tightest_of_registers_threads_shared_memory_and_blocks():
    pm = _probe()
    # 128 registers: a warp 4096, a 4-warp program 16384 of 65536: 4 an SM.
    assert pm.resident_programs(128, 4, 0, 132) == 4 * 132
    # 100 registers round up to 104 (3328 a warp): 2 programs of 8 warps an SM.
    assert pm.resident_programs(100, 8, 1024, 132) == 2 * 132
    # 32 registers, 4 warps: registers allow 16, threads (2048) 16.
    assert pm.resident_programs(32, 4, 0, 2) == 16 * 2
    # Shared memory: 233472 // (50000 + 1024) = 4.
    assert pm.resident_programs(32, 1, 50000, 2) == 4 * 2
    # Nothing else binds: the 32-blocks-an-SM limit.
    assert pm.resident_programs(16, 1, 0, 3) == 32 * 3
    # Another device's limits, passed in.
    assert pm.resident_programs(64, 4, 0, 10, regs_per_sm=32768, threads_per_sm=1024) == 4 * 10


def test_programs_spec_counts_per_sm_and_the_cap():
    pm = _probe()
    assert pm.program_counts("1x,2x,max", 132, 400) == [132, 264, 400]
    assert pm.program_counts("100, 1x ,max,100", 132, 132) == [100, 132]


TAIL_SAME_BITS = """
import torch
from vllm_omni_graphdecode.ops.fp8 import quant
from vllm_omni_graphdecode.ops.fp8.gemv import KernelConfig

g = torch.Generator().manual_seed(0)
k0, hid, n1 = 128, 64, 256  # attention's output 128 wide, hidden 64, act 128
# o_proj 8 blocks of 8 rows (2 or 4 K steps); gate-up 16 blocks of 8 act values, down 8 blocks,
# act in 4 chunks of 32; or gate-up 8 blocks of 16 values, down in 16 chunks of 8 (SPAN 2).
for layout in (pm.TailLayout(KernelConfig(8, 64, 4), KernelConfig(16, 32, 4),
                             KernelConfig(8, 32, 4)),
               pm.TailLayout(KernelConfig(8, 32, 4), KernelConfig(32, 64, 4),
                             KernelConfig(8, 8, 4))):
    for fp8 in (False, True):
        wo = (torch.randn(hid, k0, generator=g) * k0 ** -0.5).bfloat16()
        wg = (torch.randn(n1, hid, generator=g) * hid ** -0.5).bfloat16()
        wd = (torch.randn(hid, n1 // 2, generator=g) * 0.1).bfloat16()
        nw = (1 + 0.1 * torch.randn(hid, generator=g)).bfloat16()
        so = sg = sd = None
        if fp8:
            (wo, so), (wg, sg), (wd, sd) = map(quant.quantize_rows, (wo, wg, wd))
        flags = torch.zeros(pm.tail_flag_words(n1 // 2, layout), dtype=torch.int32)
        counts = torch.zeros(1, dtype=torch.int32)
        act = torch.empty(n1 // 2, dtype=torch.bfloat16)
        for call in range(2):  # the second starts from the flags the first left
            res = torch.randn(hid, generator=g).bfloat16()
            x = torch.randn(k0, generator=g).bfloat16()
            h1, normed, out = (torch.full((hid,), float("nan"), dtype=torch.bfloat16)
                               for _ in range(3))
            pm.launch_tail(x, wo, so, res, h1, nw, 1e-6, normed, wg, sg, wd, sd, act, out,
                           flags, 1, layout, max_spins=64)
            want = pm.three_launches(x, wo, so, res, nw, 1e-6, wg, sg, wd, sd, counts, layout)
            for name, got, w in zip(("out", "h1", "normed"), (out, h1, normed), want):
                assert torch.equal(got, w), (layout, fp8, call, name, (got - w).abs().max())
            assert torch.equal(act, pm.gemv.gemv(want[2], wg, sg, None, layout.gate_up,
                                                 swiglu_out=True)), (layout, fp8, call)
            # Chunk counts, the o_proj count, normed ready and ``done`` back at zero, and no
            # wait gave up (``stuck``).
            assert not flags.any(), (layout, fp8, call, flags.tolist())
print("ok")
"""


def test_tail_launch_equals_the_o_proj_norm_gate_up_and_down_launches_bit_for_bit():
    """bf16 and FP8 weights, several o_proj and gate-up blocks, 4 and 16 act chunks, two calls
    each (the second proves the first put every flag back, the norm's too), one program under
    Triton's interpreter: out, h1 and normed as ``gemv``'s three launches (o_proj with the
    residual and the norm, gate-up with its SwiGLU, down with h1) give them."""
    _run(TAIL_SAME_BITS, interpret=True)


TAIL_STUCK = """
import torch
from vllm_omni_graphdecode.ops.fp8.gemv import KernelConfig

# The interpreter runs programs one after another. o_proj's 2 blocks: program 1 counts the last
# and normalises; gate-up's one block is program 0's, so program 0 waits for normed that
# program 1 has not computed, and nothing else waits: down's one chunk is complete before
# either program reads it.
layout = pm.TailLayout(KernelConfig(8, 16, 4), KernelConfig(32, 16, 4), KernelConfig(8, 16, 4))
wo, wg, wd = (torch.randn(16, 16).bfloat16(), torch.randn(32, 16).bfloat16(),
              torch.randn(16, 16).bfloat16())
flags = torch.zeros(pm.tail_flag_words(16, layout), dtype=torch.int32)
h1, normed, out = (torch.empty(16, dtype=torch.bfloat16) for _ in range(3))
pm.launch_tail(torch.randn(16).bfloat16(), wo, None, torch.zeros(16).bfloat16(), h1,
               torch.ones(16).bfloat16(), 1e-6, normed, wg, None, wd, None,
               torch.empty(16, dtype=torch.bfloat16), out, flags, 2, layout, max_spins=3)
assert flags[-1] == 1 and not flags[:-1].any(), flags.tolist()
print("ok")
"""


def test_a_wait_for_normed_that_never_comes_marks_stuck_instead_of_hanging():
    _run(TAIL_STUCK, interpret=True)


TAIL_COMPILED = """
import re
import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget

kernel = pm._define_tail(triton, tl)  # compiled mode: no interpreter in this process
ints = ("K0", "N0", "K2", "stride_wo", "stride_wg", "stride_wd", "max_spins")
# The steps' blocks at SenseNova-U1's shapes: bf16 (the shape rule), FP8 (gemv_table.MEASURED).
for fp8, layout in ((False, pm.tail_layouts("step")["bf16"]),
                    (True, pm.tail_layouts("step")["fp8"])):
    op, gu, dn = layout.o_proj, layout.gate_up, layout.down
    half, chunks = gu.block_n // 2, pm.MLP // dn.block_k
    consts = {"HAS_SCALE": fp8, "BLOCK_N0": op.block_n, "BLOCK_K0": op.block_k,
              "NORM_N": pm.HIDDEN, "BLOCK_N1": gu.block_n, "BLOCK_K1": gu.block_k,
              "BLOCK_N2": dn.block_n, "BLOCK_K2": dn.block_k, "CHUNKS": chunks,
              "WORDS_P2": 1 << (chunks + 1).bit_length(), "SPAN": max(1, half // dn.block_k),
              "SHARE": min(half, dn.block_k)}
    types = {"flag_ptr": "*i32", "so_ptr": "*fp32", "sg_ptr": "*fp32", "sd_ptr": "*fp32",
             "norm_eps": "fp32"}
    if fp8:
        types.update(wo_ptr="*fp8e4nv", wg_ptr="*fp8e4nv", wd_ptr="*fp8e4nv")
    sig = {n: "constexpr" if n in consts else types.get(n, "i32" if n in ints else "*bf16")
           for n in kernel.arg_names}
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(kernel.arg_names)
             if n not in consts and n != "norm_eps"}
    src = triton.compiler.ASTSource(
        fn=kernel, signature=sig, attrs=attrs,
        constexprs={(kernel.arg_names.index(n),): v for n, v in consts.items()})
    compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                              options={"num_warps": layout.num_warps, "num_stages": 1})
    ptx = compiled.asm["ptx"]
    assert compiled.asm["cubin"], fp8
    # The o_proj blocks and ``done`` are counted acq_rel (2), gate-up's act counts released
    # (1), normed ready released with an exchange (1); the normed wait and the chunk waits
    # read with acquire loads (what Triton makes of atomic_add(flag, 0, sem="acquire"): two
    # a wait, 4).
    def count(pattern):
        return len(re.findall(pattern, ptx))
    assert count(r"atom\\.global\\.gpu\\.acq_rel\\.add\\.u32") == 2, fp8
    assert count(r"atom\\.global\\.gpu\\.release\\.add\\.u32") == 1, fp8
    assert count(r"atom\\.global\\.gpu\\.release\\.exch\\.b32") == 1, fp8
    assert count(r"ld\\.global\\.gpu\\.acquire\\.b32") == 4, fp8
    # h1 (the norm's row, down's residual), normed and act through L2.
    assert count(r"ld\\.global\\.cg\\.") >= 4, fp8
print("ok")
"""


def _compiles():
    triton = pytest.importorskip("triton")
    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    if not os.path.exists(ptxas):
        pytest.skip(f"this Triton has no CUDA compiler to build sm_90 code ({ptxas})")
    try:
        from triton.compiler import ASTSource  # noqa: F401
    except ImportError as exc:
        pytest.skip(f"this Triton has no ahead-of-time compile API ({exc})")


def test_tail_kernel_compiles_for_hopper_with_acq_rel_counts_released_norm_and_acquire_waits():
    _compiles()
    _run(TAIL_COMPILED, interpret=False)


SUM_LAYOUTS = """
import re
import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from vllm_omni_graphdecode.ops.fp8 import gemv

tail, mlp, launches = pm._define_tail(triton, tl), pm._define(triton, tl), gemv._define(triton, tl)
INTS = {"K0", "N0", "K1", "K2", "N2", "N", "K", "max_spins"}


def compile_(kernel, consts, types, warps):
    sig = {n: "constexpr" if n in consts else types.get(
               n, "i32" if n in INTS or n.startswith("stride") else "*bf16")
           for n in kernel.arg_names}
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(kernel.arg_names)
             if n not in consts and sig[n] != "fp32"}
    src = triton.compiler.ASTSource(
        fn=kernel, signature=sig, attrs=attrs,
        constexprs={(kernel.arg_names.index(n),): v for n, v in consts.items()})
    return triton.compile(src, target=GPUTarget("cuda", 90, 32),
                          options={"num_warps": warps, "num_stages": 1}).asm["ttgir"]


def sums(ttgir):
    # Per tl.sum in program order: its shape, axis and what of its layout sets the order of its
    # adds: along the summed axis, values a thread, lanes and warps, and the dims' order.
    blocked = dict(re.findall(r"^(#\\w+) = #ttg\\.blocked<(.*)>", ttgir, re.M))
    found = []
    for axis, shape, name in re.findall(
            r'"tt\\.reduce"\\(%[\\w#]+\\) <\\{axis = (\\d+) : i32\\}> \\(\\{.*?\\}\\) : '
            r'\\(tensor<([\\dx]+)xf32, (#\\w+)>\\)', ttgir, re.S):
        fields = {k: [int(v) for v in vs.split(",")]
                  for k, vs in re.findall(r"(\\w+) = \\[([\\d, ]+)\\]", blocked[name])}
        a = int(axis)
        found.append((shape, a, fields["sizePerThread"][a], fields["threadsPerWarp"][a],
                      fields["warpsPerCTA"][a], tuple(fields["order"])))
    return found


def launch_sums(cfg, fp8, **flags):
    consts = dict(HAS_BIAS=False, SILU_MUL=False, HAS_RESIDUAL=False, EVEN_N=True, EVEN_K=True,
                  BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, SWIGLU_OUT=False, HAS_SCALE=fp8,
                  HALVES=False, NORM=False, NORM_N=16, PDL=False, PDL_PREFETCH=False,
                  LANES=max(32 * cfg.num_warps, cfg.block_n))
    consts.update(flags)
    types = {"scale_ptr": "*fp32", "count_ptr": "*i32", "norm_eps": "fp32", "w_addr": "i64"}
    if fp8:
        types["w_ptr"] = "*fp8e4nv"
    return sums(compile_(launches, consts, types, cfg.num_warps))


weights = ("wo_ptr", "wg_ptr", "wd_ptr")
for fp8 in (False, True):
    layout = pm.tail_layouts("step")["fp8" if fp8 else "bf16"]
    op, gu, dn = layout.o_proj, layout.gate_up, layout.down
    half, chunks = gu.block_n // 2, pm.MLP // dn.block_k
    blocks = {"BLOCK_N1": gu.block_n, "BLOCK_K1": gu.block_k, "BLOCK_N2": dn.block_n,
              "BLOCK_K2": dn.block_k, "CHUNKS": chunks, "SPAN": max(1, half // dn.block_k),
              "SHARE": min(half, dn.block_k), "HAS_SCALE": fp8}
    types = {"flag_ptr": "*i32", "so_ptr": "*fp32", "sg_ptr": "*fp32", "sd_ptr": "*fp32",
             "norm_eps": "fp32"}
    if fp8:
        types.update({w: "*fp8e4nv" for w in weights})
    got = sums(compile_(tail, {**blocks, "BLOCK_N0": op.block_n, "BLOCK_K0": op.block_k,
                               "NORM_N": pm.HIDDEN, "WORDS_P2": 1 << (chunks + 1).bit_length()},
                        types, layout.num_warps))
    want = (launch_sums(op, fp8, HAS_RESIDUAL=True, NORM=True, NORM_N=pm.HIDDEN)
            + launch_sums(gu, fp8, SWIGLU_OUT=True) + launch_sums(dn, fp8, HAS_RESIDUAL=True))
    assert len(want) == 4 and got == want, (fp8, got, want)
    # The MLP kernel at its warp count (``Layout.num_warps``) against its two launches.
    got = sums(compile_(mlp, {**blocks, "CHUNKS_P2": 1 << (chunks - 1).bit_length()},
                        {**types, "wg_ptr": types.get("wg_ptr", "*bf16"),
                         "wd_ptr": types.get("wd_ptr", "*bf16")}, layout.mlp.num_warps))
    assert got == want[2:], (fp8, got, want[2:])
print("ok")
"""


def test_both_kernels_sum_in_the_launches_layouts_at_the_real_shapes_for_hopper():
    """A sum's order is its layout's (values a thread, lanes and warps along the summed axis):
    compiled for sm_90 at SenseNova-U1's shapes and the steps' blocks, each of the tail's four
    sums (o_proj's rows, the norm's row, gate-up's and down's rows) and the MLP kernel's two
    take the layouts of the launches' own, though the tail runs at o_proj's warp count (FP8
    gate-up's launch takes 8) and the MLP kernel at the larger of its two."""
    _compiles()
    _run(SUM_LAYOUTS, interpret=False)
