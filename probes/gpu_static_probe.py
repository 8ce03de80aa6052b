"""Where a static SWA decode step parts from the growing cache's, on this machine's device.

docs/gpu.md (sixth run): the dropping step captured as a CUDA graph at the Llama-3.1-8B shape,
16 x 8,192, stopped at a device-side assert; on a tiny Llama it gives the growing cache's tokens
eager, under inductor and captured. Run each way in its own process (an assert ends the CUDA
context):

    python probes/gpu_static_probe.py eager|default|reduce-overhead [LENGTHS] [preset]

LENGTHS: comma-separated prompt lengths (200,180,150); ``preset``: the default preset's budget
floor (else none). Prints whether the tokens equal the growing cache's, or the traceback.
"""

import sys
import traceback

sys.path.insert(0, "tests")
import torch  # noqa: E402
from conftest import tiny_llama  # noqa: E402
from test_static_cache import greedy  # noqa: E402

from alisa import AlisaCache, AlisaConfig  # noqa: E402
from experiments.architectures import prompts  # noqa: E402

STEPS = 20


def main(how: str, lengths: tuple[int, ...], floor: bool) -> None:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = tiny_llama().to(device)
    ids, mask = (tensor.to(device) for tensor in prompts(lengths=lengths))
    config = AlisaConfig(
        policy="swa", caching_ratio=0.2, **({} if floor else {"min_budget_tokens": 0})
    )
    try:
        growing = greedy(model, AlisaCache(model, config), ids, mask, STEPS, model)
        static = AlisaCache(model, config, max_cache_len=ids.shape[1] + STEPS + 1)
        forward = model
        if how != "eager":
            forward = torch.compile(model.forward, fullgraph=True, dynamic=False, mode=how)
        tokens = greedy(model, static, ids, mask, STEPS, forward)
        print(how, "equal to growing:", torch.equal(tokens.cpu(), growing.cpu()))
    except Exception:
        traceback.print_exc()
        print(how, "FAILED")


if __name__ == "__main__":
    lengths = (200, 180, 150)
    if len(sys.argv) > 2:
        lengths = tuple(int(length) for length in sys.argv[2].split(","))
    main(sys.argv[1], lengths, floor=len(sys.argv) > 3)
