"""Qwen-Image-2.1 in plain diffusers with this plugin's cached-step CUDA graphs (no vLLM-Omni).

This script downloads nothing: pass a local copy of the model, e.g. one fetched beforehand with
``huggingface-cli download Qwen/Qwen-Image-2.1 --local-dir /models/Qwen-Image-2.1``.

    python examples/qwen_image_21_diffusers.py /models/Qwen-Image-2.1 --prompt "a red fox in snow"
    python examples/qwen_image_21_diffusers.py /models/Qwen-Image-2.1 --compare   # eager, then graphs

Needs an NVIDIA GPU, diffusers >= 0.41 (``pip install --no-deps diffusers==0.42.1`` beside
vLLM-Omni) and this package. Step 0 of each request runs as diffusers runs it; every later step
replays a graph captured on the first request. ``--compare`` times both and reports how far the
two images are apart: they need not be bit-identical (see the module docstring of
``vllm_omni_graphdecode.hooks.qwen_image_21`` for what is asserted equal and where).
"""

from __future__ import annotations

import argparse
import time

import torch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model_path", help="local directory of a Qwen-Image-2.1 diffusers checkpoint")
    parser.add_argument("--prompt", default="A capybara reading a book by candlelight, oil painting")
    parser.add_argument("--negative-prompt", default=None, help="with --true-cfg > 1: true CFG")
    parser.add_argument("--true-cfg", type=float, default=1.0)
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--size", type=int, default=1024, help="output side in pixels")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="qwen_image_21.png")
    parser.add_argument("--compare", action="store_true", help="run eagerly first and compare")
    parser.add_argument("--verify", action="store_true",
                        help="check each new graph's first replay against the eager step")
    args = parser.parse_args()

    from diffusers import QwenImage21Pipeline

    from vllm_omni_graphdecode.core import stats
    from vllm_omni_graphdecode.hooks import qwen_image_21

    pipe = QwenImage21Pipeline.from_pretrained(args.model_path, torch_dtype=torch.bfloat16,
                                               local_files_only=True).to("cuda")

    def generate():
        torch.cuda.synchronize()
        start = time.perf_counter()
        image = pipe(prompt=args.prompt, negative_prompt=args.negative_prompt,
                     true_cfg_scale=args.true_cfg, height=args.size, width=args.size,
                     num_inference_steps=args.steps, output_type="pt",
                     generator=torch.Generator("cuda").manual_seed(args.seed)).images
        torch.cuda.synchronize()
        return image, time.perf_counter() - start

    if args.compare:
        generate()  # warm-up: kernels, allocator
        eager, eager_s = generate()
        print(f"eager:  {eager_s * 1e3:8.1f} ms")

    graphs = qwen_image_21.enable(pipe, verify=args.verify)
    image, first_s = generate()  # the first request captures
    print(f"graphs: {first_s * 1e3:8.1f} ms (first request, includes capture)")
    if args.compare:
        image, graph_s = generate()
        diff = (image.float() - eager.float()).abs()
        print(f"graphs: {graph_s * 1e3:8.1f} ms; vs eager: max |diff| {diff.max():.4f}, "
              f"mean {diff.mean():.5f} (pixels in [0, 1])")

    pil = pipe.image_processor.pt_to_numpy(image)
    pipe.image_processor.numpy_to_pil(pil)[0].save(args.out)
    print(f"saved {args.out}")
    print(stats.dumps())
    graphs.disable()


if __name__ == "__main__":
    main()
