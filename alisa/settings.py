"""The effective settings of a config: what every field left ``None`` becomes, layer by layer.

:func:`resolve_settings` is the one place the preset and the policy decide unset fields;
:func:`alisa.config.policy_for_layer`, ``AlisaConfig.selects_per_head`` and
``AlisaConfig.host_history_share`` read its result, and :func:`describe_settings` shows it.

This module does not import :mod:`alisa.config` (which imports it): the resolver reads the
config through :class:`ConfigFields`, the attributes it needs.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import MISSING, Field, dataclass, fields
from typing import TYPE_CHECKING, Protocol

from alisa import policies  # loads the policy classes (and torch) on first use
from alisa.policies.layer_schedule import layer_budget_scale
from alisa.sizes import format_bytes, parse_bytes

if TYPE_CHECKING:
    from alisa.policies import KVPolicy

# Defaults of the "default" preset (docs/drop-quality.md, docs/retention-selection-study.md): a
# floor of 64 tokens keeps small budgets early in a sequence from losing what later steps need;
# 4 attention sinks for every evicting policy but local (and for retention="host"); a
# SnapKV-style observation window of the last 8 prompt queries seeds the scores at prefill;
# SWA scores decode steps by decayed sums of the query-head max (the policy class says so).
MIN_BUDGET_TOKENS = 64
SINK_TOKENS = 4
OBSERVATION_WINDOW = 8
# retention="host" with an attention-scored policy: half of the budget left after sinks and the
# recent window goes to the tokens with the most attention summed over the policy's window
# (docs/results.md, "Which scoring works": a third fewer tokens fetched per step for 0.1-0.4 % of
# perplexity against the key sketch alone).
HISTORY_SHARE = 0.5
# Decode steps per host selection when ``reselect_every`` is unset: every step. Consecutive steps
# share 87 % of their choice, but what changes is what the current query needs: selecting every
# 2 / 4 steps cost +7.8 / +20 % perplexity on WikiText-2 (SWA r = 0.2, docs/host-speed.md).
RESELECT_EVERY = 1
# retention="host": whether the tokens a step leaves on the host get one softmax column (their
# mass from the key sketch, their mean value). Off: it finds needles at 8K that renormalising
# over the chosen tokens misses, but costs WikiText-2 perplexity at 1K, where the mean value is
# a worse stand-in for the tokens left out than the chosen ones are (docs/ruler.md).
ESTIMATE_REST = False
# What an unset field that no resolver value replaces means, as shown by describe_settings.
UNSET_MEANS = {
    "quant_group_size": "head_dim",
    "profile": "this machine's saved profile, else rough defaults",
    "score_window": "auto (from the recent window)",
    "stride": "auto (from the caching ratio)",
    "budget_tokens": "None (the caching ratio decides)",
    "gpu_memory": "None (no limit)",
    "host_memory": "None (what psutil reports available)",
}


class ConfigFields(Protocol):
    """The :class:`~alisa.config.AlisaConfig` fields the resolver and :func:`ignored_settings`
    read."""

    policy: str
    caching_ratio: float
    budget_tokens: int | None
    recent_fraction: float | None
    sink_tokens: int | None
    score_decay: bool | None
    head_max: bool | None
    dense_layers: int
    layer_schedule: str
    per_head: bool | None
    kv_bits: int
    quant_group_size: int | None
    residual_tokens: int
    stride: int | None
    kernels: str
    gpu_memory: int | str | None
    host_memory: int | str | None
    recompute: str
    profile: str | None
    retention: str
    history_share: float | None
    reselect_every: int | None
    estimate_rest: bool | None
    min_budget_tokens: int | None
    observation_window: int | None
    preset: str

    @property
    def keeps_everything(self) -> bool: ...


@dataclass(frozen=True, kw_only=True)
class LayerSettings:
    """The effective policy settings of one layer (the fields of the policy it runs).

    Parameters
    ----------
    policy
        The policy the layer runs (``dense`` for the first ``dense_layers`` layers).
    caching_ratio, budget_tokens, recent_fraction, sink_tokens, min_budget_tokens
        The budget rule: share kept, fixed token budget, recent share, sinks, floor.
    budget_scale
        Budget multiplier of the layer (``layer_schedule``; 1.0 when uniform).
    observation_window, head_max, score_decay
        How attention-scored policies score tokens (see ``AlisaConfig``).
    options
        The policy's own options by config field name (SWA's ``score_window``, strided's
        ``stride``); ``None`` there means the policy derives it at run time from the budget.
    """

    policy: str
    caching_ratio: float
    budget_tokens: int | None
    recent_fraction: float
    sink_tokens: int
    budget_scale: float
    min_budget_tokens: int
    observation_window: int
    head_max: bool
    score_decay: bool
    options: tuple[tuple[str, object], ...] = ()

    @property
    def dense(self) -> bool:
        """True when the layer keeps every token whatever its budget (a policy that never
        evicts)."""
        return not policies.POLICIES[self.policy].evicts

    def values(self) -> dict[str, object]:
        """Setting name -> value, the policy's own options included."""
        shared = {item.name: getattr(self, item.name) for item in fields(self)}
        del shared["options"]
        return {**shared, **dict(self.options)}

    def build(self) -> KVPolicy:
        """The policy object of this layer."""
        cls = policies.POLICIES[self.policy]
        own = cls.own_options(dict(self.options))
        shared = {item.name: getattr(self, item.name) for item in fields(self)}
        del shared["policy"], shared["options"]
        return cls(**shared, **own)


