"""``alisa plan``: where weights and KV will live and how fast it runs, without loading weights."""

from __future__ import annotations

import argparse
import json
import sys

from alisa.commands.options import (
    FLOOR_FLAGS,
    CommandError,
    add_cache_options,
    cache_config_from_args,
    check_minimum,
    dtype_from_flag,
    flag_name,
    with_flag,
)
from alisa.model.dtypes import DTYPES

GIB = 1024**3
PROMPT_LEN, GEN_LEN = 512, 128  # the workload planned when the flags are not given

HELP = "print the three-phase plan (weights, KV tiers, p1/p2, alpha/beta, memory, tokens/s)"
# The AlisaConfig fields the runtime's tier planner reads (alisa.planning.tiers.TierPlanner.decide).
PLAN_FIELDS = (
    "policy",
    "caching_ratio",
    "kv_bits",
    "gpu_memory",
    "host_memory",
    "recompute",
    "profile",
    "retention",
    "host_bits",
    "min_budget_tokens",
)


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model", default="smollm2-135m", help="model spec or preset (opt-13b, ...)"
    )
    parser.add_argument(
        "--dtype",
        default="bfloat16",
        help=f"weights dtype: {', '.join(DTYPES)} (default: bfloat16; auto: the model's own, "
        "float16 for a preset)",
    )
    parser.add_argument("--batch", type=int, default=1, help="sequences (default 1)")
    parser.add_argument(
        "--prompt-len",
        type=int,
        default=PROMPT_LEN,
        help=f"prompt tokens per sequence (default {PROMPT_LEN})",
    )
    parser.add_argument(
        "--gen-len", type=int, default=GEN_LEN, help=f"tokens to generate (default {GEN_LEN})"
    )
    parser.add_argument(
        "--hardware", help="published preset instead of this machine: v100-32gb, a100-40gb, ..."
    )
    parser.add_argument("--json", action="store_true", help="print the plan as JSON")
    add_cache_options(parser, only=PLAN_FIELDS)


def run(args: argparse.Namespace) -> int:
    from dataclasses import replace

    from alisa.planning.hardware import cpu_model
    from alisa.planning.spec import config_workload, empty_model_spec
    from alisa.planning.tiers import in_config_terms
    from alisa.settings import evicts_nothing_note
    from scheduler import MODEL_PRESETS, Options, solve
    from scheduler.hardware import calibration_error, mismatches

    for flag in ("--batch", "--prompt-len", "--gen-len"):
        check_minimum(flag, getattr(args, flag[2:].replace("-", "_")), 1)
    config = cache_config_from_args(args, only=PLAN_FIELDS)
    if config.recompute == "always":  # the LP chooses the recomputed share either way
        print(
            "alisa plan: warning: --recompute: recompute='always' plans as 'auto' (the plan "
            "chooses how much is recomputed; 'always' makes a running cache recompute)",
            file=sys.stderr,
        )
    try:
        torch_dtype = weights_dtype(args.model, args.dtype)
        dtype_name = str(torch_dtype).removeprefix("torch.")
        spec, recomputable = empty_model_spec(args.model, dtype_name)
    except ValueError as error:
        raise CommandError(f"{error}; plan presets: {', '.join(MODEL_PRESETS)}") from None
    profile = _hardware(args, config)
    error = calibration_error(profile)
    if error is not None:
        raise CommandError(error)
    for note in mismatches(profile, cpu_model(), dtype_name):
        print(f"[alisa] warning: {note}; its rates may not hold here", file=sys.stderr)
    if args.model.lower() in MODEL_PRESETS:  # a preset's bytes follow --dtype too
        spec = replace(spec, bytes_per_element=torch_dtype.itemsize)
    _check_context(spec, args.prompt_len, args.gen_len)
    # As generate says it: a floor past the run's tokens plans dense under the policy's name.
    note = evicts_nothing_note(config, spec.num_layers, args.prompt_len + args.gen_len)
    if note is not None:
        print(f"alisa plan: warning: {with_flag(note, FLOOR_FLAGS)}", file=sys.stderr)
    workload = config_workload(
        config,
        spec.num_layers,
        batch=args.batch,
        prompt_len=args.prompt_len,
        gen_len=args.gen_len,
        windows=spec.windows,
    )
    options = Options(allow_recompute=recomputable and config.recompute != "never")
    try:
        plan = solve(profile, spec, workload, options)
    except ValueError as error:  # the scheduler names the profile's budgets: say the flags
        workload_flags = (
            f"--batch {args.batch}, --prompt-len {args.prompt_len}, --gen-len {args.gen_len}"
        )
        raise CommandError(
            f"{in_config_terms(str(error), config)} (for the workload {workload_flags})"
        ) from None
    if config.recompute == "never" and (
        not recomputable or solve(profile, spec, workload, Options()) == plan
    ):  # the plan allowed to recompute is this one: "never" forbade nothing
        print(
            "alisa plan: warning: --recompute never has no effect on this plan: it would "
            "recompute nothing either way (the device and host hold every KV token)",
            file=sys.stderr,
        )
    if config.host_memory is not None and plan.peak_host_bytes == 0:
        # The host budget bounds what the plan offloads; a plan that offloads nothing never
        # reads it (the device holds everything), which a user giving it should hear.
        hint = "" if config.gpu_memory is not None else "; give --gpu-memory for a smaller device"
        print(
            f"alisa plan: warning: --host-memory {config.host_memory} has no effect on this "
            "plan: it places nothing on the host (the device holds the weights and every KV "
            f"token){hint}",
            file=sys.stderr,
        )
    if args.json:
        print(json.dumps(plan.to_dict(), default=str))
    else:
        print(plan.describe())
        print(weight_placement(spec, plan.weight_host_fraction, profile.device_bytes))
    return 0


