"""Where a static SWA decode step parts from the growing cache's, on this machine's device.

docs/gpu.md (sixth run): the dropping step captured as a CUDA graph at the Llama-3.1-8B shape,
16 x 8,192, bf16, stopped at a device-side assert; on a tiny float32 Llama it gives the growing
cache's tokens eager, under inductor and captured. Run each way in its own process (an assert
ends the CUDA context), with ``CUDA_LAUNCH_BLOCKING=1`` for the failing op's stack:

    python probes/gpu_static_probe.py eager|default|reduce-overhead              # tiny Llama
    python probes/gpu_static_probe.py reduce-overhead --shape llama-3.1-8b --batch 16 \\
        --prompt-tokens 8192 --dtype bfloat16                                    # the failing run

``eager``: the static cache's eager step; ``default``: inductor's code, no CUDA graphs;
``reduce-overhead``: captured. Prints whether the tokens equal the growing cache's, or the
traceback; where they part, the static cache is run again fed the growing cache's tokens
(teacher forcing) and each step's largest logit difference is printed beside the growing
cache's gap between its two best logits where the choices differ: a difference near the gap
is a float near-tie (bfloat16 with random weights has many), one far above it a wrong step.

(The seventh GPU run found the sixth's assert with it: inductor's ``argmax`` of an int8 mask.)
"""

import argparse
import sys
import traceback

sys.path.insert(0, "tests")
import torch  # noqa: E402
from conftest import tiny_llama  # noqa: E402
from test_static_cache import decode  # noqa: E402

from alisa import AlisaCache, AlisaConfig  # noqa: E402
from experiments.shapes import load_benchmark_model, random_prompts  # noqa: E402
from tests.architectures import prompts  # noqa: E402


def inputs(args, device: str):
    """(model, ids, mask): a tiny Llama with padded rows, or a shape's model with random rows."""
    if args.shape is None:
        model = tiny_llama().to(device, getattr(torch, args.dtype))
        ids, mask = prompts(lengths=(200, 180, 150))
        return model, ids.to(device), mask.to(device)
    model, tokenizer = load_benchmark_model(
        f"shape:{args.shape}", dtype=args.dtype, tokenizer="bytes"
    )
    batch = tokenizer(random_prompts(args.prompt_tokens, args.batch), return_tensors="pt")
    return model, batch["input_ids"].to(device), batch["attention_mask"].to(device)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("how", choices=("eager", "default", "reduce-overhead"))
    parser.add_argument("--shape", help="a shape of experiments.shapes (default: a tiny Llama)")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--prompt-tokens", type=int, default=8192)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model, ids, mask = inputs(args, device)
    config = AlisaConfig(policy="swa", caching_ratio=0.2)
    try:
        growing, grown = decode(model, AlisaCache(model, config), ids, mask, args.steps, model)
        forward = model
        if args.how != "eager":
            forward = torch.compile(model.forward, fullgraph=True, dynamic=False, mode=args.how)
        longest = ids.shape[1] + args.steps + 1
        static = AlisaCache(model, config, max_cache_len=longest)
        tokens = decode(model, static, ids, mask, args.steps, forward)[0]
        equal = torch.equal(tokens.cpu(), growing.cpu())
        print(args.how, "equal to growing:", equal)
        if not equal:
            static = AlisaCache(model, config, max_cache_len=longest)
            _, logits = decode(model, static, ids, mask, args.steps, forward, forced=growing)
            report_ties(grown.float(), logits.float())
    except Exception:
        traceback.print_exc()
        print(args.how, "FAILED")


def report_ties(grown: torch.Tensor, static: torch.Tensor) -> None:
    """Per step, fed the same tokens: the largest logit difference between the caches, and
    where their choices part, the growing cache's gap between its two best logits."""
    top = grown.topk(2, dim=-1).values
    gap = top[..., 0] - top[..., 1]  # (B, steps + 1)
    parted = grown.argmax(-1) != static.argmax(-1)
    difference = (grown - static).abs().amax(-1)
    for step in range(grown.shape[1]):
        rows = parted[:, step].nonzero().flatten().tolist()
        gaps = ", ".join(f"row {r}: gap {gap[r, step].item():.4g}" for r in rows)
        print(f"step {step}: max |logit difference| {difference[:, step].max().item():.4g}", gaps)


if __name__ == "__main__":
    main()
