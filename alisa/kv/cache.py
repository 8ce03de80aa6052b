"""``AlisaCache``: a transformers ``Cache`` whose layers keep only what the KV policy selects."""

from __future__ import annotations

import warnings
import weakref
from collections.abc import Callable
from functools import partial

import numpy as np
import torch
from torch import nn
from transformers.cache_utils import Cache

from alisa.checks import check_int
from alisa.config import AlisaConfig, config_or_default, policy_for_layer
from alisa.kv.attention import ATTENTION_NAME, attach
from alisa.kv.drop import DropKeeper
from alisa.kv.host import HostKeeper
from alisa.kv.layer import AlisaLayer, Keeper
from alisa.kv.packed import PackedLayer, split_kv
from alisa.kv.static import StepPack
from alisa.kv.swap import copy_replacing
from alisa.kv.window import WindowKeeper
from alisa.model.adapter import ModelAdapter, ModelShape, check_loaded
from alisa.model.loading import context_length
from alisa.ops.backends import Ops, model_ops
from alisa.ops.transfer import upload
from alisa.planning.tiers import TierPlanner
from alisa.policies import BudgetBook, DensePolicy, KVPolicy
from alisa.settings import (
    IgnoredSettingWarning,
    coded_size_note,
    full_precision_note,
    no_host_region,
    ring_tokens,
    unread_kernels_note,
    untiered_notes,
)
from alisa.storage.quantized import QuantizedStore
from alisa.storage.recompute import KVRecomputer
from alisa.storage.store import DenseStore, StoreFactory
from quant import check_options

TIERS = ("device", "host", "recompute")  # reported even when empty
KeeperFactory = Callable[[AlisaConfig, KVPolicy], Keeper]