@dataclass(frozen=True, kw_only=True)
class Settings:
    """Everything a config means for a model of ``len(layers)`` layers.

    Parameters
    ----------
    layers
        The effective policy settings of each layer.
    per_head
        Whether each KV head keeps its own index set.
    history_share
        ``retention="host"``: the share of the budget chosen by attention history.
    reselect_every
        ``retention="host"``: decode steps per selection (1 otherwise).
    estimate_rest
        ``retention="host"``: whether attention estimates the tokens left on the host (False
        otherwise).
    gpu_memory_bytes, host_memory_bytes
        Byte budgets; ``None``: no device limit, the host's available memory.
    unset
        The config fields left ``None`` (decided here by the preset or the policy).
    """

    layers: tuple[LayerSettings, ...]
    per_head: bool
    history_share: float
    reselect_every: int
    estimate_rest: bool
    gpu_memory_bytes: int | None
    host_memory_bytes: int | None
    unset: frozenset[str]


def resolve_settings(config: ConfigFields, num_layers: int) -> Settings:
    """The effective settings of ``config`` on a model of ``num_layers`` layers.

    Raises
    ------
    ValueError
        ``num_layers`` below 1, or ``config.dense_layers`` above it.
    """
    if isinstance(num_layers, bool) or not isinstance(num_layers, int) or num_layers < 1:
        raise ValueError(f"num_layers={num_layers!r} must be an integer >= 1")
    return Settings(
        layers=tuple(_layer(config, index, num_layers) for index in range(num_layers)),
        per_head=_per_head(config),
        history_share=_history_share(config),
        reselect_every=_reselect_every(config),
        estimate_rest=_estimate_rest(config),
        gpu_memory_bytes=_bytes(config.gpu_memory, "gpu_memory"),
        host_memory_bytes=_bytes(config.host_memory, "host_memory"),
        unset=frozenset(name for name, value in vars(config).items() if value is None),
    )


def check_dense_layers(config: ConfigFields, num_layers: int) -> None:
    """Refuse more dense layers than the model has, or, with an evicting policy, as many: every
    layer would be dense while the config (and every summary of it) still names a sparse policy.

    Raises
    ------
    ValueError
        Naming ``dense_layers``, its value and the model's layer count.
    """
    if config.dense_layers > num_layers:
        raise ValueError(
            f"dense_layers={config.dense_layers!r} (--dense-layers) is more than the model's "
            f"{num_layers} layers"
        )
    if config.dense_layers == num_layers and policies.POLICIES[config.policy].evicts:
        raise ValueError(
            f"dense_layers={config.dense_layers!r} (--dense-layers) makes all of the model's "
            f"{num_layers} layers dense, so policy={config.policy!r} would evict nothing; give "
            f"fewer than {num_layers} or choose policy='dense'"
        )


def layer_settings(config: ConfigFields, layer_idx: int, num_layers: int) -> LayerSettings:
    """One layer's :attr:`Settings.layers` entry without resolving the others."""
    return _layer(config, layer_idx, num_layers)


