"""Host round trips of the decode step on CUDA: synchronisations per step and mode, where each
comes from, and one step's kernel profile (issue 26's budget: at most one per layer and step with
``retention="host"``, its fetch list; none when dropping, beyond Hugging Face's own loop).

    python -m probes.gpu_stalls --out results/stalls          # needs CUDA

Each mode prefills ``--batch`` random prompts of a random-weight shape (speed and stalls depend
on shapes, not values), decodes ``--warm-up`` steps, then counts the synchronisations that
``torch.cuda.set_sync_debug_mode("warn")`` reports over ``--steps`` greedy steps, with the
innermost line of alisa (else transformers) that asked for each, then times as many more
(median, each step synchronised). The decode loop is the
model's forward and an argmax, nothing else, so every count is the model's and its cache's.
Writes ``stalls.json`` and one ``profile_<mode>.txt`` per profiled mode (the kernels of one
decode step, by CUDA time) into ``--out``; prints a table and one JSON line.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import traceback
import warnings
from collections import Counter
from pathlib import Path

import torch

# name -> system (experiments.systems); "tiers" is built from the measured weights.
MODES = {
    "hf-dynamic": "hf-dynamic",
    "alisa r=1": "alisa:policy=swa,caching_ratio=1.0",
    "drop swa r=0.2": "alisa:policy=swa,caching_ratio=0.2",
    "drop h2o r=0.2": "alisa:policy=h2o,caching_ratio=0.2",
    "drop swa r=0.2 int8": "alisa:policy=swa,caching_ratio=0.2,kv_bits=8",
    "host r=0.2": "alisa:policy=swa,caching_ratio=0.2,retention=host",
    "host r=0.2 every step": "alisa:policy=swa,caching_ratio=0.2,retention=host,reselect_every=1",
    "host r=0.2 int8": "alisa:policy=swa,caching_ratio=0.2,retention=host,kv_bits=8",
    "host r=0.2 rest": "alisa:policy=swa,caching_ratio=0.2,retention=host,estimate_rest=true",
    "tiers offload": "tiers:never",
    "tiers recompute": "tiers:always",
}
PROFILED = ("hf-dynamic", "drop swa r=0.2", "host r=0.2 every step")


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="shape:llama-3.2-1b")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--prompt-tokens", type=int, default=2048)
    parser.add_argument("--warm-up", type=int, default=4)
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--modes", default=";".join(MODES), help="';'-separated names of MODES")
    parser.add_argument("--out", type=Path, default=Path("results/stalls"))
    return parser.parse_args(argv)


class SyncLog:
    """Counts the synchronisations CUDA's sync debug mode warns about inside the block, by the
    innermost alisa (else transformers, else any) line that caused each."""

    def __init__(self) -> None:
        self.count = 0
        self.sites: Counter[str] = Counter()

    def __enter__(self) -> SyncLog:
        torch.cuda.synchronize()  # what was queued before is not the block's to count
        self._warnings = warnings.catch_warnings()
        self._warnings.__enter__()
        warnings.simplefilter("always")
        self._show = warnings.showwarning
        warnings.showwarning = self._record
        torch.cuda.set_sync_debug_mode("warn")
        return self

    def __exit__(self, *exc) -> None:
        torch.cuda.set_sync_debug_mode("default")
        self._warnings.__exit__(*exc)

    def _record(self, message, category, filename, lineno, file=None, line=None) -> None:
        if "synchroniz" not in str(message):
            self._show(message, category, filename, lineno, file, line)
            return
        self.count += 1
        self.sites[call_site(traceback.extract_stack()[:-2])] += 1


def call_site(stack: traceback.StackSummary) -> str:
    """``path:line function`` of the innermost frame in alisa, else transformers, else any."""
    for marker in ("/alisa/", "/transformers/"):
        for frame in reversed(stack):
            if marker in frame.filename and "/probes/" not in frame.filename:
                path = frame.filename[frame.filename.rindex(marker) + 1 :]
                return f"{path}:{frame.lineno} {frame.name}"
    frame = stack[-1]
    return f"{frame.filename}:{frame.lineno} {frame.name}"


def make_mode_cache(system: str, model, steps: int, room: int):
    """The cache of a mode; ``tiers:<recompute>`` gives the KV ``room`` bytes of the device
    beyond the weights (three quarters of the prompt's KV: the rest goes to the host or is
    recomputed)."""
    from alisa import AlisaCache, AlisaConfig
    from experiments.systems import make_cache

    if system.startswith("tiers:"):
        weights = sum(p.nbytes for p in model.parameters())
        return AlisaCache(
            model,
            AlisaConfig(gpu_memory=weights + room, recompute=system.split(":")[1]),
            max_new_tokens=steps,
        )
    cache, config = make_cache(system, model)
    return cache if config is None else AlisaCache(model, config, max_new_tokens=steps)


@torch.inference_mode()
def measure(
    model, system: str, ids: torch.Tensor, args, profile_to: Path | None, room: int
) -> dict:
    """Syncs per decode step of one mode (and its profile, when ``profile_to`` is given)."""
    from alisa import AlisaCache

    cache = make_mode_cache(system, model, args.warm_up + args.steps + 2, room)
    output = model(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=1)

    def step():
        token = output.logits[:, -1:].argmax(-1)
        return model(input_ids=token, past_key_values=cache, use_cache=True, logits_to_keep=1)

    for _ in range(args.warm_up):
        output = step()
    log = SyncLog()
    with log:
        for _ in range(args.steps):
            output = step()
    torch.cuda.synchronize()
    times = []  # outside the sync log, whose warnings cost host time
    for _ in range(args.steps):
        start = time.perf_counter()
        output = step()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    row = {
        "mode": system,
        "syncs_per_step": log.count / args.steps,
        "syncs_per_layer_step": log.count / args.steps / model.config.num_hidden_layers,
        "median_step_ms": 1000 * statistics.median(times),
        "sites": dict(log.sites.most_common()),
    }
    if isinstance(cache, AlisaCache):
        row["tier_bytes"] = cache.tier_bytes()
    if profile_to is not None:
        from torch.profiler import ProfilerActivity, profile

        output = step()  # the profiler's own warm-up
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            output = step()
            torch.cuda.synchronize()
        table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=40)
        profile_to.write_text(table)
    return row


def main(argv=None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print("gpu_stalls: error: CUDA is not available to torch", file=sys.stderr)
        return 1
    from alisa.model.adapter import model_shape
    from experiments.shapes import build_shape_model

    args.out.mkdir(parents=True, exist_ok=True)
    model = build_shape_model(args.model, dtype=args.dtype, device="cuda")
    shape = model_shape(model)
    prompt_kv = (
        (2 * args.batch * args.prompt_tokens * shape.num_layers * shape.num_kv_heads)
        * shape.head_dim
        * model.dtype.itemsize
    )
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 32000, (args.batch, args.prompt_tokens), generator=generator).cuda()
    rows = []
    for name in args.modes.split(";"):
        system = MODES[name]
        slug = "".join(c if c.isalnum() else "_" for c in name)
        target = args.out / f"profile_{slug}.txt" if name in PROFILED else None
        try:
            row = measure(model, system, ids, args, target, prompt_kv * 3 // 4)
        except Exception as error:  # a mode that fails on CUDA is a finding, not the end
            row = {"mode": system, "error": f"{type(error).__name__}: {error}"[:2000]}
            row["traceback"] = traceback.format_exc()[-3000:]
        row["name"] = name
        rows.append(row)
        print(json.dumps(row), file=sys.stderr)
        torch.cuda.empty_cache()
    print("| mode | syncs / step | syncs / layer / step | step ms | top sites |")
    print("|---|---|---|---|---|")
    for row in rows:
        if "error" in row:
            print(f"| {row['name']} | error: {row['error'][:120]} | | | |")
            continue
        sites = "; ".join(f"{site} ×{n}" for site, n in list(row["sites"].items())[:3])
        print(
            f"| {row['name']} | {row['syncs_per_step']:.2f} | {row['syncs_per_layer_step']:.2f} "
            f"| {row['median_step_ms']:.1f} | {sites} |"
        )
    report = {
        "benchmark": "gpu_stalls",
        "model": args.model,
        "dtype": args.dtype,
        "batch": args.batch,
        "prompt_tokens": args.prompt_tokens,
        "steps": args.steps,
        "gpu": torch.cuda.get_device_name(0),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "modes": rows,
    }
    (args.out / "stalls.json").write_text(json.dumps(report, indent=1))
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
