"""Run vLLM-Omni's own offline engine (``vllm_omni.entrypoints.omni.Omni``) on tiny checkpoints and
write what came out, for ``tests/test_e2e_engine_gpu.py`` to compare with the plugin off and on.

    python tests/e2e_engine.py --sensenova DIR --qwen DIR --out OUT.json [--text-tokens 32]

Each model gets its own engine (started, used for every request of that model, shut down), in
this order: SenseNova-U1 (``SenseNovaU1Pipeline``) with one text (understanding) request and one
think request (think tokens, then a small image); Qwen-Image-2.1 through vllm-omni's diffusers
adapter (``diffusion_load_format="diffusers"``) with one text-to-image request.

Written to OUT.json (after each model, so a later crash keeps what came before): the decoded
text and think text with their token ids (re-encoded with the checkpoint's byte-level tokenizer:
one token per byte), every image's shape and sha256 (the raw uint8 array goes to a ``.npy``
beside OUT.json), engine start and request times, this process's pid, and the snapshots that
the engine's processes wrote through ``VLLM_OMNI_GRAPHDECODE_STATS_FILE`` (when set, with
``{pid}``): the plugin's counters live in vllm-omni's diffusion worker, a separate process, and
this is how they come back. The plugin's load log line is not looked for here: it reaches this
process's stdout from the worker, which the caller captures.

The plugin is whatever the environment says (``VLLM_OMNI_GRAPHDECODE``, ``VLLM_PLUGINS``); this
script never imports it, so that only vllm-omni's own plugin loading can bring it in.
"""

from __future__ import annotations

import argparse
import contextlib
import glob
import hashlib
import json
import os
import sys
import time
import traceback

SENSENOVA_PROMPT = "Describe a red cube on a wooden table in one sentence."
THINK_PROMPT = "A red cube on a wooden table."
QWEN_PROMPT = "a red cube on a wooden table"
SEED = 0
IMAGE_SIZE = 32  # SenseNova-U1 tiny: 16 px per latent token (patch 8 x merge 2); Qwen: VAE 16x


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sensenova", metavar="DIR", help="tiny SenseNova-U1 checkpoint directory")
    p.add_argument("--qwen", metavar="DIR", help="tiny diffusers QwenImage21Pipeline directory")
    p.add_argument("--out", required=True, metavar="JSON",
                   help="results file (.npy files beside it)")
    p.add_argument("--text-tokens", type=int, default=32,
                   help="max_tokens of the SenseNova-U1 text request (greedy)")
    p.add_argument("--sensenova-steps", type=int, default=2,
                   help="denoising steps of the think request's image (1 gives NaN here)")
    p.add_argument("--qwen-steps", type=int, default=4,
                   help="Qwen-Image-2.1 steps: step 0 extracts the prefix K/V, later ones replay")
    p.add_argument("--init-timeout", type=int, default=300, help="engine start limit, seconds")
    args = p.parse_args(argv)
    if not args.sensenova and not args.qwen:
        p.error("give --sensenova DIR and/or --qwen DIR")
    for name in ("sensenova", "qwen"):
        path = getattr(args, name)
        if path and not os.path.isdir(path):
            p.error(f"--{name} {path}: not a directory")
    if args.sensenova_steps < 2 or args.qwen_steps < 2:
        p.error("steps must be >= 2 (one step divides by zero in the tiny schedulers)")
    return args


# ---------------------------------------------------------------------------------------------
# Reading OmniRequestOutput without depending on more of its layout than needed
# ---------------------------------------------------------------------------------------------

def _walk(value, path=""):
    """Yield (path, leaf) for every str / image-like leaf inside dicts, lists and tuples."""
    if isinstance(value, dict):
        for k, v in value.items():
            yield from _walk(v, f"{path}.{k}" if path else str(k))
    elif isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            yield from _walk(v, f"{path}[{i}]")
    else:
        yield path, value


def _as_uint8(image):
    import numpy as np

    if hasattr(image, "detach"):  # torch tensor: CHW or HWC floats in [0, 1] or [-1, 1]
        image = image.detach().float().cpu().numpy()
    arr = np.asarray(image)
    if arr.dtype != np.uint8:
        if arr.ndim == 3 and arr.shape[0] in (1, 3) and arr.shape[-1] not in (1, 3):
            arr = arr.transpose(1, 2, 0)
        lo = -1.0 if arr.min() < 0 else 0.0
        arr = np.clip(np.rint((arr - lo) / (1.0 - lo) * 255.0), 0, 255).astype(np.uint8)
    return arr