class AlisaCache(Cache):
    """KV cache that evicts by policy (ALISA SWA, H2O, TOVA, ...) during prefill and decode.

    Use it wherever HF takes a cache::

        cache = AlisaCache(model, AlisaConfig(policy="swa", caching_ratio=0.2))
        model.generate(**inputs, past_key_values=cache)

    Building it routes the model's attention through the ``alisa`` attention function
    (:func:`~alisa.kv.attention.attach`), plain SDPA for any other cache; the model's previous
    attention comes back at its first forward with another cache. One cache serves one batch
    of sequences; given to ``model.generate`` again with the whole conversation (a second chat
    turn), it continues as HF's own ``DynamicCache`` does, or refuses what it cannot continue
    exactly (:meth:`check_continuation`).

    Parameters
    ----------
    model
        A decoder-only HF model whose layers are full or sliding-window attention run through
        transformers' attention interface (Llama, Qwen, Mistral, Gemma 3, GPT-2, OPT, ...);
        anything else is refused here, naming the reason.
    config
        Policy, caching ratio and storage options.
    max_new_tokens
        Generation length the tier planner (``gpu_memory``) and the ``host_memory`` check of
        ``retention="host"`` assume.
    max_cache_len
        Make the cache static, as HF's ``StaticCache`` (:mod:`alisa.kv.static`): every layer's
        slot space is fixed after the prefill for contexts of up to this many tokens per
        sequence (prompt, padding included, and new tokens), so each decode step has one shape
        and no host read and ``torch.compile`` traces it once (:attr:`is_compileable`). Modes
        with a static step: dense and dropping (every policy whose scores are not summed over
        an exact window of steps), sliding-window layers, 16-bit KV; the others are refused
        here naming why. ``kernels="auto"`` then runs PyTorch's operators on a CPU (numba's
        cannot be traced). Rows join and leave it as they do a growing cache (:meth:`extend`
        of another cache of the same ``max_cache_len``, :meth:`keep_rows`, :meth:`take_rows`:
        continuous batching compiled). None: the cache grows and compacts as needed.
    keeper
        Builds each full-attention layer's :class:`~alisa.kv.layer.Keeper` from the config and
        the layer's policy; None: :func:`default_keeper` (dropping, or host retention running
        the kernels of ``config.kernels``, chosen once: :attr:`ops`).
        Sliding-window layers (Gemma 2/3, Mistral with a window, ...) always keep exactly the
        model's window (:class:`~alisa.kv.window.WindowKeeper`): the caching ratio applies to
        the full-attention layers only. Anything else but None or a callable is a
        ``TypeError`` naming ``keeper``.
    """

    def __init__(
        self,
        model: nn.Module,
        config: AlisaConfig | None = None,
        *,
        max_new_tokens: int = 256,
        max_cache_len: int | None = None,
        keeper: KeeperFactory | None = None,
    ) -> None:
        if keeper is not None and not callable(keeper):  # refused here, not at the first layer
            raise TypeError(
                f"keeper={keeper!r} must be a callable (config, policy) -> Keeper, as "
                "alisa.kv.cache.default_keeper, or None (the default keeper)"
            )
        self.config = config_or_default(config)
        _check_host_memory_applies(self.config)
        check_int("max_new_tokens", max_new_tokens, minimum=0)
        self.max_new_tokens = int(max_new_tokens)
        adapter = ModelAdapter.of(model)
        check_loaded(model)
        self.shape: ModelShape = adapter.shape
        known = context_length(model)
        context = known[0] if known is not None else None
        self.max_cache_len = _check_static(self.config, max_cache_len, known)
        if context is not None and (
            note := full_precision_note(self.config, context, context=True)
        ):
            warnings.warn(note, IgnoredSettingWarning, stacklevel=2)
        for note in untiered_notes(self.config):  # AlisaConfig leaves these to its user
            warnings.warn(note, IgnoredSettingWarning, stacklevel=2)
        # The kernels the cache runs, chosen once for every layer (and refused here when this
        # machine cannot run the ones asked for): named by GenerationOutput.kernels.
        traced = max_cache_len is not None
        self.ops: Ops = model_ops(model, self.config.kernels, traced=traced)
        if note := unread_kernels_note(self.config, self.ops.device):  # a CUDA step without one
            warnings.warn(note, IgnoredSettingWarning, stacklevel=2)
        if traced and self.config.retention == "host":
            _check_static_host(self.config, self.ops.device, model.dtype)
        # A static cache's step numbers, bound at its first decode step (alisa.kv.static), and
        # whether a step was planned whose token is not stored yet.
        self._pack: StepPack | None = None
        self._planned = False
        factory = store_factory(
            self.config,
            self.shape,
            compiled=self.ops.compiled,
            operators=self.ops.operators,
            context=context,
            static=traced,
            branch=self.ops.branches,
        )
        if note := coded_size_note(self.config, self.shape.head_dim, model.dtype.itemsize):
            warnings.warn(note, IgnoredSettingWarning, stacklevel=2)
        self.planner = None
        if self.config.gpu_memory is not None and self.shape.hybrid:
            raise ValueError(
                f"gpu_memory={self.config.gpu_memory!r}: device/host/recompute tiers are planned "
                f"for full-attention layers only, and {type(model).__name__} has sliding-window "
                "layers (their KV is already bounded by the window)"
            )
        if self.config.gpu_memory is not None:
            self.planner = _planner(
                model, adapter, self.config, factory, max_new_tokens, pinned=self.ops.pinned
            )
        # One book of budgets for every layer: a step computes each policy's once, not per layer
        # (layers with equal policies are given one policy object, which the book knows by id).
        budgets = BudgetBook()
        policies: dict[KVPolicy, KVPolicy] = {}
        layers = [
            self._layer(index, factory, keeper, budgets, policies)
            for index in range(self.shape.num_layers)
        ]
        # Past _check_host_memory_applies, a host_memory without tiers is retention="host"'s.
        host = self.config.host_memory
        if host is not None and self.planner is None and not _holds_host(layers):
            raise no_host_region(host)
        super().__init__(layers=layers)
        attach(model, adapter=adapter)
        self._model_config = model.config
        # The model whose geometry, kernels and hooks this cache holds. A weak reference: the
        # cache does not keep the model alive, and its deep copies (take_rows) share it.
        self._built_for = weakref.ref(model)
        # Set by claim() when that model's forward announces itself; the forward's first
        # stored layer takes it (a forward of another model, unhooked, finds none).
        self._claimed = False

    def _layer(
        self,
        index: int,
        factory: StoreFactory,
        keeper: KeeperFactory | None,
        budgets: BudgetBook,
        policies: dict[KVPolicy, KVPolicy],
    ) -> AlisaLayer:
        window = self.shape.window(index)
        if window is not None:
            # The model's own window bounds a sliding layer: no policy applies there.
            chosen: Keeper = WindowKeeper(DensePolicy(), window)
        else:
            policy = policy_for_layer(self.config, index, self.shape.num_layers)
            policy = policies.setdefault(policy, policy)  # equal policies: one object
            chosen = (keeper or partial(default_keeper, ops=self.ops))(self.config, policy)
        chosen.share_budgets(budgets)
        return AlisaLayer(
            chosen,
            layer_idx=index,
            store_factory=factory,
            tiering=self.planner,
            compiled=self.ops.compiled,
            max_cache_len=self.max_cache_len,
        )

    def update(self, key_states, value_states, layer_idx: int, *args, **kwargs):
        if layer_idx == 0 and self._model_config._attn_implementation != ATTENTION_NAME:
            # Another attention function would read the slot buffers without their mask.
            raise ValueError(
                f"attn_implementation={self._model_config._attn_implementation!r} is incompatible "
                f"with AlisaCache, which needs {ATTENTION_NAME!r} (set when the cache is built)"
            )
        if layer_idx == 0 and not self._started():  # the prefill: lengths are known now
            self._take_claim()
            self._check_host_budget(key_states)
        elif layer_idx == 0:  # before any layer stores them (the model's hook checked more)
            if not torch.compiler.is_compiling():  # a traced step's claim is its caller's
                self._take_claim()  # another model of the same shapes would read these keys
            self._check_rows(key_states.shape[0], key_states.shape[2])
            self._planned = False  # a static step's token is being stored: counted from now
        return super().update(key_states, value_states, layer_idx, *args, **kwargs)

    def get_seq_length(self, layer_idx: int = 0) -> int | torch.Tensor:
        """Tokens seen per sequence (padding included). Between a static step's host half
        (:meth:`begin_forward`, which counts its token ahead) and the step storing it, the
        count before the step: a model that derives positions from it (no ``position_ids``
        given) places the token where the growing cache would.

        In a traced static step the count is a () device tensor, as HF's ``StaticLayer``
        returns: OPT, BERT, BioGPT and their kin call this in every forward, and a host
        number read there would be baked into the graph and guarded (a recompile per step)."""
        if self._pack is not None and torch.compiler.is_compiling():
            position = self._pack.position()[0]  # the token this step writes
            return position if self._planned else position + 1
        seen = super().get_seq_length(layer_idx)
        return seen - 1 if self._planned else seen

    def check_continuation(
        self,
        batch: int,
        tokens: int,
        attention_mask: torch.Tensor | None,
        *,
        model: nn.Module | None = None,
    ) -> None:
        """Refuse, before anything is stored, a forward that would not continue this cache
        exactly as transformers' ``DynamicCache`` continues (HF's ``generate`` given the same
        cache again, as for a second chat turn: it feeds only the tokens past
        :meth:`get_seq_length`).

        A cache not yet filled takes any prompt. A filled one takes the ``batch`` sequences it
        holds, each extended by ``tokens`` >= 1 new, unpadded tokens (a decode step is one).
        More than one new token is a second prefill over what the cache keeps; it is refused
        where that is not well defined (:meth:`_check_extends`). The model's forward hook
        (:mod:`alisa.kv.attention`) calls this; the first layer's :meth:`update` checks the rows
        and the mode again, for forwards that bypass the hook.

        Parameters
        ----------
        batch, tokens
            The forward's rows and new tokens per row.
        attention_mask
            The forward's (B, seen + tokens) padding mask, or None (every token attended). Read
            only when more than one token is added (one host read; a decode step reads nothing).
        model
            The model running the forward: the forward is claimed for it (:meth:`claim`).

        Raises
        ------
        ValueError
            Another batch size, no new token (an input no longer than what is cached), a
            multi-token continuation refused by its mode or its padding mask, or another model
            than the one the cache was built for.
        """
        if model is not None:  # its own model's forward, filled or not
            self.claim(model)
        if self.layers[0].store is None:  # not filled yet: any prompt
            return
        self._check_rows(batch, tokens)
        if tokens > 1:
            self._check_continuation_mask(attention_mask, batch, tokens)

    # Never traced: HF's generate compiles the model's whole call, hooks included, for a cache
    # that says it is compileable (on CUDA); the host's half of the step then runs eagerly
    # between graphs instead of being baked into one as constants.
    @torch.compiler.disable
    def begin_forward(
        self,
        batch: int,
        tokens: int,
        attention_mask: torch.Tensor | None,
        *,
        model: nn.Module | None = None,
    ) -> None:
        """Before a forward: :meth:`check_continuation`, then, before a static cache's decode
        step, the host's half of the step (:mod:`alisa.kv.static`): each layer counts its
        token and writes its numbers, uploaded in one copy. The model's forward hook calls
        this; a compiled step, which runs no hook, calls it first
        (:class:`~alisa.runtime.compiled.CompiledDecode`).

        Raises
        ------
        ValueError
            What :meth:`check_continuation` refuses, or a static cache past its
            ``max_cache_len``.
        """
        self.check_continuation(batch, tokens, attention_mask, model=model)
        if self.max_cache_len is None:
            return
        prefill = self.layers[0].store is None
        seen = 0 if prefill else self.get_seq_length()
        if seen + tokens > self.max_cache_len:
            held = (
                f"a prompt of {tokens} tokens per sequence (padding included) is longer than it"
                if prefill
                else f"this static cache holds {seen} tokens per sequence and cannot take "
                f"{tokens} more"
            )
            raise ValueError(
                f"max_cache_len={self.max_cache_len}: {held}; build it with max_cache_len of at "
                "least the prompt plus the new tokens"
            )
        if prefill:
            return
        if not self._bound(batch):
            self._pack = StepPack(self.layers[0].device, batch, pinned=self.ops.pinned)
            for layer in self.layers:
                layer.bind(self._pack, batch)
            self._pack.freeze()
        self._pack.begin(seen)
        for layer in self.layers:
            layer.plan_step()
        self._pack.upload()
        self._planned = True

    def _bound(self, batch: int) -> bool:
        """Whether every layer reads this cache's step numbers, laid out for ``batch`` rows."""
        pack = self._pack
        return (
            pack is not None
            and all(
                layer.keeper.pack is pack and layer.slots.batch == batch for layer in self.layers
            )
            and pack.rows == batch
        )

    def get_query_offset(self, layer_idx: int = 0) -> int | torch.Tensor:
        """Tokens before this forward's first query: a static decode step's is the device
        number of its step (a traced step reads no host count, as HF's ``StaticLayer``
        answers with a tensor); else :meth:`get_seq_length`."""
        if self._pack is not None and self.layers[layer_idx].keeper.pack is self._pack:
            return self._pack.position()[0]
        return super().get_query_offset(layer_idx)

    def get_mask_sizes(self, query_length: int, layer_idx: int) -> tuple[int, int]:
        """HF's mask sizes (:meth:`AlisaLayer.get_mask_sizes`); a forward of no new token is
        refused here, before its layers run: HF's ``generate`` cuts an input no longer than
        what the cache holds down to nothing, and the model's attention then fails reshaping
        an empty query. Its own model's forward says so; another model's is refused for
        reaching the cache without its model (as :meth:`update` would)."""
        if isinstance(query_length, int) and query_length == 0:
            self._take_claim()  # another model's forward: refused naming the cache's model
            raise self._no_new_tokens()
        return super().get_mask_sizes(query_length, layer_idx)

    def claim(self, model: nn.Module | None) -> None:
        """Announce that ``model``'s forward stores into this cache next (the model's forward
        hook calls this, and a mixed forward for both its caches), refusing any model but the
        one the cache was built for: its geometry, kernels, attention routing and keys are that
        model's.

        The forward's first layer (:meth:`update`) takes the claim, and refuses to store without
        one: a model that was never attached runs its own attention, which would read the cache
        without its mask, and another model of the same shapes would run on this one's keys and
        values. (A traced step, whose caller claimed it, is not checked.)

        Raises
        ------
        ValueError
            Naming both models.
        """
        built_for = self._built_for()
        if model is not built_for:
            raise ValueError(
                f"past_key_values (an AlisaCache) was built for {_model_name(built_for)} and is "
                f"given to another model, {_model_name(model)}: a cache holds its own model's "
                "geometry, kernels, attention routing and keys; build AlisaCache(model, config) "
                "for this one"
            )
        self._claimed = True

    def _take_claim(self) -> None:
        """Store a forward's tokens only when the cache's own model announced it
        (:meth:`claim`)."""
        if not self._claimed:
            raise ValueError(
                f"past_key_values (an AlisaCache) was built for {_model_name(self._built_for())}"
                ", and this forward reached it without passing through that model: another "
                "model's own attention would read the cache without its mask; build "
                "AlisaCache(model, config) for the model you run"
            )
        self._claimed = False  # the next forward is announced again

    def _check_rows(self, batch: int, tokens: int) -> None:
        """A filled cache takes its own batch size, at least one new token, and several only
        in a mode that can continue with them."""
        held = self.layers[0].slots.batch  # a shape: read by a traced step as a constant
        if batch != held:
            raise ValueError(
                f"past_key_values (an AlisaCache) holds a batch of {held} sequence(s) and this "
                f"forward feeds {batch}: a cache continues the batch it was filled with; build "
                "a new AlisaCache for another batch size"
            )
        if tokens < 1:
            raise self._no_new_tokens()
        if tokens > 1:
            self._check_extends(tokens)

    def _no_new_tokens(self) -> ValueError:
        return ValueError(
            f"past_key_values (an AlisaCache) already holds {self.get_seq_length()} tokens "
            "per sequence and this forward adds none: the input must extend the cached "
            "tokens (pass the whole conversation, or a new AlisaCache for a new prompt)"
        )

    def _check_extends(self, tokens: int) -> None:
        """Refuse modes for which ``tokens`` new tokens after the prefill are not one well
        defined step: dropping attends to every kept token and the new ones, then evicts (as
        its prefill does); these cannot."""
        if self.max_cache_len is not None:
            raise ValueError(
                f"max_cache_len={self.max_cache_len}: a static cache's step takes one token per "
                f"sequence, not {tokens}: build a new AlisaCache for the whole conversation"
            )
        if self.planner is not None:
            raise ValueError(
                f"gpu_memory={self.config.gpu_memory!r}: device/host/recompute tiers are "
                f"planned for one prompt and max_new_tokens={self.max_new_tokens}; a cache "
                f"continued with {tokens} more input tokens would outgrow them unchecked: build "
                "a new AlisaCache for the whole conversation"
            )
        if self.config.host_memory is not None:
            raise ValueError(
                f"host_memory={self.config.host_memory!r} was checked for one prompt and "
                f"max_new_tokens={self.max_new_tokens}; a cache continued with {tokens} more "
                "input tokens could exceed it unchecked: build a new AlisaCache for the whole "
                "conversation"
            )
        if _holds_host(self.layers):
            raise ValueError(
                f"retention='host' (policy={self.config.policy!r}, whose budget can leave "
                f"tokens on the host) cannot continue a cache with {tokens} input tokens at "
                "once: they would all attend to the one selection made for the last of them; "
                "build a new AlisaCache for the whole conversation, or use retention='drop'"
            )

    def _check_continuation_mask(
        self, attention_mask: torch.Tensor | None, batch: int, tokens: int
    ) -> None:
        """The forward's padding mask must be the cached sequences' own (their left padding)
        followed by ``tokens`` ones: after its prefill the cache masks by its slots, never by
        HF's mask, so any other mask would be ignored."""
        seen = self.get_seq_length()
        device = self.layers[0].device
        if attention_mask is None:  # HF attends to every token, padding included
            attention_mask = torch.ones(batch, seen + tokens, dtype=torch.bool, device=device)
        if attention_mask.dim() != 2 or attention_mask.shape[1] != seen + tokens:
            raise ValueError(
                f"attention_mask of shape {tuple(attention_mask.shape)} does not cover the "
                f"{seen} cached and {tokens} new tokens per sequence: an AlisaCache continues "
                "with a 2D padding mask of both"
            )
        given = attention_mask.bool()
        columns = torch.arange(seen + tokens, device=given.device).view(1, -1)
        for window, first in self._padding_starts().items():
            # The new tokens see from position seen - window + 1 on in a sliding layer (whose
            # ``first`` also counts what its window left behind): earlier columns reach no one.
            start = 0 if window is None else max(seen - window + 1, 0)
            expected = columns[:, start:] >= torch.as_tensor(first, device=given.device)[:, None]
            if not torch.equal(given[:, start:], expected):
                raise ValueError(
                    "attention_mask masks tokens other than the cached sequences' left padding "
                    f"(the {tokens} new tokens must be unpadded, and the cached ones masked as "
                    "when they were stored): an AlisaCache masks by what it stored, so another "
                    "mask would be ignored; build a new AlisaCache for a differently padded batch"
                )

    def _padding_starts(self) -> dict[int | None, np.ndarray]:
        """Per window (None: full attention), each sequence's first position its layers keep
        as a real token: after the left padding, and in a sliding layer also after what its
        window had left behind at the prefill."""
        return {layer.keeper.window: layer.slots.first for layer in self._started()}

    def kv_bytes(self, tier: str | None = None) -> int:
        """Bytes of key/value buffers held by all layers (spare capacity included).

        ``tier`` = ``"device"``, ``"host"`` or ``"recompute"`` gives one tier (with
        ``retention="host"`` the key sketch counts on the device); ``None`` the total.
        """
        if tier is None:
            return sum(layer.kv_bytes() for layer in self.layers)
        if tier not in TIERS:
            raise ValueError(f"tier={tier!r} is unknown; valid: {', '.join(TIERS)}")
        return self.tier_bytes()[tier]

    def state_bytes(self) -> int:
        """Bytes of bookkeeping held besides K/V: slot positions and attention sums."""
        return sum(layer.state_bytes() for layer in self.layers)

    def stored_tokens(self) -> int:
        """Tokens stored over all layers and sequences (KV heads counted when per head)."""
        return sum(layer.stored_tokens() for layer in self.layers)

    def tier_bytes(self) -> dict[str, int]:
        """KV bytes per tier: device, host, recompute (hidden states); all on device if untiered."""
        totals = dict.fromkeys(TIERS, 0)
        for layer in self._started():
            for tier, count in layer.tier_bytes().items():
                totals[tier] = totals.get(tier, 0) + count
        return totals

    def tier_tokens(self) -> dict[str, int]:
        """Stored tokens per tier (device, host, recompute) over all layers and sequences."""
        totals = dict.fromkeys(TIERS, 0)
        for layer in self._started():
            positions, offset = layer.slot_positions(), 0
            for tier, slots in layer.store.regions:
                stored = int((positions[..., offset : offset + slots] >= 0).sum())
                totals[tier] = totals.get(tier, 0) + stored
                offset += slots
        return totals

    def evicted_tokens(self) -> int:
        """Tokens evicted so far over all layers and sequences."""
        return sum(layer.keeper.evicted for layer in self.layers)

    # ---- continuous batching: rows leave and join ------------------------------------------

    def extend(self, other: AlisaCache) -> None:
        """Append the sequences of ``other`` (prefilled, same model and config) after these.

        Their timelines are aligned as virtual left padding: the batch that has seen fewer
        tokens moves later by the difference (:meth:`AlisaLayer.shift_positions`, an integer
        add on the slot map; with ``retention="host"`` its position-indexed host region,
        sketch and history are padded on the left), so the newest token of every row sits at
        the same position, as in a left-padded batch. No running row is re-padded or copied
        beyond the concatenation itself. Every layer then concatenates its own state
        (:meth:`AlisaLayer.extend_rows`); ``other`` must not be used afterwards.

        Raises
        ------
        ValueError
            Caches of different configs or models, a cache not prefilled yet, or device tiers
            (``gpu_memory``), whose region sizes are planned per batch.
        """
        if other.config != self.config or len(other.layers) != len(self.layers):
            raise ValueError("caches of different configs or models cannot share a batch")
        self._check_rows_change("take rows into a running batch")
        if other.max_cache_len != self.max_cache_len:  # one slot space a layer, one shape
            raise ValueError(
                f"caches of max_cache_len={self.max_cache_len} and {other.max_cache_len} cannot "
                "share a batch: build the rows joining as the running ones"
            )
        if self.planner is not None or other.planner is not None:
            raise ValueError(
                f"gpu_memory={self.config.gpu_memory!r}: tiered caches cannot take rows into a "
                "running batch (their tier sizes are planned per batch)"
            )
        if any(len(cache._started()) != len(cache.layers) for cache in (self, other)):
            raise ValueError("both caches must be prefilled before rows join")
        delta = other.get_seq_length() - self.get_seq_length()
        (self if delta > 0 else other).shift_positions(abs(delta))
        for mine, theirs in zip(self.layers, other.layers, strict=True):
            mine.extend_rows(theirs)
        self._rows_changed()

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        """Keep the sequences ``indices`` (in that order; one may be named more than once, a
        copy: continuous batching fills a compiled step's batch so)."""
        self._check_rows_change("change its rows")
        super().batch_select_indices(indices)
        self._rows_changed()

    @property
    def batch_rows(self) -> int:
        """Sequences the cache holds (0 before its prefill)."""
        started = self._started()
        return len(started[0].slots.first) if started else 0

    def _check_rows_change(self, action: str) -> None:
        """Refuse to change a static cache's rows where its layers cannot carry them yet."""
        if self.max_cache_len is not None and (why := static_rows_refusal(self.config)):
            raise ValueError(
                f"max_cache_len={self.max_cache_len}: a static cache cannot {action}: {why}"
            )

    def _rows_changed(self) -> None:
        """A static cache's rows are new tensors: its next step binds its numbers to them
        again (and marks their addresses for the compiler), whatever the batch size."""
        self._pack = None

    def keep_rows(self, indices: torch.Tensor) -> None:
        """Keep only the sequences ``indices`` (in that order) and return what they no longer
        need: the positions before every kept sequence's first token (the whole batch moves
        earlier by their count) and every empty slot (:meth:`AlisaLayer.trim`).

        So the padded span stays the longest row's length, not the age of the running batch.
        """
        self.batch_select_indices(indices)
        layers = self._started()
        if not layers or len(indices) == 0:
            return
        # A sliding layer counts what its window no longer reaches as padding (its ``first``
        # is later), so the positions no layer uses end at the smallest ``first`` of all.
        unused = min(int(layer.slots.first.min()) for layer in layers)
        self.shift_positions(-unused)
        self.trim()

    def trim(self) -> None:
        """Return the memory of every empty slot now (:meth:`AlisaLayer.trim`): after a
        prefill's eviction, the capacity follows what the rows keep, not their prompts."""
        for layer in self._started():
            layer.trim()

    def take_rows(self, indices: torch.Tensor) -> AlisaCache:
        """Move the sequences ``indices`` out into a cache of their own; this one keeps the
        others, in order. :meth:`extend` takes them back (continuous batching pauses rows so).

        The new cache starts as this one's structure sharing every tensor; each part then
        selects its rows into new tensors (selection never writes into the tensors it reads),
        so neither cache sees the other's later steps. Both give back what their rows no
        longer need (:meth:`keep_rows`).

        Raises
        ------
        ValueError
            ``indices`` empty or holding every sequence, or device tiers (``gpu_memory``).
        """
        batch = self.batch_rows
        chosen = set(indices.tolist())
        if not chosen or len(chosen) >= batch or not chosen <= set(range(batch)):
            raise ValueError(
                f"take_rows(indices={indices.tolist()}) must name some, not all, of the "
                f"{batch} sequences"
            )
        if self.planner is not None:
            raise ValueError(
                f"gpu_memory={self.config.gpu_memory!r}: tiered caches cannot split their rows "
                "(their tier sizes are planned per batch)"
            )
        taken = copy_replacing(self, lambda tensor: tensor)
        taken.keep_rows(indices)
        rest = [row for row in range(batch) if row not in chosen]
        self.keep_rows(upload(rest, indices.device, torch.long))
        return taken

    def shift_positions(self, delta: int) -> None:
        """Move every sequence ``delta`` positions in the padded coordinates (see
        :meth:`AlisaLayer.shift_positions`)."""
        for layer in self.layers:
            layer.shift_positions(delta)

    def _started(self) -> list[AlisaLayer]:
        return [layer for layer in self.layers if layer.store is not None]

    def _check_host_budget(self, keys) -> None:
        """Refuse, before anything is stored, a prefill of (B, H_kv, n, D) ``keys`` whose host
        memory would outgrow ``host_memory`` by the end of ``max_new_tokens``: a budget is a
        limit, never exceeded silently (the tier planner checks its own host tier)."""
        if self.config.host_memory is None or self.planner is not None:
            return
        budget = self.config.host_memory_bytes
        tokens = keys.shape[2] + self.max_new_tokens
        need = sum(layer.keeper.host_bytes(keys, tokens) for layer in self.layers)
        if need > budget:
            raise ValueError(
                f"host_memory={self.config.host_memory!r} (--host-memory, {budget} bytes) cannot "
                f"hold the host region of retention='host': {keys.shape[0]} sequence(s) of "
                f"{keys.shape[2]} prompt tokens + max_new_tokens={self.max_new_tokens} need up to "
                f"{need} bytes at host_bits={self.config.host_bits}; raise host_memory, lower "
                "host_bits or generate fewer tokens"
            )