# The published presets' weights (OPT, LLaMA) are float16: ``--dtype auto``'s for them.
PRESET_DTYPE = "float16"


def weights_dtype(model: str, dtype: str):
    """The torch dtype of ``--dtype`` for ``model``: ``auto`` is the model's own, as
    ``generate``, ``batch`` and ``serve`` load it (read from its config; a preset's float16).

    Raises
    ------
    CommandError
        An unknown ``--dtype``, or ``auto`` for a model whose config names no dtype.
    ValueError
        A model that resolves to nothing.
    """
    import torch

    from alisa.model.loading import config_dtype
    from scheduler import MODEL_PRESETS

    chosen = dtype_from_flag(dtype)
    if chosen is not None:
        return chosen
    if model.lower() in MODEL_PRESETS:
        return getattr(torch, PRESET_DTYPE)
    own = config_dtype(model)
    if own is None:  # loading would take the weights' dtype, which plan does not read
        raise CommandError(
            f"--dtype {dtype}: the config of {model!r} names no dtype (loading takes its "
            "weights' own); give --dtype float32, bfloat16 or float16"
        )
    return own


def _check_context(spec, prompt_len: int, gen_len: int) -> None:
    """Refuse a workload past the model's context: the runtime refuses such a prompt."""
    limit = spec.context_tokens
    if limit is None or prompt_len + gen_len <= limit:
        return
    gen = max(min(gen_len, limit // 4), 1)
    raise CommandError(
        f"--prompt-len={prompt_len} plus --gen-len={gen_len} is {prompt_len + gen_len} "
        f"tokens, past {spec.name}'s context of {limit} tokens (max_position_embeddings); "
        f"give both within it (unset, they are {PROMPT_LEN} and {GEN_LEN}), e.g. --prompt-len "
        f"{limit - gen} --gen-len {gen}"
    )


def _hardware(args: argparse.Namespace, config):
    """The preset or this machine's profile, with the flags' byte budgets."""
    from dataclasses import replace

    import torch

    from alisa.planning.hardware import machine_profile
    from alisa.planning.tiers import BUDGET_FIELDS
    from alisa.sizes import format_bytes, parse_bytes
    from scheduler import preset

    if args.hardware is not None and config.profile:
        raise CommandError("give --hardware or --profile, not both")
    if args.hardware is not None:
        profile = preset(args.hardware)
    else:
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        profile = machine_profile(device, config.profile)
    for name, field in BUDGET_FIELDS.items():
        value, flag = getattr(config, field), flag_name(field)
        if value is None:
            continue
        size = parse_bytes(value, field=flag)
        if name == "device_bytes" and size > profile.device_bytes:
            # A budget the device cannot hold would plan KV into memory that is not there.
            print(
                f"alisa plan: warning: {flag} {value} is more than the "
                f"{format_bytes(profile.device_bytes)} of {profile.name}; planning with "
                f"{format_bytes(profile.device_bytes)}",
                file=sys.stderr,
            )
            size = profile.device_bytes
        profile = replace(profile, **{name: size})
    return profile


def weight_placement(spec, host_fraction: float, device_bytes: int | None = None) -> str:
    """Which decoder layers' weights sit on the host (streamed each step), and why when the
    weights alone would fit the ``device_bytes`` budget.

    The plan's share is continuous (the LP's ``w``); a loader places whole layers. The line
    names whole layers nearest the share but never contradicts the plan's own line above it
    (``weights: 93 % on device, 7 % on host``): a share shown as more than 0 % puts at least
    one layer on the host, and one shown as less than 100 % keeps at least one on the device.
    """
    layers = spec.num_layers
    percent = round(100 * host_fraction)  # as Plan.describe shows it
    if percent == 0:
        return "  weights: every layer resident on the device"
    on_host = min(max(round(host_fraction * layers), 1), layers)
    if percent < 100 and layers > 1:
        on_host = min(on_host, layers - 1)
    share = ""
    if on_host != host_fraction * layers:  # whole layers: say which share they stand for
        share = (
            f"the plan's {percent} % of the weights as whole layers: {100 * on_host / layers:.0f} %"
        )
    why = ""
    if device_bytes is not None and spec.total_weight_bytes < device_bytes:
        # The LP's choice, not a mistake: streaming a layer's weights moves fewer bytes per
        # step than moving the KV that would have to leave the device to make room for them.
        why = (
            f" (the {spec.total_weight_bytes / GIB:.2f} GiB of weights would fit the "
            f"{device_bytes / GIB:.2f} GiB budget, but the plan gives that room to KV: streaming "
            "weights moves fewer bytes per step than moving that KV)"
        )
    if on_host == layers:
        return (
            "  weights: all layers on the host, streamed to the device layer by layer"
            + (f" ({share})" if share else "")
            + why
        )
    first_host = layers - on_host
    return (
        f"  weights: {_span(0, first_host - 1)} on the device, "
        f"{_span(first_host, layers - 1)} on the host ({share + '; ' if share else ''}load "
        "with accelerate: device_map='auto', max_memory={0: <gpu-memory>, 'cpu': "
        "<host-memory>})" + why
    )


def _span(first: int, last: int) -> str:
    """``layer 3`` for one layer, ``layers 0-2`` for several."""
    return f"layer {first}" if first == last else f"layers {first}-{last}"