def _layer(config: ConfigFields, layer_idx: int, num_layers: int) -> LayerSettings:
    """The policy settings of one layer: the first ``dense_layers`` layers run a plain
    :class:`DensePolicy`; the others the config's policy, its unset fields decided by the preset,
    its own options (SWA's window, strided's stride) named by its ``config_fields``."""
    check_dense_layers(config, num_layers)
    if layer_idx < config.dense_layers:
        dense = policies.DensePolicy()
        return LayerSettings(policy=dense.name, **_shared_fields(dense))
    cls = policies.POLICIES[config.policy]
    recent = config.recent_fraction
    settings: Mapping[str, object] = vars(config)
    return LayerSettings(
        policy=config.policy,
        caching_ratio=config.caching_ratio,
        budget_tokens=config.budget_tokens,
        recent_fraction=cls.default_recent_fraction if recent is None else recent,
        budget_scale=layer_budget_scale(
            layer_idx, num_layers, config.layer_schedule, config.dense_layers
        ),
        **_preset_options(config, cls),
        options=tuple((name, settings[name]) for name in cls.config_fields),
    )


def _shared_fields(policy: KVPolicy) -> dict[str, object]:
    """The base-class fields of a policy (those every layer has)."""
    return {item.name: getattr(policy, item.name) for item in fields(policies.KVPolicy)}


def _preset_options(config: ConfigFields, cls: type[KVPolicy]) -> dict[str, object]:
    """The policy fields whose unset (``None``) config value the preset decides."""
    default = config.preset == "default"
    sinks = config.sink_tokens
    if sinks is None:
        wants_sinks = default and (cls.sinks_by_default or config.retention == "host")
        sinks = (
            max(cls.default_sink_tokens, SINK_TOKENS) if wants_sinks else cls.default_sink_tokens
        )
    floor = config.min_budget_tokens
    if floor is None:
        floor = MIN_BUDGET_TOKENS if default else 0
    window = config.observation_window
    if window is None:
        window = OBSERVATION_WINDOW if default and cls.needs_attention else 0
    head_max, decay = config.head_max, config.score_decay
    return {
        "sink_tokens": sinks,
        "min_budget_tokens": floor,
        "observation_window": window,
        "head_max": (default and cls.head_max_by_default) if head_max is None else head_max,
        "score_decay": (default and cls.decays_by_default) if decay is None else decay,
    }


def _per_head(config: ConfigFields) -> bool:
    """``per_head``, or the preset's choice (per head for SWA and H2O, not with tiers)."""
    if config.per_head is not None:
        return config.per_head
    default = config.preset == "default" and config.gpu_memory is None
    return default and policies.POLICIES[config.policy].per_head_by_default


def _history_share(config: ConfigFields) -> float:
    """``history_share``, or 0.5 for an attention-scored policy with ``retention="host"``."""
    if config.history_share is not None:
        return config.history_share
    scored = config.retention == "host" and policies.POLICIES[config.policy].needs_attention
    return HISTORY_SHARE if scored else 0.0


def _reselect_every(config: ConfigFields) -> int:
    """``reselect_every``, or RESELECT_EVERY with ``retention="host"`` (1 otherwise)."""
    if config.reselect_every is not None:
        return config.reselect_every
    return RESELECT_EVERY if config.retention == "host" else 1


def _estimate_rest(config: ConfigFields) -> bool:
    """``estimate_rest``, or ESTIMATE_REST with ``retention="host"`` (False otherwise)."""
    if config.estimate_rest is not None:
        return config.estimate_rest
    return ESTIMATE_REST if config.retention == "host" else False


def _bytes(value: int | str | None, name: str) -> int | None:
    return None if value is None else parse_bytes(value, field=name)


def no_evicting_layer_note(config: ConfigFields, windows: Sequence[int | None]) -> str | None:
    """Why an evicting policy evicts in no layer of a model whose every layer is a sliding
    window (``windows``, one per layer; None: full attention), or None.

    Sliding layers keep their window as the model does (the policy and ``caching_ratio`` apply
    to full-attention layers only), so on such a model the run is the model's own attention:
    the same tokens as ``policy='dense'``, said as ``dense_layers`` making every layer dense is.
    """
    if not policies.POLICIES[config.policy].evicts or not windows:
        return None
    if any(window is None for window in windows):
        return None
    sizes = "/".join(str(size) for size in sorted(set(windows)))
    budget = (  # the budget setting the user gave: budget_tokens replaces the ratio
        f"caching_ratio={config.caching_ratio:g}"
        if config.budget_tokens is None
        else f"budget_tokens={config.budget_tokens}"
    )
    return (
        f"policy={config.policy!r} evicts in no layer of this model: all its {len(windows)} "
        f"layers are {sizes}-token sliding windows, kept as the model keeps them, so "
        f"{budget} has no effect; choose policy='dense' or a model with full-attention layers"
    )