class PackedCache(Cache):
    """``past_key_values`` of one mixed forward: ``running``'s rows decode one step while
    ``newcomer`` (one sequence, empty) is prefilled. Both caches hold their own results after
    the forward; this object is then dropped (:mod:`alisa.kv.packed`,
    https://arxiv.org/abs/2403.02310).

    Parameters
    ----------
    running
        The running rows' cache (prefilled).
    newcomer
        An empty cache of the same config for one newcomer.
    rows
        B, the running rows: the packed forward's first B columns are their tokens.

    Raises
    ------
    ValueError
        ``newcomer`` already prefilled, ``running`` not yet, or caches of different configs.
    """

    def __init__(self, running: AlisaCache, newcomer: AlisaCache, rows: int) -> None:
        if running.config != newcomer.config or len(running.layers) != len(newcomer.layers):
            raise ValueError("caches of different configs or models cannot share a forward")
        if newcomer.get_seq_length() != 0 or running.get_seq_length() == 0:
            raise ValueError(
                "a mixed forward decodes a prefilled cache's rows and prefills an empty cache"
            )
        # The forward's hook sees this packed cache, not its two: each is claimed here, for
        # the running rows' model.
        newcomer.claim(running._built_for())
        running.claim(running._built_for())
        self.running, self.newcomer, self.rows = running, newcomer, rows
        pairs = zip(running.layers, newcomer.layers, strict=True)
        super().__init__(layers=[PackedLayer(mine, theirs, rows) for mine, theirs in pairs])

    def update(self, key_states, value_states, layer_idx: int, *args, **kwargs):
        """Each cache stores its columns through its own ``update`` (its checks included)."""
        running, prompt = split_kv(key_states, value_states, self.rows)
        self.running.update(*running, layer_idx)
        self.newcomer.update(*prompt, layer_idx)
        return key_states, value_states


