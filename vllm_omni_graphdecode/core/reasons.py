"""The one shape every "why not" takes: a stable key, what to change, and this occurrence's detail.

Every fallback, refusal and degraded path of the plugin is a ``Reason``. Its ``key`` is short and
never formatted with values: it is the stats key an operator counts by and the text a WARNING
leads with. Values that differ per occurrence (a layer name, a shape, an exception) go into
``detail``, which the first log line shows and the counter ignores. ``hint`` says what to change
to get the fast path back; it is written once, where the reason is defined.

A gate (an eligibility check) returns the first ``Reason`` that applies, or None::

    NOT_CUDA = Reason("not CUDA", "run on a CUDA GPU")
    ...
    return NOT_CUDA.because(f"device is {device}")

A meaning that more than one hook or mechanism can meet (not CUDA, out of memory, a failed
capture, LoRA, offload, ...) has one shared ``Reason`` below, which every one of them imports:
the same fallback counts under the same key for every model.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Reason:
    key: str  # stable: the stats key and the log's reason
    hint: str  # what to change to get the fast path
    detail: str = ""  # this occurrence: not part of the key

    def because(self, detail: object) -> "Reason":
        """This reason with ``detail`` (anything; its ``str`` is kept, shortened to 300 chars)."""
        text = str(detail)
        return dataclasses.replace(self, detail=text if len(text) <= 300 else text[:297] + "...")

    def same(self, other: "Reason | None") -> bool:
        """Whether ``other`` is this reason, whatever its detail."""
        return other is not None and other.key == self.key

    def describe(self) -> str:
        """``key (detail)``: one line for a log or a load summary."""
        return f"{self.key} ({self.detail})" if self.detail else self.key

    def __str__(self) -> str:
        return self.key


# -- reasons every hook and mechanism shares ---------------------------------------------------
# One key per meaning, so a fallback counted for one model sums with the same fallback of another
# (stats keys are "<model>: <reason key>"). A hook names its own case with ``.because(...)``; a
# reason only one hook can have stays in that hook's ``rules``.

NOT_CUDA = Reason("not CUDA", "run it on a CUDA GPU")
AUTOGRAD = Reason("autograd is enabled",
                  "call the pipeline under torch.no_grad() or torch.inference_mode() (diffusers "
                  "pipelines and vllm-omni do)")
OOM = Reason("out of device memory for graph buffers or a capture",
             "free device memory (lower gpu_memory_utilization), or lower what the detail names: "
             "VLLM_OMNI_GRAPHDECODE_MAX_ENTRIES (prefix entries) or _BUCKETS / "
             "_PRECAPTURE_BUCKETS (paged K/V); a denoising shape that ran out runs eagerly "
             "until sleep level 2 (release_captured_graphs) lets it try again")
CAPTURE_FAILED = Reason("CUDA graph capture failed",
                        "report it with the logged error; the shape (for decode: the decode "
                        "path) runs eagerly until sleep level 2 (release_captured_graphs) lets "
                        "it capture again")
RELEASED = Reason("graphs released (sleep) during this request",
                  "nothing to change: the request goes on eagerly; the next one captures again")
PARALLEL = Reason("parallel execution (tensor, sequence, ring or CFG parallel, or sharded weights)",
                  "serve one replica per GPU for graph steps: tensor, sequence and CFG parallel "
                  "size 1, no HSDP/FSDP sharding (the detail names what is set)")
LORA = Reason("dynamic LoRA wrappers in the model (peft / vLLM LoRA layers)",
              "merge the LoRA into the weights (diffusers: fuse_lora, then unload_lora_weights; "
              "a vllm-omni pipeline whose load_lora_weights merges needs nothing more) or serve "
              "without it")
QUANT_KV = Reason("quantized K/V cache: the cache does not hold plain tensors in the model's dtype",
                  "keep the K/V cache unquantized (unset diffusion_kv_cache_dtype)")
OFFLOAD = Reason("offload on the model (CPU, layerwise, sequential or group offload)",
                 "disable offload (--enable-cpu-offload, --enable-layerwise-offload, accelerate "
                 "or diffusers offload hooks): offload moves weights between steps")
HOOKS = Reason("forward hooks on the model (accelerate, diffusers, vllm-omni, torch)",
               "remove forward hooks from the model (cache backends, profilers): a hook runs once "
               "during capture and never at replay")
COMPILED = Reason("torch.compile'd model or blocks",
                  "serve without compiling the model (--enforce-eager), or compile it by regions "
                  "(diffusion_compile_granularity=regional): a decode path takes regionally "
                  "compiled blocks, and so does a fast step mode, which compiles its own step")
STRUCTURE = Reason("the model's layers differ from what the fast step body restates",
                   "use the model's exact step (its fast-step variable in docs/configuration.md, "
                   "set to the exact value); the detail names the layer")
FAST_NOT_HERE = Reason("fast step not applicable; the exact step runs instead",
                       "see the detail; the model's exact step (its fast-step variable in "
                       "docs/configuration.md, set to the exact value) silences this. A fast "
                       "body that failed to build or compile is tried again after sleep level 2 "
                       "(release_captured_graphs) or a change to the model")
# Counted as a degraded path, not a fallback: no step runs eagerly for it. The graphs that read
# the old addresses are dropped and the next step (or request) captures again, so the path goes
# without what it had pooled, once per move.
WEIGHTS_MOVED = Reason("weights moved to other storage since capture (module.to(), .half())",
                       "nothing to change: the graphs that read the old addresses were dropped "
                       "and are captured again; each move costs one capture per shape, so keep "
                       "the model where it is between requests")
# A fallback: the request decoding when the watch saw the change finishes on the model's own
# code (its graphs and fused step read what the model was); the next request walks and captures
# again.
CHANGED = Reason("the model changed while a request decoded (weights moved, a hook, an adapter)",
                 "change the model between requests: the request in flight finished on the "
                 "model's own code, and the next one is checked and captured again")
ARGUMENTS = Reason("called with arguments this hook does not know",
                   "report it with the vllm-omni and diffusers versions (python -m "
                   "vllm_omni_graphdecode doctor); the call runs the model's own code")