def evicts_nothing_note(config: ConfigFields, num_layers: int, tokens: int) -> str | None:
    """Why an evicting policy keeps all ``tokens`` tokens of each sequence, or None.

    When the floor (``min_budget_tokens``), a ``sink_tokens`` given, or ``budget_tokens`` covers
    every token of a run that short, the policy evicts nothing and the run is dense attention
    under another name (a 64-token sweep under the default 64-token floor). The note names the
    setting to lower.
    """
    if not policies.POLICIES[config.policy].evicts:
        return None
    rules = [layer.build().keep_rule for layer in resolve_settings(config, num_layers).layers]
    evicting = [rule for rule in rules if not rule.keeps_everything]
    if not evicting or any(int(rule.kept(tokens)) < tokens for rule in evicting):
        return None
    floor = min(rule.floor for rule in evicting)
    sinks = min(rule.sink_tokens for rule in evicting)
    if floor >= tokens:
        setting, lower = f"min_budget_tokens={floor}", "lower it (0: no floor)"
        if config.min_budget_tokens is None:
            setting += f" (the {config.preset} preset's floor)"
    elif config.sink_tokens is not None and sinks + 1 >= tokens:
        # Sinks are never evicted and the budget covers them plus the newest token.
        setting, lower = f"sink_tokens={sinks}", "lower it"
    elif config.budget_tokens is not None:
        setting, lower = f"budget_tokens={config.budget_tokens}", "lower it"
    else:  # round(n * r) rounds up to every token: nothing to blame but r itself
        return None
    return (
        f"{setting} keeps all {tokens} tokens of each sequence, so policy "
        f"{config.policy!r} at r={config.caching_ratio:g} evicts nothing and runs as dense; "
        f"{lower} or give more tokens to measure it"
    )


def ring_tokens(config: ConfigFields, context: int | None) -> int:
    """Tokens the full-precision ring of coded KV holds: ``residual_tokens``, but never more
    than the model's ``context`` (None: unknown), which no sequence outgrows."""
    return config.residual_tokens if context is None else min(config.residual_tokens, context)


def full_precision_note(config: ConfigFields, tokens: int, *, context: bool = False) -> str | None:
    """Why ``kv_bits`` codes nothing: ``residual_tokens`` keeps every one of ``tokens`` tokens in
    its full-precision ring (those of each sequence of a run, or with ``context`` the model's
    whole context, which no run outgrows), or None."""
    if config.kv_bits == 16 or config.residual_tokens < tokens:
        return None
    held = (
        f"every token of the model's {tokens}-token context"
        if context
        else f"all {tokens} tokens of each sequence"
    )
    return (
        f"residual_tokens={config.residual_tokens} keeps {held} in full precision, so "
        f"kv_bits={config.kv_bits} codes nothing; lower it (default 64) for the coded KV to "
        "save memory"
    )


def long_stride_note(config: ConfigFields, tokens: int) -> str | None:
    """Why ``stride`` strides over nothing: no sequence of ``tokens`` tokens reaches its second
    strided token, so the strided policy keeps each sequence's first token and fills the rest
    of its budget with the most recent ones, as ``local`` with one sink would; or None."""
    if config.policy != "strided" or config.stride is None or config.stride < tokens:
        return None
    return (
        f"stride={config.stride} is at least as long as every sequence of this run ({tokens} "
        "tokens): only each sequence's first token is on the stride, so policy='strided' keeps "
        "it and the most recent tokens (policy='local' with sink_tokens=1); lower the stride "
        "(unset: 2/caching_ratio - 1)"
    )