def _model_name(model: nn.Module | None) -> str:
    """``LlamaForCausalLM from '/models/x' at 0x7f...``: a model told apart from its twins."""
    if model is None:
        return "a model that no longer exists"
    path = getattr(getattr(model, "config", None), "_name_or_path", "")
    origin = f" from {path!r}" if path else ""
    return f"{type(model).__name__}{origin} at {id(model):#x}"


def _check_static(
    config: AlisaConfig, max_cache_len: int | None, context: tuple[int, str] | None
) -> int | None:
    """``max_cache_len`` as an int, refused (naming the setting) where the mode has no static
    step yet: device/host/recompute tiers (their regions move per step), and host retention
    over device codes of another format than its host region's (its static fetch copies
    them). Keepers refuse for their own modes too (:meth:`~alisa.kv.layer.Keeper.
    static_slots`: host retention's INT4 host region), and the cache host retention on
    CUDA."""
    if max_cache_len is None:
        return None
    check_int("max_cache_len", max_cache_len, minimum=1)
    if context is not None and max_cache_len > context[0]:
        # Slots are allocated for it: past the context they hold nothing a model could read.
        raise ValueError(
            f"max_cache_len={max_cache_len} is longer than the model's context of {context[0]} "
            f"tokens ({context[1]}); at most {context[0]}"
        )
    why = None
    if config.gpu_memory is not None:  # issue 65 lets the tiered pool stay eager, saying why
        why = (
            f"gpu_memory={config.gpu_memory!r} has no static (compiled) decode step: its KV "
            "moves between the device, host and recompute tiers as the planner schedules"
        )
    elif (
        config.retention == "host"
        and config.kv_bits != 16
        and not (config.kv_bits == 8 and config.quant_group_size is None and config.host_bits == 8)
    ):  # the static fetch copies the host region's codes as they are: one format on both sides
        why = (
            f"kv_bits={config.kv_bits} with retention='host', host_bits={config.host_bits} and "
            f"quant_group_size={config.quant_group_size!r} has no static (compiled) decode step "
            "yet (kv_bits=8 over host_bits=8, one scale a row, has)"
        )
    if why is not None:
        raise ValueError(
            f"{why}: run it eager (compile='off' or 'auto'; a cache built without max_cache_len)"
        )
    return int(max_cache_len)


