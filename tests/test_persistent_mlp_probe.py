"""The persistent-MLP probe (``benchmarks/probes/persistent_mlp.py``, issue #42) on a machine
without a GPU: its kernel's bits against the two GEMV launches under Triton's interpreter, its
flags back at zero, its compile for sm_90 with the acquire/release it relies on, and its
residency cap. Whether it is faster is what the probe measures on a GPU."""

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
