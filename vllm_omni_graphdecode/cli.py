"""Command line: ``python -m vllm_omni_graphdecode {doctor,demo,stats}``.

``doctor`` answers "would the fast path run here, and if not, why" without loading a model.
``demo`` builds the real model classes at small size with random weights and runs them through the
plugin (``testing/demo.py``).
``stats PATH...`` reads the snapshots that ``VLLM_OMNI_GRAPHDECODE_STATS_FILE`` makes each
worker process write, and prints one table across processes: what each wired, its counters, and
its fallbacks and degraded paths by reason.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import platform
import sys

from . import config

PACKAGES = ("vllm", "vllm-omni", "torch", "diffusers", "transformers", "vllm-omni-graphdecode")
# The head sizes doctor asks the attention kernels about: SenseNova-U1's paged decode and
# Qwen-Image-2.1's fast step both attend at head_dim 128.
DECODE_HEAD_DIM = 128
DENSE_HEAD_DIM = 128


def _version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def gpu_report() -> dict:
    try:
        import torch
    except ImportError:
        return {"gpu": None, "why": "torch is not installed"}
    if not torch.cuda.is_available():
        return {"gpu": None, "why": "torch sees no CUDA device (CPU-only machine or CPU build of "
                                    f"torch {torch.__version__})"}
    major, minor = torch.cuda.get_device_capability(0)
    return {"gpu": torch.cuda.get_device_name(0), "compute_capability": f"{major}.{minor}"}


def doctor_report() -> dict:
    report: dict = {"python": platform.python_version(),
                    "versions": {d: _version(d) for d in PACKAGES}}
    report.update(gpu_report())
    try:
        cfg = config.get()
        report["config"] = cfg.as_env()
    except config.ConfigError as exc:
        cfg = None
        report["config_error"] = str(exc)
    try:
        from .ops import attention

        report["paged_attention_kernel"] = attention.describe(
            cfg.fa_version if cfg is not None else "auto", head_dim=DECODE_HEAD_DIM)
    except Exception as exc:  # doctor must print what it can
        report["paged_attention_kernel"] = f"unknown: {exc!r}"
    try:
        report["dense_attention"] = attention.describe_dense(head_dim=DENSE_HEAD_DIM)
    except Exception as exc:
        report["dense_attention"] = f"unknown: {exc!r}"
    try:
        from .ops import layer_ops

        report["decode_step_ops"] = layer_ops.describe_step_ops()
    except Exception as exc:
        report["decode_step_ops"] = f"unknown: {exc!r}"
    try:
        report["sensenova_decode_step"] = decode_step_report(
            cfg.sensenova_step if cfg is not None else "auto",
            "cuda:0" if report.get("gpu") else "cpu")
    except Exception as exc:
        report["sensenova_decode_step"] = f"unknown: {exc!r}"
    try:
        report["fp8_weights"] = fp8_report("cuda:0" if report.get("gpu") else "cpu")
    except Exception as exc:
        report["fp8_weights"] = f"unknown: {exc!r}"
    from .core import loading
    from .hooks import MODEL_KEYS, load

    omni = loading.omni_version()
    report["vllm_omni_supported"] = loading.check_omni_version(omni) or f"yes ({omni})"
    hooks = {}
    for model in MODEL_KEYS:
        try:
            hooks[model] = load(model).support()
        except Exception as exc:
            hooks[model] = {"error": repr(exc)}
    report["hooks"] = hooks
    if omni is not None:
        minor = ".".join(omni.split(".")[:2])
        report["this_install"] = {m: _support_for(h, minor) for m, h in hooks.items()}
    return report


def decode_step_report(setting: str, device: str) -> str:
    """doctor's line for ``..._SENSENOVA_STEP``: the setting and the step it runs on ``device``
    (``auto`` resolves by the GPU)."""
    from .hooks.sensenova_u1.wiring import resolve_step

    step = resolve_step(setting, device)
    if setting != "auto":
        return step
    where = ("a Hopper GPU" if step == "rowgemv" else
             "no CUDA device" if device == "cpu" else "not a Hopper GPU")
    return f"auto: {step} ({where})"


def fp8_report(device: str) -> str:
    """doctor's FP8 line: which kernels read the e4m3 copies on ``device``, or why none can."""
    from .ops.fp8 import gemv, marlin, quant, w8a8

    why = marlin.available(device)
    if why is not None:
        decode = f"unavailable: {why.describe()}"
    else:
        one_row = gemv.available(device)
        decode = ("e4m3 weights, bf16 activations: one request through the plugin's one-row "
                  "FP8 GEMV (its lm_head too where named: sensenova_lm_head), batched steps "
                  "through vLLM Marlin W8A16" if one_row is None else
                  "e4m3 weights, bf16 activations through vLLM Marlin W8A16 (one request "
                  f"too: {one_row.describe()})")
    # torch's CPU kernel runs W8A8 for the tests; the paths themselves run on CUDA only.
    why = (w8a8.w8a8_available(device) if device != "cpu"
           else quant.NO_FP8.because("device is cpu"))
    steps = ("W8A8 (torch._scaled_mm, e4m3 weights and per-row activation scales)"
             if why is None else f"unavailable: {why.describe()}")
    return f"decode steps: {decode}; denoising steps: {steps}"