def _is_image(value) -> bool:
    try:
        from PIL import Image

        if isinstance(value, Image.Image):
            return True
    except ImportError:
        pass
    shape = getattr(value, "shape", None)
    return shape is not None and len(shape) in (3, 4) and min(shape[-3:]) > 0


def _images(out) -> list:
    found = list(getattr(out, "images", None) or [])
    if not found:
        mm = getattr(out, "multimodal_output", None) or {}
        found = [v for p, v in _walk(mm) if _is_image(v)]
    return found


def _strings(out) -> dict[str, str]:
    mm = getattr(out, "multimodal_output", None) or {}
    custom = getattr(out, "custom_output", None) or {}
    return {p: v for p, v in _walk({"mm": mm, "custom": custom}) if isinstance(v, str)}


def _record_images(out, stem: str, outdir: str) -> list[dict]:
    import numpy as np

    records = []
    for i, image in enumerate(_images(out)):
        arr = _as_uint8(image)
        path = os.path.join(outdir, f"{stem}-{i}.npy")
        np.save(path, arr)
        records.append({"npy": os.path.basename(path), "shape": list(arr.shape),
                        "sha256": hashlib.sha256(arr.tobytes()).hexdigest(),
                        "mean": float(arr.mean())})
    return records


def _check_error(out) -> None:
    error = getattr(out, "error", None)
    if error:
        raise RuntimeError(f"request failed in the engine: {error}")


# ---------------------------------------------------------------------------------------------
# Engines
# ---------------------------------------------------------------------------------------------

def _stats_files() -> dict[str, tuple[int, int]]:
    """Every stats file the engines' processes wrote so far, with its inode and modification time
    (each write replaces the file: a new inode even where timestamps are coarse)."""
    template = os.environ.get("VLLM_OMNI_GRAPHDECODE_STATS_FILE", "")
    if template in ("", "0"):
        return {}
    found = {}
    for path in glob.glob(template.replace("{pid}", "*")):
        try:
            st = os.stat(path)
            found[path] = (st.st_ino, st.st_mtime_ns)
        except OSError:  # removed between the listing and the stat
            pass
    return found


def _written_since(before: dict[str, tuple[int, int]]) -> list[str]:
    """The stats files written since `before`: new ones, and ones written again. vllm-omni 0.30
    runs a single diffusion stage inside the client process, so both models' engines write the
    same process's file in turn."""
    return [path for path, seen in _stats_files().items() if before.get(path) != seen]


def _read_stats(paths) -> list[dict]:
    snaps = []
    for path in sorted(paths):
        try:
            with open(path) as f:
                snaps.append(dict(json.load(f), file=os.path.basename(path)))
        except (OSError, ValueError) as exc:
            snaps.append({"file": os.path.basename(path), "error": repr(exc)})
    return snaps