def static_rows_refusal(config: AlisaConfig) -> str | None:
    """Why rows cannot join or leave a static cache of ``config`` (so continuous batching runs
    its growing cache, eager), or None where they can."""
    if config.retention == "host":
        return (
            "retention='host' keeps its static step's tokens not coded yet in a ring of its "
            "host region, which rows joining or leaving do not carry yet"
        )
    return None


def _check_static_host(config: AlisaConfig, device: str, dtype: torch.dtype) -> None:
    """Refuse a static host-retention cache where its step is not static yet: on CUDA (its host
    region is page-locked host memory the device reads by a kernel of its own,
    :mod:`alisa.ops.cuda`, which a captured graph cannot take yet), or with an INT8 host region
    under a model that is not float32 (its rows are decoded as the eager region's only there)."""
    if device != "cpu":
        why = f"on {device} yet (a CPU has)"
    elif config.host_bits == 8 and dtype != torch.float32:
        why = f"with host_bits=8 for a {str(dtype).removeprefix('torch.')} model (float32 has)"
    else:
        return
    raise ValueError(
        f"retention='host' has no static (compiled) decode step {why}: run it eager "
        "(compile='off' or 'auto'; a cache built without max_cache_len)"
    )


def _holds_host(layers: list[AlisaLayer]) -> bool:
    """Whether any of ``layers`` keeps a host region (host retention's keeper)."""
    return any(isinstance(layer.keeper, HostKeeper) for layer in layers)


