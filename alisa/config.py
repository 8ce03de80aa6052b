"""The runtime's one configuration object: which KV policy, how much to keep, how to store it."""

from __future__ import annotations

import warnings
from collections.abc import Collection, Sequence
from dataclasses import dataclass, fields, replace
from typing import TYPE_CHECKING

from alisa import policies  # loads the policy classes (and torch) on first use
from alisa.checks import check_field_types, check_optional_int, check_share
from alisa.ops import KERNELS
from alisa.settings import IgnoredSettingWarning, ignored_settings, layer_settings, resolve_settings
from alisa.sizes import parse_budget
from scheduler.budget import KeepRule

if TYPE_CHECKING:
    from alisa.policies import KVPolicy

LAYER_SCHEDULES = ("uniform", "pyramid")
KV_BITS = (16, 8, 4)
RECOMPUTE_MODES = ("auto", "never", "always")
RETENTIONS = ("drop", "host")
PRESETS = ("default", "paper")


@dataclass(frozen=True, kw_only=True)
class AlisaConfig:
    """How the ALISA cache keeps, stores and places KV.

    Every field is type-checked: integers must be integers (not floats or bools), numbers
    real numbers, flags bools, names strings; a ``ValueError`` names the field and the value.
    Numpy's numbers and bools are taken as the Python int, float or bool they equal (and
    stored as it). A setting that would change nothing is refused where it names a budget or a
    host region the run would not have (``caching_ratio`` or ``retention="host"`` with
    ``dense``, ``reselect_every`` without ``retention="host"``); any other that no part of a
    run would read (``stride`` with ``swa``, ``score_decay`` with ``h2o``, ``sink_tokens`` with
    ``dense``) is accepted, since a sweep or a shared config may set it for several policies,
    with an :class:`~alisa.settings.IgnoredSettingWarning` saying why (the rule of
    :func:`alisa.settings.ignored_settings`, which the CLI prints as warning lines).

    Parameters
    ----------
    policy
        KV policy name: ``dense``, ``swa`` (ALISA sparse window attention), ``h2o``, ``tova``,
        ``streaming``, ``local``, ``strided`` (see ``alisa.policies.POLICIES``).
    caching_ratio
        r in (0, 1]: share of the tokens seen so far that each sequence keeps. ALISA keeps
        round(n*r/2) recent plus as many attention-selected tokens
        (https://arxiv.org/abs/2403.17312, Alg. 1).
    budget_tokens
        A fixed number of tokens to keep per sequence instead of a ratio (>= 1; with
        caching_ratio left at 1).
    recent_fraction
        Share of the budget reserved for the most recent tokens; ``None`` takes the policy's own
        default (one half for SWA and H2O, as the papers).
    sink_tokens
        First tokens of each sequence always kept (attention sinks, StreamingLLM); ``None``: 4
        under the ``default`` preset (0 for ``local``), the policy's own under ``paper`` (4 for
        ``streaming``, else 0).
    score_window
        SWA: number of most recent decode steps whose attention is summed (the time constant
        with ``score_decay``); ``None`` = the local window size k, as the paper's Alg. 1, or 4k
        when decayed.
    score_decay
        Policies with a score window (SWA): fade each step's attention by 1 - 1/w per step (a
        soft window, weights summing to w) instead of summing exactly the last w steps;
        ``None``: decayed for ``swa`` under the ``default`` preset, exact under ``paper``.
    head_max
        Attention-scored policies: at each decode step a KV head scores a token by the largest
        attention among its query heads instead of their sum (the observation window's vote
        sums them, as SnapKV); ``None``: max for ``swa`` under the ``default`` preset, sum
        otherwise.
    stride
        ``strided``: keep every ``stride``-th token besides the recent ones; ``None`` derives it
        from the caching ratio so that both halves of the budget are used.
    dense_layers
        The first this-many layers keep every token (as Quest and the H2O/SWA ablations do);
        with an evicting policy, fewer than the model's layers (the policy must run in one).
    layer_schedule
        ``uniform`` budgets, or ``pyramid`` (PyramidKV: more tokens in lower layers, same mean).
    per_head
        Select tokens per KV head instead of one index set per layer; ``None``: per head for
        ``swa`` and ``h2o`` under the ``default`` preset (not with ``gpu_memory``), one set per
        layer otherwise.
    kv_bits
        Storage precision of kept keys/values: 16 (model dtype), 8 or 4 (asymmetric min/max).
    quant_group_size
        Values sharing one scale along head_dim when quantized; ``None`` = head_dim (per token
        per KV head).
    gpu_memory
        Byte budget of the model's device for weights, resident KV and working buffers
        (``"2GiB"``, ``"512MB"`` or bytes); KV beyond it goes to the host tier or is recomputed,
        as the scheduler plans. ``None``: no limit.
    host_memory
        Byte budget of the host memory KV may take: the host tier of ``gpu_memory``, or the host
        region of ``retention="host"``, which the prompt and ``max_new_tokens`` must fit (else a
        ``ValueError`` before the prefill; never exceeded silently; batch jobs, streams and
        servers admit rows while all their regions fit it); ``None``: what psutil reports
        available. Set without either, it would limit nothing: an error (``alisa
        plan``, which places KV on the whole device by default, reads it, and warns when its
        plan puts nothing on the host).
    recompute
        ``auto`` (the plan decides), ``never`` (offload only) or ``always`` (no host KV tier).
    profile
        Hardware profile JSON from ``alisa profile`` for planning; ``None``: this machine's saved
        profile, else rough defaults.
    retention
        What happens to tokens outside the budget. ``drop`` (the paper's SWA): they are
        evicted for good. ``host``: every token stays in a host region and each decode step
        attends, per KV head, to the budget's best tokens (sinks, the recent window and the
        highest estimated attention), fetching from the host what the device lacks (ALISA's
        phase II; Quest/InfiniGen/ShadowKV select per step the same way); it needs an
        evicting policy (``dense`` leaves nothing out to keep on the host).
    host_bits
        ``retention="host"``: precision of the host region, 16 (model dtype), 8 or 4.
    history_share
        ``retention="host"`` with an attention-scored policy (swa, h2o, tova): the share of the
        budget left after sinks and the recent window that goes to the tokens with the most
        attention summed over the policy's score window (ALISA's "globally dynamic" tokens)
        before the key sketch ranks the rest. 0 ranks by the sketch alone; 0.5 fetches a third
        fewer tokens per step for 0.1-0.4 % of perplexity (docs/results.md). ``None``: 0.5 for an
        attention-scored policy with ``retention="host"``, else 0 (either preset).
    reselect_every
        ``retention="host"``: decode steps per selection. In between, each layer attends to
        its last choice plus the tokens written since (the newest, which every choice keeps),
        so scoring, ranking and fetching cost once per this many steps, for a measured loss of
        accuracy (docs/host-speed.md). ``None``: ``alisa.settings.RESELECT_EVERY`` (1).
    estimate_rest
        ``retention="host"``: give each decode step's softmax one more column for the tokens
        it leaves on the host, their mass estimated from the key sketch and their output by
        the mean value (RetroInfer's estimation zone), instead of renormalising attention over
        the chosen tokens alone, which overweights them when attention is spread thinly
        (``alisa/kv/rest.py``, docs/ruler.md). ``None``: ``alisa.settings.ESTIMATE_REST``.
    min_budget_tokens
        Least tokens kept (attended) per sequence, whatever r; ``None``: 64 under the
        ``default`` preset, 0 under ``paper``.
    observation_window
        Attention-scored policies: the last this-many prompt queries, summed and pooled over
        neighbouring tokens, seed the scores at prefill (SnapKV), so a question at the end of a
        prompt protects what it asks about; 0 seeds with the policy's own rows (the paper);
        ``None``: 8 under the ``default`` preset, 0 under ``paper``.
    preset
        What fields left unset mean: ``default`` (a budget floor of 64 tokens, 4 attention
        sinks for every evicting policy but ``local``, per-KV-head selection for SWA and H2O,
        an 8-query observation window for the attention-scored policies, SWA scored by the
        query-head max decayed over 4k steps) or ``paper`` (each paper's own setting: no
        floor, the policy's own sinks, one index set per layer, scores seeded by the policy's
        own rows, SWA's exact sum over the last k steps).
    kernels
        Which kernels run host retention's step and, on a CPU, every mode's KV writes,
        attention over the kept slots and slot map: ``auto`` (the device's: ``cuda``, Triton's,
        on a CUDA device with Triton; ``cpu``, numba's compiled kernels, on a CPU; else
        ``reference``), ``reference`` (PyTorch operators, the definition the others are
        tested against), ``cpu`` or ``cuda``. A static (compiled) cache on a CPU traces
        PyTorch's operators under ``auto``; ``cpu`` calls numba's attention and eviction there
        as registered operators (:mod:`alisa.ops.library`). Chosen once per cache, and named by
        ``--show-config``, the ``[alisa]`` line and ``GenerationOutput.kernels``
        (:mod:`alisa.ops.backends`).
    residual_tokens
        With kv_bits < 16, the most recent tokens also kept in full precision (KIVI and HF's
        quantized cache do the same, HF with 128); 0 stores every token quantized, as the paper.
    """

    policy: str = "dense"
    caching_ratio: float = 1.0
    budget_tokens: int | None = None
    recent_fraction: float | None = None
    sink_tokens: int | None = None
    score_window: int | None = None
    score_decay: bool | None = None
    head_max: bool | None = None
    stride: int | None = None
    dense_layers: int = 0
    layer_schedule: str = "uniform"
    per_head: bool | None = None
    kv_bits: int = 16
    quant_group_size: int | None = None
    residual_tokens: int = 64
    gpu_memory: int | str | None = None
    host_memory: int | str | None = None
    recompute: str = "auto"
    profile: str | None = None
    retention: str = "drop"
    host_bits: int = 8
    history_share: float | None = None
    reselect_every: int | None = None
    estimate_rest: bool | None = None
    min_budget_tokens: int | None = None
    observation_window: int | None = None
    preset: str = "default"
    kernels: str = "auto"

    def __post_init__(self) -> None:
        check_field_types(self)
        if self.policy not in policies.POLICIES:
            raise ValueError(
                f"policy={self.policy!r} is unknown; valid: {', '.join(sorted(policies.POLICIES))}"
            )
        check_share("caching_ratio", self.caching_ratio)
        check_optional_int("budget_tokens", self.budget_tokens, minimum=1)
        self._check_budget_applies()
        if self.budget_tokens is not None and self.caching_ratio != 1.0:
            raise ValueError(
                f"budget_tokens={self.budget_tokens!r} replaces caching_ratio="
                f"{self.caching_ratio!r} (a sequence keeps budget_tokens whatever r); set one "
                "of the two"
            )
        if self.recent_fraction is not None:
            check_share("recent_fraction", self.recent_fraction, zero=True)
        check_optional_int("sink_tokens", self.sink_tokens, minimum=0)
        check_optional_int("score_window", self.score_window, minimum=1)
        check_optional_int("stride", self.stride, minimum=1)
        check_optional_int("dense_layers", self.dense_layers, minimum=0)
        if self.layer_schedule not in LAYER_SCHEDULES:
            raise ValueError(
                f"layer_schedule={self.layer_schedule!r} is unknown; "
                f"valid: {', '.join(LAYER_SCHEDULES)}"
            )
        if self.kv_bits not in KV_BITS:
            raise ValueError(f"kv_bits={self.kv_bits!r} must be one of {KV_BITS}")
        check_optional_int("quant_group_size", self.quant_group_size, minimum=1)
        if self.kv_bits == 4 and self.quant_group_size is not None and self.quant_group_size % 2:
            raise ValueError(
                f"quant_group_size={self.quant_group_size} must be even with kv_bits=4 (two 4-bit "
                "codes share a byte): use 2, 4, 8, ... up to the head size"
            )
        check_optional_int("residual_tokens", self.residual_tokens, minimum=0)
        for name in ("gpu_memory", "host_memory"):
            if getattr(self, name) is not None:
                parse_budget(getattr(self, name), field=name)
        if self.recompute not in RECOMPUTE_MODES:
            raise ValueError(
                f"recompute={self.recompute!r} is unknown; valid: {', '.join(RECOMPUTE_MODES)}"
            )
        if self.retention not in RETENTIONS:
            raise ValueError(
                f"retention={self.retention!r} is unknown; valid: {', '.join(RETENTIONS)}"
            )
        if self.host_bits not in KV_BITS:
            raise ValueError(f"host_bits={self.host_bits!r} must be one of {KV_BITS}")
        self._check_history_share()
        check_optional_int("reselect_every", self.reselect_every, minimum=1)
        if self.reselect_every not in (None, 1) and self.retention != "host":
            raise ValueError(
                f"reselect_every={self.reselect_every!r} needs retention='host' (with "
                f"retention={self.retention!r} nothing is selected again)"
            )
        if self.estimate_rest is not None and self.retention != "host":  # False too: unread
            raise ValueError(
                f"estimate_rest={self.estimate_rest!r} needs retention='host' (with "
                f"retention={self.retention!r} tokens left out are gone: there is nothing to "
                "estimate)"
            )
        check_optional_int("min_budget_tokens", self.min_budget_tokens, minimum=0)
        check_optional_int("observation_window", self.observation_window, minimum=0)
        if self.preset not in PRESETS:
            raise ValueError(f"preset={self.preset!r} is unknown; valid: {', '.join(PRESETS)}")
        if self.kernels not in KERNELS:
            raise ValueError(f"kernels={self.kernels!r} is unknown; valid: {', '.join(KERNELS)}")
        if self.retention == "host" and self.gpu_memory is not None:
            raise ValueError(
                "retention='host' cannot be combined with gpu_memory (its device region is "
                "already the budget; the tier planner places dropped-mode KV only)"
            )
        if self.per_head and self.gpu_memory is not None:
            raise ValueError(
                "per_head=True cannot be combined with gpu_memory (tiers are per layer)"
            )
        self._check_retention_applies()
        self._warn_ignored()

    def _check_budget_applies(self) -> None:
        """A policy that never evicts keeps every token: a budget for it would be meaningless
        (and a summary showing it would misdescribe the run)."""
        if policies.POLICIES[self.policy].evicts:
            return
        if self.caching_ratio != 1.0:
            raise ValueError(
                f"caching_ratio={self.caching_ratio!r} has no effect with policy="
                f"{self.policy!r}, which keeps every token; leave it at 1 or choose an evicting "
                "policy (e.g. swa)"
            )
        if self.budget_tokens is not None:
            raise ValueError(
                f"budget_tokens={self.budget_tokens!r} has no effect with policy="
                f"{self.policy!r}, which keeps every token; leave it unset or choose an evicting "
                "policy (e.g. swa)"
            )

    def _check_retention_applies(self) -> None:
        """Host retention keeps on the host the tokens a policy leaves out; a policy that never
        evicts leaves none out, so the run would be dropping mode under another name (and its
        summary would misdescribe it)."""
        if self.retention == "host" and not policies.POLICIES[self.policy].evicts:
            raise ValueError(
                f"retention={self.retention!r} has no effect with policy={self.policy!r}, which "
                "keeps every token: there is nothing to keep on the host; leave it at 'drop' or "
                "choose an evicting policy (e.g. swa)"
            )

    def _warn_ignored(self, *, said: Collection[str] = (), stacklevel: int = 4) -> None:
        """One :class:`~alisa.settings.IgnoredSettingWarning` per setting no run would read,
        but those in ``said``; ``stacklevel`` 4 names the line that built the config (past
        this method, ``__post_init__`` and ``__init__``).

        ``recompute`` and ``profile`` without ``gpu_memory`` are not judged here: the planner
        (``alisa plan``, :mod:`alisa.planning`) reads them over the whole device, so only the
        caller knows whether they matter (the CLI does).
        """
        for note in ignored_settings(self, tiered=True):
            if note not in said:
                warnings.warn(note, IgnoredSettingWarning, stacklevel=stacklevel)

    def _check_history_share(self) -> None:
        if self.history_share is None:
            return
        check_share("history_share", self.history_share, zero=True)
        # 0 too: without host retention (or attention scores) nothing reads it, as any other
        # value (estimate_rest=False is refused alike).
        if self.retention != "host":
            raise ValueError(
                f"history_share={self.history_share!r} needs retention='host' (with "
                f"retention={self.retention!r} the policy's own scores already rank every token)"
            )
        if not policies.POLICIES[self.policy].needs_attention:
            raise ValueError(
                f"history_share={self.history_share!r} needs an attention-scored policy; "
                f"policy={self.policy!r} keeps no attention history"
            )

    @property
    def host_history_share(self) -> float:
        """``history_share``, or its default: 0.5 for an attention-scored policy with
        ``retention="host"``, else 0 (:func:`alisa.settings.resolve_settings` decides)."""
        return resolve_settings(self, self._any_layers).history_share

    @property
    def host_reselect_every(self) -> int:
        """``reselect_every``, or its default (:func:`alisa.settings.resolve_settings`)."""
        return resolve_settings(self, self._any_layers).reselect_every

    @property
    def host_memory_bytes(self) -> int | None:
        """``host_memory`` in bytes (validated when the config was built); None: not set."""
        host = self.host_memory
        return None if host is None else parse_budget(host, field="host_memory")

    @property
    def host_estimate_rest(self) -> bool:
        """``estimate_rest``, or its default (:func:`alisa.settings.resolve_settings`)."""
        return resolve_settings(self, self._any_layers).estimate_rest

    @property
    def selects_per_head(self) -> bool:
        """Whether each KV head keeps its own index set (``per_head``, or the preset's choice)."""
        return resolve_settings(self, self._any_layers).per_head

    @property
    def _any_layers(self) -> int:
        # A layer count valid for this config (one sparse layer past the dense ones), for
        # settings that do not depend on it.
        return self.dense_layers + 1

    @property
    def keeps_everything(self) -> bool:
        """True when no token can ever be evicted (a policy that never evicts, or r = 1 with no
        token budget and a uniform schedule)."""
        uniform = self.caching_ratio == 1.0 and self.layer_schedule == "uniform"
        return not policies.POLICIES[self.policy].evicts or (uniform and self.budget_tokens is None)

    def keep_rules(
        self, num_layers: int, windows: Sequence[int | None] = ()
    ) -> tuple[KeepRule, ...]:
        """The budget rule of each of ``num_layers`` layers: what the cache keeps, for sizing and
        planning (sinks, pyramid scales and dense layers included). A layer with a sliding
        window W (``windows``, None: full attention) attends to at most W tokens, whatever the
        policy."""
        return tuple(
            KeepRule(budget_tokens=windows[i])
            if i < len(windows) and windows[i] is not None
            else policy_for_layer(self, i, num_layers).keep_rule
            for i in range(num_layers)
        )

    def with_overrides(self, **changes) -> AlisaConfig:
        """A copy with some fields changed (validated again); unknown names raise ``ValueError``.

        An :class:`~alisa.settings.IgnoredSettingWarning` comes only for what the changes
        leave unread: this config's own were said when it was built (``alisa batch`` copies
        the CLI's config without ``gpu_memory``, a server each request's settings over its own).
        """
        known = {f.name for f in fields(self)}
        unknown = sorted(set(changes) - known)
        if unknown:
            raise ValueError(f"unknown AlisaConfig field(s) {unknown}; valid: {sorted(known)}")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", IgnoredSettingWarning)
            copy = replace(self, **changes)
        copy._warn_ignored(said=ignored_settings(self, tiered=True), stacklevel=3)
        return copy


def config_or_default(config: AlisaConfig | None) -> AlisaConfig:
    """``config``, or ``AlisaConfig()`` for None.

    Raises
    ------
    ValueError
        Anything else (a policy name, a dict), naming it: its fields would be read as attributes.
    """
    if config is None:
        return AlisaConfig()
    if not isinstance(config, AlisaConfig):
        raise ValueError(
            f"config={config!r} must be an AlisaConfig, e.g. AlisaConfig(policy='swa', "
            "caching_ratio=0.2) (None: the defaults)"
        )
    return config


def policy_for_layer(config: AlisaConfig, layer_idx: int, num_layers: int) -> KVPolicy:
    """The policy one layer runs: the config's, with its options and the layer's budget scale.

    The first ``config.dense_layers`` layers keep every token. A policy's own options (SWA's
    window, strided's stride) come from the config fields its ``config_fields`` names; unset
    fields are decided by :func:`alisa.settings.resolve_settings` (this is its layer entry).
    """
    return layer_settings(config, layer_idx, num_layers).build()