def coded_size_note(config: ConfigFields, head_dim: int, element_bytes: int) -> str | None:
    """Why ``kv_bits`` saves no memory on a model whose KV values take ``element_bytes`` each,
    or None: every ``quant_group_size`` codes carry a scale and a zero point (float16 at least,
    2 bytes each), so a small group takes as many bytes a value as the model's own, or more."""
    if config.kv_bits == 16:
        return None
    group = config.quant_group_size or head_dim
    coded = config.kv_bits / 8 + 4 / group
    if coded < element_bytes:
        return None
    return (
        f"quant_group_size={group} gives every {group} coded value(s) a scale and a zero point: "
        f"at least {coded:g} bytes a value against the model's {element_bytes}, so "
        f"kv_bits={config.kv_bits} saves no memory; use a larger group (unset: the head size, "
        f"{head_dim})"
    )


def unread_kernels_note(config: ConfigFields, device_type: str) -> str | None:
    """Why ``kernels``, set to a backend, changes nothing for a model on ``device_type``, or
    None.

    The backend is read in two places (:func:`alisa.ops.backends.choose_ops`): host retention's
    step (the choice, the slot placement, the host fetch: ``retention="host"`` with a policy
    that leaves tokens out), and, on a CPU only, the device store's writes and attention and the
    slot map of every mode (numba's compiled kernels for ``cpu``, PyTorch's operators for
    ``reference``). So on a CPU it is always read; on another device (CUDA) only host retention
    reads it, and ``reference`` and ``cuda`` run the same operators otherwise. Not in
    :func:`ignored_settings`, which does not know the device.

    Parameters
    ----------
    config
        The run's config.
    device_type
        The model's device type (``"cpu"``, ``"cuda"``).

    Returns
    -------
    str | None
        ``"kernels='reference' has no effect with retention='drop' on a cuda model: ..."``, or
        None (``kernels="auto"``, a CPU, or a host-retention step that runs them).
    """
    if config.kernels == "auto" or device_type == "cpu":
        return None
    if config.retention == "host" and not config.keeps_everything:
        return None  # host retention's step runs them (a policy that never evicts is refused)
    why = (
        f"with retention={config.retention!r}"
        if config.retention != "host"
        else f"with policy={config.policy!r} keeping every token (no host-retention step)"
    )
    return (
        f"kernels={config.kernels!r} has no effect {why} on a {device_type} model: there only "
        "host retention's step (retention='host') reads it; leave it at 'auto'"
    )


class IgnoredSettingWarning(UserWarning):
    """A config sets a field that no part of a run reads (:func:`ignored_settings` says which
    and why): accepted, since a sweep or a shared config may set it for other policies, but
    said, since a setting given for nothing is usually a mistake."""


# Settings of how a policy evicts: a policy that keeps every token reads none of them.
# Settings only device/host tiers read: without gpu_memory a running cache ignores them (the
# planner, budgeting the whole device, reads them).
TIER_FIELDS = ("recompute", "profile")
TIER_PREFIXES = tuple(f"{name}=" for name in TIER_FIELDS)  # how their notes begin

EVICTION_FIELDS = (
    "recent_fraction",
    "sink_tokens",
    "min_budget_tokens",
    "score_window",
    "score_decay",
    "head_max",
    "per_head",
    "observation_window",
    "stride",
)


UNTIERED = "without gpu_memory (no device/host tiers)"  # why tier fields go unread