def _check_host_memory_applies(config: AlisaConfig) -> None:
    """A ``host_memory`` that nothing would put KV under is refused rather than ignored."""
    if config.host_memory is None or config.gpu_memory is not None or config.retention == "host":
        return
    raise ValueError(
        f"host_memory={config.host_memory!r} (--host-memory) has no effect: KV goes to host "
        "memory only with gpu_memory (the host tier) or retention='host'; set one of them or "
        "leave host_memory unset"
    )


def default_keeper(config: AlisaConfig, policy: KVPolicy, *, ops: Ops | None = None) -> Keeper:
    """Host retention when ``retention="host"`` and the policy can leave tokens out, else
    dropping (which never drops under a budget that covers every token). ``ops``: the kernels
    the keeper runs (:func:`alisa.ops.backends.choose_ops`; None: the device's default)."""
    if config.retention == "host" and policy.can_evict():
        return HostKeeper(
            policy,
            config.host_bits,
            config.host_history_share,
            config.host_reselect_every,
            estimate_rest=config.host_estimate_rest,
            ops=ops,
        )
    return DropKeeper(policy, per_head=config.selects_per_head, ops=ops)


def store_factory(
    config: AlisaConfig,
    shape: ModelShape,
    *,
    compiled: bool,
    operators: bool = False,
    context: int | None = None,
    static: bool = False,
    branch: bool = False,
) -> StoreFactory:
    """Dense storage for ``kv_bits=16``, else INT8/INT4 storage checked against the head size;
    ``compiled``: the stores run the compiled CPU kernels, ``operators``: a static step's
    attention runs them as operators (:class:`~alisa.ops.backends.Ops`; INT8/INT4 storage's
    static step reads its codes decoded by PyTorch's operators), ``static``: the stores of a
    static cache (INT8/INT4 codes with fixed-shape writes, :class:`StaticPair`), ``branch``:
    their step decodes the codes in one dtype picked by a branch (:attr:`Ops.branches`).
    The full-precision ring holds ``residual_tokens`` but never more than the model's
    ``context`` (None: unknown): no sequence has more tokens to keep there."""
    if config.kv_bits == 16:
        return partial(DenseStore, compiled=compiled, operators=operators)
    group = config.quant_group_size or shape.head_dim
    if shape.head_dim % group:
        raise ValueError(
            f"quant_group_size={config.quant_group_size!r} must divide the model's head size "
            f"({shape.head_dim})"
        )
    try:
        check_options(config.kv_bits, group, shape.head_dim)
    except ValueError as error:  # an odd head size as the group (unset) at kv_bits=4
        raise ValueError(
            f"kv_bits={config.kv_bits} with quant_group_size={config.quant_group_size!r} "
            f"(unset: the model's head size, {shape.head_dim}): {error}"
        ) from None
    return partial(
        QuantizedStore,
        bits=config.kv_bits,
        group_size=group,
        residual_tokens=ring_tokens(config, context),
        compiled=compiled,
        static=static,
        branch=branch,
    )


def _planner(
    model, adapter: ModelAdapter, config: AlisaConfig, factory, max_new_tokens: int, *, pinned: bool
):
    recomputer = None
    if config.recompute != "never":
        try:
            recomputer = KVRecomputer(model, adapter=adapter)
        except ValueError:
            if config.recompute == "always":
                raise
    region = partial(factory, groups=1)
    return TierPlanner(
        model, adapter.shape, config, region, recomputer, max_new_tokens, pinned=pinned
    )
