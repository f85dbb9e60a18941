"""The plugin's environment variables, parsed once, with errors that say what is accepted.

Every setting the plugin reads is declared in ``SETTINGS`` below, with its meaning: README's
configuration table and docs/configuration.md are written from it (``scripts/gen_config_docs.py``),
and ``python -m vllm_omni_graphdecode doctor`` prints the parsed values.
A bad value raises ``ConfigError`` at start-up naming the variable, the value and what is accepted:
a typo must not silently leave the server on the slow path.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Callable, Mapping

from .models import MODEL_KEYS

ENABLE_VAR = "VLLM_OMNI_GRAPHDECODE"
BUCKETS_VAR = "VLLM_OMNI_GRAPHDECODE_BUCKETS"
PRECAPTURE_VAR = "VLLM_OMNI_GRAPHDECODE_PRECAPTURE"
PRECAPTURE_BUCKETS_VAR = "VLLM_OMNI_GRAPHDECODE_PRECAPTURE_BUCKETS"
TOKENS_PER_LAUNCH_VAR = "VLLM_OMNI_GRAPHDECODE_TOKENS_PER_LAUNCH"
SENSENOVA_STEP_VAR = "VLLM_OMNI_GRAPHDECODE_SENSENOVA_STEP"
SENSENOVA_DENOISE_VAR = "VLLM_OMNI_GRAPHDECODE_SENSENOVA_DENOISE"
SENSENOVA_BATCH_VAR = "VLLM_OMNI_GRAPHDECODE_SENSENOVA_BATCH"
SENSENOVA_DENOISE_ORDER_VAR = "VLLM_OMNI_GRAPHDECODE_SENSENOVA_DENOISE_ORDER"
SENSENOVA_BESIDE_DECODE_VAR = "VLLM_OMNI_GRAPHDECODE_SENSENOVA_DENOISE_BESIDE_DECODE"
FP8_VAR = "VLLM_OMNI_GRAPHDECODE_FP8"
# The hot paths that can read FP8 weight copies (issue #23); ``on`` means all of them.
FP8_PATHS = ("sensenova_decode", "sensenova_denoise", "qwen_image_21")
# Named only, never by ``on``: SenseNova-U1's lm_head in FP8 too (the layer that picks the token;
# vLLM's ``--quantization fp8`` keeps lm_head unquantised as well).
FP8_NAMED_ONLY = ("sensenova_lm_head",)
# A launch records this many decode steps in one graph: capture time and graph memory grow with it.
MAX_TOKENS_PER_LAUNCH = 64
# Unset, the pre-capture buckets are the configured buckets up to this length: what a think
# request (1024 tokens from a prompt of a few hundred) passes through.
PRECAPTURE_UP_TO = 2048

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


class ConfigError(ValueError):
    """An environment variable of this plugin holds a value it does not accept."""


def _bad(var: str, raw: str, accepted: str) -> ConfigError:
    return ConfigError(f"{var}={raw!r} is not accepted; accepted: {accepted}")


def _parse_models(var: str, raw: str) -> frozenset[str]:
    value = raw.strip().lower()
    if value in ("", "0", "off", "false", "none"):
        return frozenset()
    if value in ("1", "all", "on", "true"):
        return frozenset(MODEL_KEYS)
    keys = [k.strip() for k in value.split(",") if k.strip()]
    unknown = [k for k in keys if k not in MODEL_KEYS]
    if unknown or not keys:
        raise _bad(var, raw, "unset or 0 (off), 1 or all (every model), or a comma list of "
                   + ", ".join(MODEL_KEYS))
    return frozenset(keys)


def _parse_bool(var: str, raw: str) -> bool:
    value = raw.strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise _bad(var, raw, "1/true/yes/on or 0/false/no/off")


def _steps_or_all(var: str, raw: str) -> int | None:
    value = raw.strip().lower()
    if value == "all":
        return None
    if value.isdigit() and int(value) >= 1:
        return int(value)
    raise _bad(var, raw, "a positive number of steps, or all (no limit)")


def _choice(*choices: str) -> Callable[[str, str], str]:
    def parse(var: str, raw: str) -> str:
        value = raw.strip().lower()
        if value not in choices:
            raise _bad(var, raw, ", ".join(choices))
        return value
    return parse


def _positive_int(var: str, raw: str) -> int:
    try:
        value = int(raw.strip())
    except ValueError:
        raise _bad(var, raw, "a positive integer") from None
    if value <= 0:
        raise _bad(var, raw, "a positive integer")
    return value


def _tokens_per_launch(var: str, raw: str) -> int:
    accepted = f"an integer from 1 to {MAX_TOKENS_PER_LAUNCH}"
    try:
        value = int(raw.strip())
    except ValueError:
        raise _bad(var, raw, accepted) from None
    if not 1 <= value <= MAX_TOKENS_PER_LAUNCH:
        raise _bad(var, raw, accepted)
    return value


def _int_list_or_unset(var: str, raw: str) -> tuple[int, ...]:
    return () if raw.strip() == "" else _int_list(var, raw)


def _int_list(var: str, raw: str) -> tuple[int, ...]:
    accepted = "a comma list of increasing positive multiples of 16, e.g. 512,1024,2048"
    try:
        values = tuple(int(v) for v in raw.split(",") if v.strip())
    except ValueError:
        raise _bad(var, raw, accepted) from None
    if (not values or any(v <= 0 or v % 16 for v in values)
            or any(b <= a for a, b in zip(values, values[1:]))):
        raise _bad(var, raw, accepted)
    return values


def _parse_fp8(var: str, raw: str) -> frozenset[str]:
    value = raw.strip().lower()
    if value in ("", "0", "off", "false", "no"):
        return frozenset()
    if value in ("1", "on", "true", "yes", "all"):
        return frozenset(FP8_PATHS)
    paths = [p.strip() for p in value.split(",") if p.strip()]
    accepted = FP8_PATHS + FP8_NAMED_ONLY
    if not paths or any(p not in accepted for p in paths):
        raise _bad(var, raw, "off (default), on (every FP8 path but the lm_head), or a comma "
                   "list of " + ", ".join(accepted))
    if "sensenova_lm_head" in paths and "sensenova_decode" not in paths:
        raise _bad(var, raw, "sensenova_lm_head together with sensenova_decode (the lm_head "
                   "copy is read by the FP8 decode step), e.g. sensenova_decode,sensenova_lm_head")
    return frozenset(paths)


def _path_or_off(var: str, raw: str) -> str:
    value = raw.strip()
    return "" if value.lower() in ("", "0", "off", "false", "no") else value


@dataclasses.dataclass(frozen=True)
class Setting:
    """One variable: how it is read, and what it means, said once.

    ``short`` is the README table's cell (one line, at most ~160 characters); ``long`` (Markdown,
    links relative to docs/) is the rest of its meaning in docs/configuration.md. Both are written
    from here by ``scripts/gen_config_docs.py``; a CPU test fails when either page is stale.
    ``accepts`` says what is accepted where the parser refuses nothing (the docs otherwise take
    it from the parser's own error message).
    """

    var: str
    default: str
    parse: Callable[[str, str], object]
    field: str
    short: str
    long: str = ""
    accepts: str = ""


SETTINGS: tuple[Setting, ...] = (
    Setting(ENABLE_VAR, "0", _parse_models, "models",
            "Turns the plugin on: unset or `0` off; `1` or `all` every model; or a comma list of "
            + ", ".join(f"`{k}`" for k in MODEL_KEYS) + ".",
            "The model keys are the rows of `models.py`. The plugin registers under both "
            "`vllm.general_plugins` and `vllm_omni.general_plugins`; the variable reaches "
            "vLLM-Omni's worker processes through the environment. A `VLLM_PLUGINS` allow-list "
            "must name `vllm_omni_graphdecode` too "
            "([serving](serving.md#how-the-plugin-is-loaded-and-vllm_plugins))."),
    Setting("VLLM_OMNI_GRAPHDECODE_VERIFY", "0", _parse_bool, "verify",
            "`1`: the first replay of every new graph is compared with the eager step; a mismatch "
            "disables that graph (WARNING) and the request goes on eagerly.",
            "Costs one eager step per new graph. A sampling text loop's graph is compared with "
            "the eager step drawing from the same generator state. What the WARNING says: "
            "[reading the log]"
            "(reading-the-log.md#warning-lines-what-runs-slower-and-what-to-change)."),
    Setting(PRECAPTURE_VAR, "1", _parse_bool, "precapture",
            "At model load, capture SenseNova-U1's decode graphs for the pre-capture buckets and "
            "compile Qwen-Image-2.1's 1024x1024 fast step; `0`: both on first use.",
            "With it the first request decodes at the steady speed and pays no compile; the load "
            "line says how long the captures took and how much device memory they hold "
            "([reading the log](reading-the-log.md#the-load-line)). Why it is on: "
            "[performance](performance.md#how-each-default-was-set)."),
    Setting("VLLM_OMNI_GRAPHDECODE_FA_VERSION", "auto", _choice("auto", "2", "3"), "fa_version",
            "FlashAttention for SenseNova-U1's one-request paged decode: `auto` (FA3 on Hopper "
            "when vllm's build has it, else FA2), `2` or `3`.",
            "The batched step (`--max-num-seqs` above 1) always runs vLLM's Triton decode "
            "attention with a fixed split per row, so that a row's result does not depend on "
            "its neighbours. `python -m vllm_omni_graphdecode doctor` names the kernel that "
            "runs. Why FA3: [performance](performance.md#how-each-default-was-set)."),
    Setting("VLLM_OMNI_GRAPHDECODE_SENSENOVA_INTREE", "defer", _choice("defer", "takeover"),
            "sensenova_intree",
            "vllm-omni 0.30 and newer: `defer` leaves its in-tree SenseNova-U1 paged decode in "
            "charge; `takeover` puts the plugin's decode context and step in its place.",
            "`defer` applies to a server that decodes one request at a time. Under "
            "`--max-num-seqs` above 1 (batched decode) or with `VLLM_OMNI_GRAPHDECODE_FP8` naming "
            "`sensenova_decode`, the plugin's decode serves whatever this says (the in-tree step "
            "has neither); the two never run together. vllm-omni 0.24-0.28 have no in-tree "
            "decode. Why `defer`: [performance](performance.md#how-each-default-was-set)."),
    Setting(TOKENS_PER_LAUNCH_VAR, "8", _tokens_per_launch, "tokens_per_launch",
            "SenseNova-U1 think/text decode: tokens per graph launch (1 to 64), each next token "
            "chosen on the device; stop tokens and the limit are checked once per launch.",
            "Each next token is the loop's argmax or, for a text loop that samples (`do_sample` "
            "with a temperature), a draw with the loop's own `softmax(logits / temperature)` and "
            "`multinomial` from the CUDA generator: a seeded request decodes the same text with "
            "or without a graph capture in it. Tokens decoded past a stop are discarded with "
            "their K/V (they still draw, so the next request's draws start later than eagerly). "
            "`1`: one launch and one host sync per token, the loop picking or drawing each token "
            "itself. A launch records this many steps in one graph: capture time and graph "
            "memory grow with it."),
    Setting(SENSENOVA_STEP_VAR, "auto",
            _choice("auto", "fused", "tuned", "rowgemv", "exact"), "sensenova_step",
            "SenseNova-U1's decode step: `auto` (`rowgemv` on Hopper, else `fused`), `fused` "
            "(fused norms, cuBLAS), `tuned`, `rowgemv` (the plugin's bf16 GEMV), `exact`.",
            "- `auto` (default): `rowgemv` on a Hopper GPU (compute capability 9.x: H100, "
            "H200), where its GPU tests ran and its block sizes were measured, `fused` on any "
            "other device. The load line names the step that runs.\n"
            "- `fused`: each layer's norms and first residual add through vllm's fused "
            "kernels, on vllm-omni 0.24-0.28 the rope tables once per step, the q/k norm + rope "
            "and the paged K/V write as one launch (`hooks/sensenova_u1/rope_store.py`, the same "
            "bits as vllm-omni's rope kernel followed by vLLM's writer), the linear layers the "
            "modules' own (cuBLAS). It rounds slightly differently from the model's own step, "
            "the same in every process.\n"
            "- `tuned`: `fused` with the linear layers through Inductor's GEMVs and the MLP's "
            "SiLU-and-multiply, down projection and residual add as one Inductor kernel, "
            "compiled at load with pre-capture. Faster, but the GEMVs pick their block sizes by "
            "timing, so another process may round a request differently and two servers can "
            "answer it differently.\n"
            "- `rowgemv`: `fused` with the linear layers through the plugin's one-row GEMV on "
            "the bf16 weights themselves (`ops/row_linears.py`: block sizes from the shape, none "
            "picked by timing; the MLP in two launches, the SiLU-and-multiply in the "
            "gate-up one and the residual add in the down one, the RMSNorms after o_proj and "
            "down in their launches; on Hopper each launch a programmatic dependent launch, the "
            "same bits), `lm_head` too: 1.10-1.12x "
            "`fused` on the H200 and on an H100, the same answers in two processes. With "
            "`--max-num-seqs` above 1 the batched step's linear layers read the plugin's "
            "16-row GEMM instead (`ops/rows_gemm.py`, block sizes from the shape; the batched "
            "step 2-4% faster than with cuBLAS at 1-16 rows on an H100, each request "
            "answering as alone; 8 think requests over HTTP 2.31x the release against 2.28x "
            "with cuBLAS). It rounds differently from `fused` (another sum order), the same "
            "in every process.\n"
            "- `exact`: the model's own modules, as its eager step computes.\n\n"
            "With `--max-num-seqs` above 1 the batched step runs the `fused` parts with cuBLAS "
            "for `fused`, `tuned` and `exact` (`tuned`'s GEMVs are picked by timing, and the "
            "batched step's kernels must reduce each row alike at any batch and in any "
            "process). Speed of each: [performance](performance.md#how-each-default-was-set)."),
    Setting(SENSENOVA_DENOISE_VAR, "graph", _choice("off", "graph", "fast"), "sensenova_denoise",
            "SenseNova-U1 denoising: `graph` replays each CFG branch's step as a CUDA graph (bit"
            " for bit), `fast` a compiled restated step (it rounds differently), `off`.",
            "On every vllm-omni 0.24-0.30, whether or not the in-tree decode is in charge.\n\n"
            "- `graph` replays each CFG branch's step (cond, uncond, img_cond) as a CUDA graph "
            "over static prefix + image K/V buffers owned by that request branch; the step is "
            "the pipeline's own code (its image bit for bit), the rest of each denoising step "
            "stays eager. About 0.75-0.9 GB more peak memory.\n"
            "- `fast` replays a restated step: per layer the qkv GEMM, q/k norms and 3-D rope as "
            "one Inductor-compiled region, the K/V written into the buffers' image rows, "
            "FlashAttention (FA3 on Hopper) over prefix + image, and o_proj, residual, norm, MLP "
            "and the next layer's norm as a second region, compiled in Inductor's deterministic "
            "mode (no sum order picked by timing, so every process rounds alike). On CPU it "
            "computes the pipeline's bits; on a GPU it rounds differently "
            "([performance](performance.md#sensenova-u1-images)). A compile that fails, or a "
            "layer it does not restate, falls back to the `graph` step with the reason counted.\n"
            "- `off` leaves the pipeline's steps alone.\n\n"
            "Unset while `VLLM_OMNI_GRAPHDECODE_FP8` names `sensenova_denoise` (or is `on`), the "
            "mode is `fast` with its 168 linear layers W8A8 (8.11 GB of e4m3 copies); set to "
            "`graph`, FP8 does not run there (counted as `FP8 weights need the fast denoising "
            "mode`).\n\n"
            "A new prompt length is a new graph, captured in the request's first step; at most 3 "
            "idle entries stay between requests (~0.5 GB each at 1024x1024), least recently used "
            "dropped first. With cache backends (cache-dit, TeaCache), CFG or sequence "
            "parallelism, offload, LoRA wrappers or off CUDA a branch runs the pipeline's own "
            "step with the reason counted."),
    Setting(SENSENOVA_BATCH_VAR, "auto", _choice("auto", "off"), "sensenova_batch",
            "SenseNova-U1 under load (vllm-omni 0.28+): `auto` batches its requests' decode, "
            "with `--step-execution` continuously; `off`: the release's refusal.",
            "With `auto` the pipeline declares request batching where vLLM-Omni's engine starts, "
            "so `vllm serve ... --omni --max-num-seqs N` starts, and the think and text loops of "
            "the requests the engine hands one `forward` decode together as rows of one 16-row "
            "batched step, every request of such a server included (a batch of one too); a "
            "request's tokens do not depend on what decodes beside it. With `N` = 1 nothing "
            "changes. Not on vllm-omni 0.24 and 0.26, whose executor can lose a request batch's "
            "outputs: there the server refuses `--max-num-seqs` above 1 as without the plugin, "
            "and the log says why. How it serves: "
            "[serving concurrently](serving.md#serving-sensenova-u1-concurrently).\n\n"
            "`auto` also gives the pipeline vLLM-Omni's step-execution protocol (0.28 and 0.30), "
            "so vLLM-Omni's runner accepts it under `vllm serve ... --omni --step-execution "
            "--max-num-seqs N` (the release's refuses it at load): requests join "
            "the running batch at every step and leave when done, text answers and images in "
            "the same decode launches, and the engine's admission admits SenseNova-U1 requests "
            "of every size and kind together "
            "([continuous batching](serving.md#continuous-batching---step-execution)). It also "
            "declares the engine's request cancellation (an abort stops a batched request at its "
            "next token or denoising step) and serves `n` images per request "
            "(`num_outputs_per_prompt`) from one prefill. With `off` none of this is declared."),
    Setting(SENSENOVA_DENOISE_ORDER_VAR, "fcfs", _choice("fcfs", "round_robin"),
            "sensenova_denoise_order",
            "SenseNova-U1 under `--step-execution`: whose denoising steps a step runs first: "
            "`fcfs` (the oldest request's) or `round_robin` (one each).",
            "Each step of the server runs as many denoising steps as requests denoise, so the GPU "
            "does the same work either way; what changes is who finishes when. With `fcfs` the "
            "oldest denoising request takes the step's denoising steps until its image is done, "
            "then the next: its output leaves as soon as the same work allows, the server formats "
            "it while the GPU goes on, and of requests that need the same work none finishes "
            "later than with `round_robin`. With `round_robin` every denoising request advances "
            "one step a server step, so requests sent together finish together (a small image "
            "behind a large one is not held back by it). Answers do not change: each request runs "
            "its own steps. Request mode (no `--step-execution`) denoises each request of a "
            "forward in turn, as the release."),
    Setting(SENSENOVA_BESIDE_DECODE_VAR, "1", _steps_or_all, "sensenova_denoise_beside_decode",
            "SenseNova-U1 under `--step-execution`: denoising steps a server step runs at most "
            "while requests decode (`all`: one per denoising request).",
            "A decoding request (a text answer, a think phase) gets one batched launch "
            "(`VLLM_OMNI_GRAPHDECODE_TOKENS_PER_LAUNCH` tokens) a server step, and waits for that "
            "step's denoising steps before its next launch. With `all`, eight images denoising "
            "beside one text answer make it wait eight denoising steps at every launch; with the "
            "default `1` it waits one, and the denoising requests take the server steps in "
            "between. Estimated from the H200's figures (1024x1024: a denoising step ~75 ms; a "
            "launch of 8 tokens at 8 rows ~64 ms), a 256-token answer, ~2 s alone, would take "
            "~21 s with `all` and ~4.4 s with `1`; not yet measured under load. The GPU does the "
            "same work either way, while nothing decodes every denoising request's step runs, "
            "and answers do not change."),
    Setting(FP8_VAR, "off", _parse_fp8, "fp8",
            "Opt-in FP8 (e4m3) weight copies on the hot paths: `off`, `on` (all but "
            "`sensenova_lm_head`), or a comma list of paths. They round differently from bf16.",
            "The copies hold one scale per output channel, are made at load from the bf16 "
            "weights, which stay (prefill, the `exact` modes and the fallbacks read them), and "
            "are dropped at sleep level 2 with the graphs that read them. Paths:\n\n"
            "- `sensenova_decode`: SenseNova-U1's think/text decode step reads its 168 linear "
            "layers as e4m3 with bf16 activations: one request at a time through the plugin's "
            "one-row FP8 GEMV (block sizes fixed per shape, so every process rounds alike; "
            "the RMSNorms after o_proj and down in their launches, and on Hopper each launch "
            "a programmatic dependent launch, as the `rowgemv` step), batched steps "
            "(`--max-num-seqs` above 1) through vLLM's Marlin GEMM. 8.1 GB of "
            "copies for SenseNova-U1-8B. On vllm-omni 0.30 it makes the plugin's decode serve "
            "instead of the in-tree one.\n"
            "- `sensenova_denoise`: SenseNova-U1's `fast` denoising body runs its 168 linear "
            "layers W8A8 (8.11 GB of copies); it selects the `fast` mode when "
            "`VLLM_OMNI_GRAPHDECODE_SENSENOVA_DENOISE` is unset.\n"
            "- `qwen_image_21`: Qwen-Image-2.1's `fast` cached step runs its 224 linear layers "
            "W8A8 (each activation row quantised inside the compiled regions, `torch._scaled_mm` "
            "with FP8 fast accumulation, as vLLM's CUTLASS FP8 kernels); 6.98 GB of copies.\n"
            "- `sensenova_lm_head` (named only, never by `on`; with `sensenova_decode`): the "
            "one-request decode step's `lm_head` too, through the one-row GEMV (0.62 GB). It is "
            "the layer that picks the token, so `on` keeps it bf16, as vLLM's `--quantization "
            "fp8` does; a batched step keeps the bf16 head, counted.\n\n"
            "Layers that cannot take a copy (an active LoRA adapter, a quantised or hooked "
            "layer), a GPU without FP8 or `..._SENSENOVA_STEP=exact` run bf16 with the reason "
            "counted; `doctor` says which FP8 kernels run on the machine. Speed and accuracy "
            "(random weights only): [performance](performance.md#fp8-weights)."),
    Setting(BUCKETS_VAR, "512,1024,2048,4096,8192", _int_list, "buckets",
            "SenseNova-U1 decode length buckets (multiples of 16), one graph each; past the last, "
            "buffers grow in steps of the gap between the last two buckets.",
            "A sequence decodes in the smallest bucket that holds it and moves up as it grows. "
            "Past the last bucket the buffers grow by a fixed tail step (4096 by default), not "
            "by doubling: a long think edit then pays a few reallocations and captures, not one "
            "per doubling."),
    Setting(PRECAPTURE_BUCKETS_VAR, "", _int_list_or_unset, "precapture_buckets",
            f"Buckets captured at load, each one of `{BUCKETS_VAR}`; unset: those up to "
            f"{PRECAPTURE_UP_TO} (`512,1024,2048` by default).",
            "A think request (1,024 tokens from a prompt of a few hundred) passes through these. "
            "Their graphs stay when a longer request needs more room: it moves to buffers of its "
            "own, so the next short request captures nothing. Checked only with pre-capture on: "
            "a bucket not among the buckets stops start-up naming both variables."),
    Setting("VLLM_OMNI_GRAPHDECODE_QWEN_MODE", "fast", _choice("fast", "exact"), "qwen_mode",
            "Qwen-Image-2.1 cached steps: `fast` (FlashAttention 3 over one prefix + target K/V "
            "buffer, Inductor-fused elementwise work; rounds differently) or `exact`.",
            "- `fast`: each entry holds one prefix + target K/V buffer (each layer writes its "
            "target K/V into the tail, no `torch.cat`), attention through vllm's FlashAttention "
            "3 (FA2 elsewhere, SDPA last), the block's elementwise work fused by torch.compile "
            "in Inductor's deterministic mode, all captured as one graph. Rounds differently "
            "from diffusers ([performance](performance.md#qwen-image-21)). With pre-capture on "
            "it is compiled at load for 1024x1024; prompts of other lengths never recompile.\n"
            "- `exact`: diffusers' own block code captured as a graph, equal to diffusers bit "
            "for bit.\n\n"
            "A part that cannot run (no FlashAttention build, no Triton, a failed compile) is "
            "logged once with its reason and the step falls back to the next kernel or to "
            "`exact`."),
    Setting("VLLM_OMNI_GRAPHDECODE_MAX_ENTRIES", "16", _positive_int, "max_entries",
            "Qwen-Image-2.1: most prefix-graph entries kept (LRU); each live request branch holds "
            "one, so 16 covers `--max-num-seqs 8` with true CFG.",
            "An idle entry keeps its buffers: at the real shape about 2.3 GB for a 1024x1024 "
            "text-to-image entry and 6.6 GB for a two-reference edit in the fast mode (prefix "
            "and target K/V), 0.1 and 4.4 GB in the exact mode (prefix only). Lower it on a GPU "
            "short of memory. SenseNova-U1's denoising keeps at least three a request the "
            "engine runs at once (`--max-num-seqs`: cond, uncond and an edit's image branch), "
            "and no more than three idle ones."),
    Setting("VLLM_OMNI_GRAPHDECODE_STATS_FILE", "0", _path_or_off, "stats_file",
            "A path: each process that wires a model or counts an event writes its counters there "
            "as JSON (`{pid}`: the process id); `0` off.",
            "Written after each wiring, at most once a second while counting (the last second's "
            "counts when it ends) and at exit. The counters live in vLLM-Omni's worker process, "
            "which no client reaches. Put `{pid}` in the path when several processes count "
            "(workers, forked children): without it they write over one file; a forked child's "
            "file starts from its parent's record at the fork. Read them with "
            "`python -m vllm_omni_graphdecode stats DIR` "
            "([reading the log](reading-the-log.md#counters-and-the-stats-command)).",
            accepts="a path (`{pid}` is replaced by the process id); `0`, `off`, `false`, `no` "
                    "or empty: off"),
)


@dataclasses.dataclass(frozen=True)
class Config:
    models: frozenset[str]
    verify: bool
    precapture: bool
    fa_version: str
    sensenova_intree: str
    buckets: tuple[int, ...]
    precapture_buckets: tuple[int, ...]
    max_entries: int
    qwen_mode: str = "fast"
    stats_file: str = ""
    tokens_per_launch: int = 8
    sensenova_step: str = "auto"
    sensenova_denoise: str = "graph"
    sensenova_batch: str = "auto"
    fp8: frozenset = frozenset()
    sensenova_denoise_order: str = "fcfs"
    sensenova_denoise_beside_decode: int | None = 1

    @property
    def enabled(self) -> bool:
        return bool(self.models)

    def as_env(self) -> dict[str, str]:
        """The parsed values keyed by variable, for logs and `doctor`."""
        return {s.var: _show(getattr(self, s.field)) for s in SETTINGS}


def _show(value: object) -> str:
    if value is None:  # the only None a setting parses to: no limit
        return "all"
    if isinstance(value, bool):
        return "1" if value else "0"
    if isinstance(value, frozenset):
        return ",".join(sorted(value)) or "off"
    if isinstance(value, tuple):
        return ",".join(str(v) for v in value)
    return str(value)


def parse(environ: Mapping[str, str] | None = None) -> Config:
    """Parse the plugin's variables from ``environ`` (default ``os.environ``)."""
    environ = os.environ if environ is None else environ
    values = {}
    for s in SETTINGS:
        raw = environ.get(s.var)
        values[s.field] = s.parse(s.var, s.default if raw is None else raw)
    if "sensenova_denoise" in values["fp8"] and environ.get(SENSENOVA_DENOISE_VAR) is None:
        # FP8 weights exist only in the fast body; asking for them is asking for its rounding.
        values["sensenova_denoise"] = "fast"
    if not values["precapture_buckets"]:
        values["precapture_buckets"] = (
            tuple(b for b in values["buckets"] if b <= PRECAPTURE_UP_TO) or values["buckets"][:1])
    elif values["precapture"] and not set(values["precapture_buckets"]) <= set(values["buckets"]):
        # Checked only when pre-capture is on: off, the list is never read.
        raw_pre = environ.get(PRECAPTURE_BUCKETS_VAR)
        raw_buckets = environ.get(BUCKETS_VAR, _setting(BUCKETS_VAR).default)
        missing = [b for b in values["precapture_buckets"] if b not in values["buckets"]]
        raise ConfigError(
            f"{PRECAPTURE_BUCKETS_VAR}={raw_pre!r} is not accepted with "
            f"{BUCKETS_VAR}={raw_buckets!r}: {', '.join(map(str, missing))} not among the buckets; "
            f"accepted: buckets listed in {BUCKETS_VAR}. To change: list only those, unset "
            f"{PRECAPTURE_BUCKETS_VAR} (the buckets up to {PRECAPTURE_UP_TO}), or set "
            f"{PRECAPTURE_VAR}=0")
    return Config(**values)


def _setting(var: str) -> Setting:
    return next(s for s in SETTINGS if s.var == var)


_CONFIG: Config | None = None


def get() -> Config:
    """The process's configuration, parsed on first use."""
    global _CONFIG
    if _CONFIG is None:
        _CONFIG = parse()
    return _CONFIG


def reset_for_tests(cfg: Config | None = None) -> None:
    global _CONFIG
    _CONFIG = cfg