def _generate(omni, prompt, params):
    start = time.perf_counter()
    outs = omni.generate([prompt], params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    if len(outs) != 1:
        raise RuntimeError(f"expected one output, got {len(outs)}")
    _check_error(outs[0])
    return outs[0], elapsed


def run_sensenova(ckpt: str, args, outdir: str) -> dict:
    from transformers import AutoTokenizer
    from vllm_omni.inputs.data import OmniDiffusionSamplingParams

    tok = AutoTokenizer.from_pretrained(ckpt)
    result: dict = {"requests": {}}
    # The tiny checkpoint's config.json says model_type "sensenova_u1"; vllm-omni 0.26 maps only
    # the released model's "neo_chat" to the pipeline, so name the pipeline class.
    with _engine(result, args, model=ckpt, model_class_name="SenseNovaU1Pipeline") as omni:
        params = OmniDiffusionSamplingParams(
            seed=SEED, extra_args={"max_tokens": args.text_tokens, "do_sample": False})
        out, took = _generate(omni, {"prompt": SENSENOVA_PROMPT, "modalities": ["text"]}, params)
        strings = _strings(out)
        text = (getattr(out, "multimodal_output", None) or {}).get("text")
        if not isinstance(text, str):
            text = next((v for p, v in strings.items() if p.endswith("text")), None)
        result["requests"]["text"] = {
            "text": text, "ids": tok.encode(text or "", add_special_tokens=False),
            "strings": strings, "s": round(took, 3)}

        # think: the pipeline's _generate_think decodes until </think> or <|im_end|>, at most 1024
        # tokens (fixed in the pipeline), then denoises a small image on that context.
        params = OmniDiffusionSamplingParams(
            seed=SEED, height=IMAGE_SIZE, width=IMAGE_SIZE,
            num_inference_steps=args.sensenova_steps, extra_args={"think": True})
        out, took = _generate(omni, {"prompt": THINK_PROMPT}, params)
        strings = _strings(out)
        think = next((v for p, v in strings.items() if p.endswith("think_text")), None)
        result["requests"]["think"] = {
            "think_text": think, "ids": tok.encode(think or "", add_special_tokens=False),
            "strings": strings, "images": _record_images(out, "sensenova-think", outdir),
            "s": round(took, 3)}
    return result


def run_qwen(ckpt: str, args, outdir: str) -> dict:
    from vllm_omni.inputs.data import OmniDiffusionSamplingParams

    result: dict = {"requests": {}}
    with _engine(result, args, model=ckpt, diffusion_load_format="diffusers") as omni:
        params = OmniDiffusionSamplingParams(
            seed=SEED, height=IMAGE_SIZE, width=IMAGE_SIZE, num_inference_steps=args.qwen_steps)
        out, took = _generate(omni, {"prompt": QWEN_PROMPT}, params)
        result["requests"]["t2i"] = {"images": _record_images(out, "qwen-t2i", outdir),
                                     "strings": _strings(out), "s": round(took, 3)}
    return result


@contextlib.contextmanager
def _engine(result: dict, args, **kwargs):
    """vLLM-Omni's offline engine for the body, its start and shutdown times into ``result``."""
    from vllm_omni.entrypoints.omni import Omni

    start = time.perf_counter()
    omni = Omni(stage_init_timeout=args.init_timeout, init_timeout=args.init_timeout + 60,
                **kwargs)
    result["init_s"] = round(time.perf_counter() - start, 2)
    try:
        yield omni
    finally:
        start = time.perf_counter()
        omni.shutdown()
        result["shutdown_s"] = round(time.perf_counter() - start, 2)


def _versions() -> dict[str, str | None]:
    import importlib.metadata as md

    found = {}
    for dist in ("vllm", "vllm-omni", "diffusers", "torch", "transformers",
                 "vllm-omni-graphdecode"):
        try:
            found[dist] = md.version(dist)
        except md.PackageNotFoundError:
            found[dist] = None
    eps = {}
    for group in ("vllm.general_plugins", "vllm_omni.general_plugins"):
        eps[group] = sorted(ep.name for ep in md.entry_points(group=group))
    return {"versions": found, "entry_points": eps}


def main(argv=None) -> int:
    args = parse_args(argv)
    outdir = os.path.dirname(os.path.abspath(args.out))
    os.makedirs(outdir, exist_ok=True)
    env_keys = sorted(k for k in os.environ
                      if k.startswith(("VLLM_OMNI_GRAPHDECODE", "VLLM_PLUGINS", "CUDA_VISIBLE")))
    report = {"pid": os.getpid(), "argv": sys.argv, "env": {k: os.environ[k] for k in env_keys},
              **_versions(), "models": {}}

    def write():
        with open(args.out, "w") as f:
            json.dump(report, f, indent=2)

    runs = [("sensenova_u1", args.sensenova, run_sensenova), ("qwen_image_21", args.qwen, run_qwen)]
    failed = False
    for model, ckpt, run in runs:
        if not ckpt:
            continue
        before = _stats_files()
        print(f"e2e_engine: {model}: starting the engine on {ckpt}", flush=True)
        try:
            entry = run(ckpt, args, outdir)
        except BaseException as exc:  # record and go on: the next model's evidence still counts
            entry = {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()}
            failed = True
            print(f"e2e_engine: {model}: FAILED: {entry['error']}", flush=True)
            if isinstance(exc, KeyboardInterrupt):
                raise
        # Let the stats land: a worker's exit-time write (0.26 spawns a worker per engine), or
        # the write at the end of the plugin's one-second interval (0.30 serves inline, in this
        # process, which does not exit between the two engines).
        time.sleep(1.5)
        entry["worker_stats"] = _read_stats(_written_since(before))
        report["models"][model] = entry
        write()
        print(f"e2e_engine: {model}: done", flush=True)
    # What the plugin did in this (client) process: nothing, when the worker is a separate one.
    stats = sys.modules.get("vllm_omni_graphdecode.core.stats")
    report["client_stats"] = stats.snapshot() if stats is not None else None
    write()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