def ignored_settings(
    config: ConfigFields,
    *,
    tiered: bool = False,
    typed: Collection[str] = (),
    untiered: str = UNTIERED,
) -> list[str]:
    """What ``config`` sets (other than its default) that no part of a run reads, one
    ``field=value has no effect ...`` each: the one rule behind ``AlisaConfig``'s
    :class:`IgnoredSettingWarning` and the CLI's warning lines.

    Parameters
    ----------
    config
        An ``AlisaConfig`` (a dataclass with these fields and their defaults).
    tiered
        KV is placed in tiers even without ``gpu_memory`` (``alisa plan`` budgets the whole
        device, as :mod:`alisa.planning` may from Python), so ``recompute`` and ``profile``
        are read.
    typed
        Fields the user named (a CLI flag typed), noted even at their default value.
    untiered
        Why the tier fields go unread without ``gpu_memory`` (a command whose ``--gpu-memory``
        sizes batches, not tiers, says so).

    Returns
    -------
    list[str]
        The notes, in field order of the rules below; empty when every setting is read.
    """
    cls = policies.POLICIES[config.policy]
    items = fields(config)  # type: ignore[arg-type]  # an AlisaConfig dataclass
    changed = {item.name for item in items if getattr(config, item.name) != field_default(item)}
    changed |= set(typed)
    why: dict[str, str] = {}
    policy = f"policy={config.policy!r}"
    if not cls.evicts:
        for name in (*EVICTION_FIELDS, "dense_layers", "layer_schedule", "preset"):
            why[name] = f"with {policy}, which keeps every token"
    elif config.keeps_everything:  # an evicting policy given nothing to evict: dense
        unbounded = "at caching_ratio=1 with no budget_tokens"
        why["policy"] = (
            f"{unbounded}: every token is kept (dense attention); set caching_ratio below 1 "
            "or budget_tokens for it to evict"
        )
        for name in (*EVICTION_FIELDS, "dense_layers", "preset", "retention"):
            why[name] = f"with {policy} {unbounded}, which keeps every token"
    else:
        for name in ("score_window", "stride"):
            if name not in cls.config_fields:
                why[name] = f"with {policy}, which does not read it"
        if not cls.needs_attention:
            for name in ("head_max", "observation_window", "score_decay"):
                why[name] = f"with {policy}, which does not score tokens by attention"
        elif not cls.windowed_scores:
            why["score_decay"] = (
                f"with {policy}, which has no score window of several decode steps to fade"
            )
        if cls.ranks_by_recency:  # its choice past the recent share is the next most recent
            why["recent_fraction"] = f"with {policy}, which keeps the most recent tokens anyway"
        below = _budget_below_least(config)
        if below is not None:
            why["budget_tokens"] = below
    if config.kv_bits == 16:
        why["residual_tokens"] = why["quant_group_size"] = "with kv_bits=16 (nothing quantized)"
    if config.retention != "host":
        why["host_bits"] = f"with retention={config.retention!r} (no host region)"
    if config.gpu_memory is None and not tiered:
        for name in TIER_FIELDS:
            why[name] = untiered
    return [
        f"{name}={getattr(config, name)!r} has no effect {reason}"
        for name, reason in why.items()
        if name in changed
    ]


def _budget_below_least(config: ConfigFields) -> str | None:
    """Why a ``budget_tokens`` under what every evicting layer keeps at least (its floor, or
    its sinks plus the newest token: :class:`scheduler.budget.KeepRule`) changes nothing, or
    None (no budget, a budget above both, or a schedule that scales it per layer)."""
    if config.budget_tokens is None or config.layer_schedule != "uniform":
        return None
    # The budget rule of an evicting layer (the one past the dense ones): what it keeps at least.
    rule = resolve_settings(config, config.dense_layers + 1).layers[-1].build().keep_rule
    floor, sinks = rule.floor, rule.sink_tokens
    if config.budget_tokens >= rule.least:
        return None
    if floor >= sinks + 1:
        own = "" if config.min_budget_tokens is not None else f" (the {config.preset} preset's)"
        return (
            f"below min_budget_tokens={floor}{own}, the floor every evicting layer keeps; lower "
            "the floor (0: none) for the budget to act"
        )
    return (
        f"below sink_tokens={sinks} plus the newest token, which every evicting layer keeps; "
        "lower sink_tokens for the budget to act"
    )


def untiered_notes(config: ConfigFields) -> list[str]:
    """What ``config`` sets that only device/host tiers read (:data:`TIER_FIELDS`) when it has
    no ``gpu_memory``: a running cache never reads them (the planner, which budgets the whole
    device, does), so building one says so."""
    if config.gpu_memory is not None:  # tiered: read
        return []
    return [note for note in ignored_settings(config) if note.startswith(TIER_PREFIXES)]


def check_untiered(config: ConfigFields, runner: str, budget: str) -> None:
    """Refuse a ``gpu_memory`` in ``config`` where ``runner`` (a batch job, a stream, a server)
    sizes whole batches to a budget of its own, ``budget``, and never splits a cache into
    device/host tiers: accepted, it would go unread beside that budget.

    Raises
    ------
    ValueError
        Naming the value, the budget to give instead and why.
    """
    if config.gpu_memory is not None:
        raise ValueError(
            f"config.gpu_memory={config.gpu_memory!r}: {runner} sizes its batches to {budget} "
            f"and never splits a cache into device/host tiers; give the budget as {budget} "
            "and leave the config's gpu_memory unset"
        )


