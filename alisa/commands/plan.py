"""``alisa plan``: where weights and KV will live and how fast it runs, without loading weights."""

from __future__ import annotations

import argparse
import json

HELP = "print the three-phase plan (weights, KV tiers, p1/p2, alpha/beta, memory, tokens/s)"


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model", default="smollm2-135m", help="model spec or preset (opt-13b, ...)"
    )
    parser.add_argument("--dtype", default="bfloat16", help="weights dtype")
    parser.add_argument("--gpu-memory", help="device byte budget (default: the profile's device)")
    parser.add_argument("--host-memory", help="host byte budget (default: the profile's host)")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--gen-len", type=int, default=128)
    parser.add_argument("--caching-ratio", type=float, default=1.0)
    parser.add_argument("--kv-bits", type=int, default=16)
    parser.add_argument(
        "--recent-fraction", type=float, default=0.0, help="share of kept KV pinned to the device"
    )
    parser.add_argument("--no-recompute", action="store_true", help="offload only")
    hardware = parser.add_mutually_exclusive_group()
    hardware.add_argument("--hardware", help="published preset: v100-32gb, a100-40gb, h100-80gb")
    hardware.add_argument("--profile", help="profile JSON from `alisa profile`")
    parser.add_argument("--json", action="store_true", help="print the plan as JSON")


def run(args: argparse.Namespace) -> int:
    from dataclasses import replace

    from alisa.memory import parse_bytes
    from alisa.planning import empty_model_spec, machine_profile
    from scheduler import Options, Workload, preset, solve

    if args.hardware:
        profile = preset(args.hardware)
    else:
        import torch

        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        profile = machine_profile(device, args.profile)
    if args.gpu_memory is not None:
        profile = replace(profile, device_bytes=parse_bytes(args.gpu_memory, field="--gpu-memory"))
    if args.host_memory is not None:
        profile = replace(profile, host_bytes=parse_bytes(args.host_memory, field="--host-memory"))
    spec, recomputable = empty_model_spec(args.model, args.dtype)
    workload = Workload(
        batch=args.batch,
        prompt_len=args.prompt_len,
        gen_len=args.gen_len,
        caching_ratio=args.caching_ratio,
        kv_bits=args.kv_bits,
        recent_fraction=args.recent_fraction,
    )
    plan = solve(
        profile, spec, workload, Options(allow_recompute=recomputable and not args.no_recompute)
    )
    if args.json:
        print(json.dumps(plan.to_dict(), default=str))
    else:
        print(plan.describe())
        print(weight_placement(spec, plan.weight_host_fraction))
    return 0


def weight_placement(spec, host_fraction: float) -> str:
    """Which decoder layers' weights sit on the host (streamed each step)."""
    layers = spec.num_layers
    on_host = round(host_fraction * layers)
    if on_host == 0:
        return "  weights: every layer resident on the device"
    if on_host == layers:
        return "  weights: all layers on the host, streamed to the device layer by layer"
    first_host = layers - on_host
    return (
        f"  weights: layers 0-{first_host - 1} on the device, {first_host}-{layers - 1} on the "
        "host (load with accelerate: device_map='auto', max_memory={0: <gpu-memory>, "
        "'cpu': <host-memory>})"
    )