def _support_for(matrix: dict, minor: str) -> str:
    for version, what in matrix.items():
        if version.startswith(minor):
            return what
    return matrix.get("other", "no entry for this version")


def _print_doctor(report: dict) -> None:
    print("vllm-omni-graphdecode doctor")
    print(f"  python {report['python']}")
    for dist, version in report["versions"].items():
        print(f"  {dist:24s} {version}")
    if report.get("gpu"):
        print(f"  GPU: {report['gpu']} (compute capability {report['compute_capability']})")
    else:
        print(f"  GPU: none: {report['why']}")
    print(f"  paged-attention kernel: {report['paged_attention_kernel']}")
    print(f"  Qwen-Image-2.1 fast step's {report['dense_attention']}")
    print(f"  {report['decode_step_ops']}")
    print(f"  SenseNova-U1 decode step ({config.SENSENOVA_STEP_VAR}): "
          f"{report['sensenova_decode_step']}")
    print(f"  FP8 weights ({config.FP8_VAR}): {report['fp8_weights']}")
    print(f"  vllm-omni supported: {report['vllm_omni_supported']}")
    if "config_error" in report:
        print(f"  configuration: INVALID: {report['config_error']}")
    else:
        print("  configuration:")
        for var, value in report["config"].items():
            print(f"    {var}={value}")
    print("  hooks (vllm-omni version -> what happens):")
    for model, matrix in report["hooks"].items():
        print(f"    {model}:")
        for version, what in matrix.items():
            print(f"      {version}: {what}")
    for model, what in report.get("this_install", {}).items():
        print(f"  with this install, {model}: {what}")


def stats_table(paths: list[str]) -> tuple[str, int]:
    """The snapshots at ``paths`` (files, or folders of ``*.json``) as one table; (text, exit code:
    0, or 1 when a path holds no readable snapshot)."""
    import glob
    import os

    files: list[str] = []
    for path in paths:
        files += sorted(glob.glob(os.path.join(path, "*.json"))) if os.path.isdir(path) else [path]
    rows, problems = [], []
    for path in files:
        try:
            with open(path) as f:
                snap = json.load(f)
        except (OSError, ValueError) as exc:
            problems.append(f"{path}: unreadable ({exc})")
            continue
        pid = snap.get("pid", "?")
        for line in snap.get("wired", []):
            rows.append((pid, "wired", line, ""))
        for kind in ("counters", "fallbacks", "degraded"):
            for key, n in snap.get(kind, {}).items():
                rows.append((pid, kind, key, str(n)))
    if not files:
        problems.append(f"no snapshot found in {', '.join(paths)}")
    width = max([len(r[2]) for r in rows if r[1] != "wired"] + [20])
    out = [f"{'pid':>8}  {'kind':9}  {'what':{width}}  count"]
    for pid, kind, what, n in rows:
        out.append(f"{pid:>8}  {kind:9}  {what:{width}}  {n}" if kind != "wired"
                   else f"{pid:>8}  {kind:9}  {what}")
    return "\n".join(out + problems), 1 if problems else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m vllm_omni_graphdecode")
    sub = parser.add_subparsers(dest="command", required=True)
    doc = sub.add_parser("doctor", help="versions, GPU, kernel, configuration, which hooks apply")
    doc.add_argument("--json", action="store_true", help="print the report as JSON")
    demo = sub.add_parser("demo", help="run tiny real models through the plugin and report")
    demo.add_argument("--json", action="store_true", help="also print the stats as JSON")
    st = sub.add_parser("stats", help="one table of the stats files worker processes wrote "
                                      "(VLLM_OMNI_GRAPHDECODE_STATS_FILE)")
    st.add_argument("paths", nargs="+", help="snapshot files, or folders of *.json snapshots")
    args = parser.parse_args(argv)

    if args.command == "doctor":
        report = doctor_report()
        if args.json:
            print(json.dumps(report, indent=2))
        else:
            _print_doctor(report)
        return 0 if "config_error" not in report else 2
    if args.command == "demo":
        from .testing import demo as demo_mod

        return demo_mod.main(json_stats=args.json)
    if args.command == "stats":
        text, code = stats_table(args.paths)
        print(text)
        return code
    return 2


if __name__ == "__main__":
    sys.exit(main())