def check_host_admission(config: ConfigFields, reserve_tokens: int | None) -> None:
    """Refuse a ``host_memory`` beside ``reserve_tokens`` where batches are admitted by bytes
    (a batch job, a stream, a server): rows that outgrow their reserve are paused in host
    memory, beside the host regions that budget counts, and a paused row is counted nowhere.

    Raises
    ------
    ValueError
        Naming both values and the choice to make.
    """
    if config.host_memory is not None and reserve_tokens is not None:
        raise ValueError(
            f"reserve_tokens={reserve_tokens!r} (--reserve-tokens) pauses rows that outgrow it "
            f"in host memory, which host_memory={config.host_memory!r} (--host-memory) does not "
            "count: leave one of them unset"
        )


def no_host_region(host_memory: int | str) -> ValueError:
    """The error of a ``host_memory`` under ``retention="host"`` on a model none of whose
    layers keeps a host region (sliding windows, dense layers, budgets that keep every token):
    it would limit nothing."""
    return ValueError(
        f"host_memory={host_memory!r} (--host-memory) has no effect: no layer of this model "
        "keeps a host region under retention='host' (its layers are sliding windows, dense "
        "layers or keep every token), so it would limit nothing; leave it unset"
    )


def field_default(item: Field) -> object:
    """The default value of a dataclass field (its factory's product for a mutable one)."""
    return item.default_factory() if item.default is MISSING else item.default


def effective_values(config: ConfigFields, num_layers: int) -> dict[str, str]:
    """Every effective setting of ``config`` as text, by name, in the config's field order.

    A per-layer value the same in every layer reads once (``4``); one that differs reads by
    layer ranges (``0: dense, 1-3: swa``); ``-`` marks a layer whose policy lacks the option.
    ``layer_policy`` and ``budget_scale`` are the per-layer results of ``policy``,
    ``dense_layers`` and ``layer_schedule``.
    """
    settings = resolve_settings(config, num_layers)
    layers = [layer.values() for layer in settings.layers]
    layer_names = {name for values in layers for name in values} - {"policy"}
    options = {name for cls in policies.POLICIES.values() for name in cls.config_fields}
    resolved = {
        "per_head": settings.per_head,
        "history_share": settings.history_share,
        "reselect_every": settings.reselect_every,
        "estimate_rest": settings.estimate_rest,
        "gpu_memory": settings.gpu_memory_bytes,
        "host_memory": settings.host_memory_bytes,
    }
    result: dict[str, str] = {}
    for item in fields(config):  # type: ignore[arg-type]  # an AlisaConfig dataclass
        name = item.name
        if name in layer_names:
            result[name] = _by_layer([values.get(name, "-") for values in layers], name)
        elif name in options:  # an option of another policy than the one running
            result[name] = f"{getattr(config, name)} (unused by this policy)"
        else:
            result[name] = _text(resolved.get(name, getattr(config, name)), name)
    result["layer_policy"] = _by_layer([values["policy"] for values in layers])
    result["budget_scale"] = _by_layer([values["budget_scale"] for values in layers])
    return result


def describe_settings(config: ConfigFields, num_layers: int) -> str:
    """The effective settings, one ``name  value`` line each; ``*`` marks a field left unset
    (``None``) that the preset or the policy decided."""
    unset = resolve_settings(config, num_layers).unset
    values = effective_values(config, num_layers)
    width = max(map(len, values))
    lines = [
        f"alisa settings ({num_layers} layers, preset {config.preset}; * = unset, decided by "
        "the preset or the policy)"
    ]
    for name, text in values.items():
        lines.append(f"  {name:<{width}}  {text}{' *' if name in unset else ''}")
    return "\n".join(lines)


def _by_layer(values: list[object], name: str = "") -> str:
    """``4`` when every layer has the same value, else ``0: a, 1-3: b`` (runs of equal layers)."""
    texts = [_text(value, name) for value in values]
    if len(set(texts)) == 1:
        return texts[0]
    runs: list[list] = []
    for index, text in enumerate(texts):
        if runs and runs[-1][2] == text:
            runs[-1][1] = index
        else:
            runs.append([index, index, text])
    return ", ".join(
        f"{first}: {text}" if first == last else f"{first}-{last}: {text}"
        for first, last, text in runs
    )


def _text(value: object, name: str = "") -> str:
    if value is None and name in UNSET_MEANS:
        return UNSET_MEANS[name]
    if name in ("gpu_memory", "host_memory") and isinstance(value, int):
        return f"{value} ({format_bytes(value)})"
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)
