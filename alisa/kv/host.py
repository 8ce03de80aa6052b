"""``retention="host"``: nothing is lost; each decode step attends to the best tokens per KV head.

ALISA's phase II keeps the KV of tokens that are not cached on the device in host memory and
brings the selected ones back each step (https://arxiv.org/abs/2403.17312, §IV; Quest, InfiniGen
and ShadowKV select per head from a complete store the same way). Here every token of a layer is
written once to the host region (:class:`~alisa.storage.pages.HostPages`) and its strongest key
channels are kept in a sketch on the device (:class:`~alisa.kv.ranking.KeySketch`). Before
attention, per sequence and KV head:

1. the budget is the policy's (``round(n*r)``, at least ``min_budget_tokens``, sinks covered);
2. the policy's protections (sinks, its recent window, the new token) are always chosen; with a
   ``history_share``, that share of the rest goes to the tokens with the most attention summed
   over the policy's score window (ALISA's "globally dynamic" tokens; a token earns attention
   only while chosen); the rest of the budget goes to the highest ``q . k_hat`` (max over the
   KV head's query heads);
3. the device slots become exactly that set: slots whose token was not chosen are freed, chosen
   tokens the device does not hold are fetched from the host region (only those rows are read and
   dequantized) into freed slots.

Attention then runs exactly (one softmax) over the device slots. Tokens written at this step stay
in full precision on the device until a selection first leaves them out, so with a budget that is
never reached nothing ever moves and the output is that of dense attention. New tokens are coded
into the host region and the sketch a page (16 tokens) at a time: until then they are in the
recent window, which every selection keeps on the device.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import numpy as np
import torch

from alisa.kv.layer import Keeper
from alisa.kv.ranking import KeySketch, PositionHistory, Scoring
from alisa.kv.rest import RestColumn, ValueTotals, rest_logit
from alisa.kv.slots import SlotMap
from alisa.kv.static import StepPack
from alisa.ops import library
from alisa.ops.backends import Ops, choose_ops
from alisa.ops.reference import (
    ChoiceInputs,
    SelectionStep,
    StaticChoice,
    place,
    select_rule_static,
)
from alisa.ops.transfer import upload
from alisa.policies import KVPolicy, StepShares
from alisa.storage.pages import PAGE_TOKENS, HostPages, host_region_bytes
from alisa.storage.store import KVStore

# A static step's numbers per sequence (HostKeeper.reserve): the budget, the recent window, the
# history's picks, the first real position, the history's fade factor and scale, and the range
# of positions the host region codes at this step (its start and count).
STATIC_FIELDS = 8


class HostStep(NamedTuple):
    """A host-retention step's numbers for the current lengths: the same in every layer that
    runs an equal policy with the same history share, so computed once a step
    (:meth:`alisa.policies.BudgetBook.derived`). Arrays are (B,) int64, read, never written.

    Attributes
    ----------
    budget
        Tokens each sequence attends to per KV head.
    most
        The largest budget.
    covers
        Every budget covers every token its sequence has seen: nothing has left the device.
    recent
        Newest tokens protected (at least the new token).
    nearest
        The fewest protected: positions from ``seen - nearest`` on are never ranked.
    shares
        The history's picks at most (ALISA's "globally dynamic" tokens).
    """

    budget: np.ndarray
    most: int
    covers: bool
    recent: np.ndarray
    nearest: int
    shares: np.ndarray


class HostKeeper(Keeper):
    """The host region, the key sketch and the per-step selection of one layer.

    Parameters
    ----------
    policy
        Budget and protections (sinks, recent window); its attention history ranks part of the
        budget with a ``history_share``.
    host_bits
        Precision of the host region: 16 (model dtype), 8 or 4.
    history_share
        Share of the budget left after the protections that goes to the tokens with the most
        attention received (the policy's own signal, ALISA's "globally dynamic" tokens), ahead
        of the key sketch's estimate; 0 ranks by the sketch alone.
    reselect_every
        Decode steps per selection: in between, the device keeps the last chosen set and the
        new tokens join it (they are the newest, which every selection keeps anyway), so the
        scoring, ranking and fetching of a step is paid once per ``reselect_every`` steps. What
        changes between steps is what the current query needs: every 4 steps cost +15-20 %
        perplexity on WikiText-2 (docs/host-speed.md), so the default is 1.
    estimate_rest
        Give attention one more softmax column for the tokens a step leaves on the host: their
        mass estimated from the key sketch, their output by the mean value
        (:mod:`alisa.kv.rest`). False: the softmax is renormalised over the chosen tokens.
    ops
        The kernels that run the step (:func:`alisa.ops.backends.choose_ops`: the compiled CPU
        kernels, Triton's on CUDA, or the PyTorch reference); None: the device's default,
        chosen at the first write. A test forces a path by passing the ops it tests.
    """

    def __init__(
        self,
        policy: KVPolicy,
        host_bits: int,
        history_share: float = 0.0,
        reselect_every: int = 1,
        estimate_rest: bool = False,
        ops: Ops | None = None,
    ) -> None:
        super().__init__(policy, per_head=True)
        self.ops_option = ops
        self.host_bits = host_bits
        self.sinks = policy.sink_tokens
        self.history_share = history_share
        self.reselect_every = reselect_every
        self.estimate_rest = estimate_rest
        # A static cache's longest context and the budget there (static_slots), and where this
        # keeper's fields sit in its step pack.
        self.static_width = 0
        self.static_most = 0
        self._fields = 0
        self.reset()

    def reset(self) -> None:
        super().reset()
        self.pages: HostPages | None = None
        self.sketch: KeySketch | None = None
        # The prompt, written to the host region once the prefill attention marked its padding.
        self.prompt: tuple[torch.Tensor, torch.Tensor] | None = None
        # New tokens wait here, (keys, values) per write, until a page's worth has come: one
        # quantization per page instead of per step (its small ops dominate a step at batch 1).
        # They are all in the recent window, so always on the device (see :meth:`select`).
        self.pending: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.flushed = 0  # positions [0, flushed) are in the host region and the sketch
        # Attention each position received while chosen, over the policy's score window.
        self.history: PositionHistory | None = None
        # Values of every position coded, summed: the output of the tokens a step leaves out.
        self.values: ValueTotals | None = None
        # With estimate_rest, the query this step's selection ranked with and its (B, H_kv, G,
        # C) sketch logits: the rest's estimate for that query reads them, then lets them go.
        self.step_logits: tuple[torch.Tensor, torch.Tensor] | None = None
        self.ops: Ops | None = None  # chosen at the first write, when the device is known
        self.steps = 0  # decode steps that selected (budget below the tokens seen)
        self.unselected = 0  # decode steps since the last selection

    # ---- the keeper's hooks -----------------------------------------------------------------

    def start(self, slots: SlotMap, keys: torch.Tensor, values: torch.Tensor) -> None:
        self.prompt = (keys, values)  # to the host region once its padding is known

    def on_write(
        self, start: int, keys: torch.Tensor, values: torch.Tensor, slots: SlotMap
    ) -> None:
        self.write(start, keys, values, slots)

    def before_attention(
        self,
        slots: SlotMap,
        store: KVStore,
        query: torch.Tensor,
        reserve: Callable[[int], None],
    ) -> None:
        """Make the device slots this step's chosen tokens (fetching what the device lacks),
        once every ``reselect_every`` steps; the steps between attend to the last choice and
        the tokens written since."""
        if self.pack is not None:  # a static step: the host planned it (plan_step)
            self._select_static(slots, store, query)
            return
        self.unselected += 1
        if self.unselected < self.reselect_every:
            return
        step = self.step(slots)
        reserve(step.most + int(slots.dead.max(initial=0)) + 1)
        self.select(slots, store, query, step)

    def after_attention(
        self,
        slots: SlotMap,
        store: KVStore,
        query: torch.Tensor,
        probabilities: torch.Tensor | None,
        *,
        prefilling: bool,
    ) -> None:
        """After the prefill: the prompt goes to the host region and the device keeps only what
        the last prompt query chooses, so no layer holds the whole prompt past its prefill.
        After a decode step: the attention the held tokens received joins their history."""
        if prefilling:
            if self.prompt is not None:
                self.write(0, *self.prompt, slots)
                self.prompt = None
                # The sketch's channels are chosen from the prompt, whatever its length: a
                # static step, which writes every token as it comes, chooses them so too.
                self._flush(slots)
            self.select(slots, store, query[:, :, -1:], self.step(slots))
        elif self.pack is not None:
            if self.history is not None:
                probabilities = probabilities[:, :, :, 0, : slots.capacity]
                factor, scale = (self._field(4).float(), self._field(5).float())
                self.history.add_static(probabilities, slots.positions, factor, scale)
        elif probabilities is not None:
            window = self.steps_scored(slots)
            self.account_history(probabilities[:, :, :, 0, : slots.capacity], slots, window)

    # ---- writes --------------------------------------------------------------------------

    def write(self, start: int, keys: torch.Tensor, values: torch.Tensor, slots: SlotMap) -> None:
        """Keep (B, H_kv, m, D) new tokens at positions [start, start + m) in both regions.

        Writes arrive in position order; they are coded a page at a time (``PAGE_TOKENS``), or
        sooner when a selection could leave them out (:meth:`select`). Sinks and padding (known
        from ``slots``) are written but do not shape the sketch's choice of channels.
        """
        batch, heads, length, head_dim = keys.shape
        if self.pages is None:
            self.ops = self.ops_option or choose_ops(keys.device, keys.dtype)
            self.ops.check_device(keys.device)
            self.pages = HostPages(
                batch,
                heads,
                head_dim,
                bits=self.host_bits,
                dtype=keys.dtype,
                device=keys.device,
                pinned=self.ops.pinned,
                compiled=self.ops.compiled,
            )
            self.sketch = KeySketch(
                batch,
                heads,
                head_dim,
                start + length,
                keys.device,
                key_dtype=keys.dtype,
                product=self.ops.product,
            )
            if self.estimate_rest:
                self.values = ValueTotals(batch, heads, head_dim, keys.device)
        self.pending.append((keys, values))
        if self._page_due(start + length):
            self._flush(slots)

    def _page_due(self, seen: int) -> bool:
        """Whether the pending tokens of positions [flushed, ``seen``) fill a page."""
        return seen - self.flushed >= PAGE_TOKENS

    def _left_out(self, seen: int, step: HostStep) -> bool:
        """Whether this step's selection could leave out a pending (not yet coded) token: the
        ranked span, which ends where the shortest recent window starts, reaches past it."""
        return self.flushed < seen - step.nearest

    def _flush(self, slots: SlotMap) -> None:
        """Code the pending tokens into the host region and the key sketch."""
        if not self.pending:
            return
        if len(self.pending) == 1:
            keys, values = self.pending[0]
        else:
            keys = torch.cat([k for k, _ in self.pending], dim=2)
            values = torch.cat([v for _, v in self.pending], dim=2)
        self.pending = []
        start, length = self.flushed, keys.shape[2]
        self.pages.write(start, keys, values)
        positions = torch.arange(start, start + length, device=keys.device)
        if self.values is not None:
            self.values.add(values, self._real(positions, slots))
        counted = None
        if self.sketch.choosing:
            counted = self._counted(positions, slots)
        self.sketch.write(start, keys, counted)
        self.flushed = start + length

    @staticmethod
    def _real(positions: torch.Tensor, slots: SlotMap, skip: int = 0) -> torch.Tensor:
        """(B, m) whether each of ``positions`` (m,) is a real token of its sequence (not
        left padding), past its first ``skip`` real ones."""
        first = upload(slots.first, positions.device).view(-1, 1)
        return positions.view(1, -1) >= first + skip

    def _counted(self, positions: torch.Tensor, slots: SlotMap) -> torch.Tensor:
        """(B, m) whether each position is a real, non-sink token (may shape the sketch); a
        sequence with only sinks so far (a short prompt padded in a batch) counts its sinks."""
        counted = self._real(positions, slots, self.sinks)
        return torch.where(counted.any(-1, keepdim=True), counted, self._real(positions, slots))

    # ---- the step -------------------------------------------------------------------------

    def step(self, slots: SlotMap) -> HostStep:
        """This step's :class:`HostStep`, from the book the cache's layers share."""
        lengths = slots.lengths()
        name = ("host", self.history_share)  # what _host_step reads besides the policy's shares

        def make(shares: StepShares) -> HostStep:
            return self._host_step(shares, lengths)

        return self.budgets.derived(self.policy, lengths, name, make)

    def _host_step(self, shares: StepShares, lengths: np.ndarray) -> HostStep:
        # A writable copy: the compiled kernels read it, and numba compiles another version of
        # each kernel for a read-only array (the book's are read-only).
        budget = shares.budget.copy()
        recent = np.maximum(shares.recent, 1)  # the new token is always attended
        spare = np.maximum(budget - recent - self.policy.sink_tokens, 0)
        return HostStep(
            budget=budget,
            most=int(budget.max()),
            covers=bool((budget >= lengths).all()),
            recent=recent,
            nearest=int(recent.min()),
            shares=np.rint(spare * self.history_share).astype(np.int64),
        )

    def select(self, slots: SlotMap, store: KVStore, query: torch.Tensor, step: HostStep) -> None:
        """Make each (sequence, KV head)'s device slots exactly this step's chosen tokens.

        Parameters
        ----------
        slots
            The layer's slot map (groups = KV heads); the new token is already placed.
        store
            The device region; the backend writes fetched rows into its plain buffers, or
            leaves them to ``write_heads``.
        query
            (B, H, 1, D) this step's query.
        step
            This step's budgets (:meth:`step`; the slots are sized for them).

        The step's tensors go to the kernels chosen for the cache (:attr:`Ops.select`,
        :mod:`alisa.ops.reference` defines what it does); the keeper settles what it owns.
        """
        self.unselected = 0
        if step.covers:  # budgets only fall behind n: nothing has left yet
            return
        if self._left_out(slots.seen, step):
            self._flush(slots)
        # Every position from here on is in each sequence's recent window: chosen, never ranked.
        ranked_end = slots.seen - step.nearest
        scoring = self._scoring(slots, query, ranked_end)
        inputs = self._choice_inputs(slots, step, scoring.logits)
        host = self.pages.region(protected=ranked_end)
        chosen = self.ops.select(SelectionStep(inputs, scoring.operands, host, store.plain_heads()))
        slots.settle(step.budget)
        if chosen.incoming is not None:  # rows the backend left for the store to write
            rows, groups, targets, _, *on_host = chosen.incoming
            fetched = self.pages.fetch(*on_host, parts=self.ops.parts)
            store.write_heads(rows, groups, targets, fetched)
        self.count_fetched(chosen.count)
        self.steps += 1

    def _scoring(self, slots: SlotMap, query: torch.Tensor, ranked_end: int) -> Scoring:
        """This step's key-sketch logits of (B, H, q, D) ``query``'s last token, or, where the
        selection runs as one compiled call (:attr:`Ops.fused`), the product's operands left
        for that call. The choice ranks positions below ``ranked_end`` only; the rest's
        estimate reads every position (and keeps the logits for this step's attention)."""
        batch, kv_heads = slots.positions.shape[:2]
        grouped = query[:, :, -1].reshape(batch, kv_heads, -1, query.shape[-1])
        if self.values is not None and query.shape[2] == 1:  # the rest's estimate reads them
            scoring = self.sketch.prepared(grouped, None, defer=False)
            self.step_logits = (query, scoring.logits)
            return scoring
        defer = self.ops.fused and self.values is None
        return self.sketch.prepared(grouped, ranked_end, defer=defer)

    def _choice_inputs(self, slots: SlotMap, step: HostStep, logits: torch.Tensor) -> ChoiceInputs:
        """What this step's choice reads (:func:`alisa.ops.reference.select_rule`): protected
        tokens, the history's share, then the best of this step's (B, H_kv, G, C) sketch
        ``logits``.

        ``step.recent`` newest tokens per sequence are protected; they include every pending
        (not yet coded) token, whose logit is never read.
        """
        history = None
        shares = step.shares
        if self.history is not None and self.history_share > 0:
            history = self.history.ranked(slots.seen)
        else:
            shares = np.zeros_like(shares)
        return ChoiceInputs(
            logits=logits,
            history=history,
            shares=shares,
            positions=slots.positions,
            first=slots.first,
            budget=step.budget,
            recent=step.recent,
            sinks=self.policy.sink_tokens,
            seen=slots.seen,
        )

    def rest(
        self, slots: SlotMap, query: torch.Tensor, scaling: float, softcap: float | None
    ) -> RestColumn | None:
        """The tokens this step leaves on the host as one softmax column (:mod:`alisa.kv.rest`):
        from the first selection on (before it, every token is on the device and attention is
        exactly dense). The mass is estimated from the sketch logits of this step's query (the
        choice's own, when this step chose), the output by the mean value of every token coded.
        """
        if self.values is None or self.steps == 0:
            return None
        batch, heads, queries, head_dim = query.shape
        kv_heads = slots.positions.shape[1]
        if self.step_logits is not None and self.step_logits[0] is query:  # this step chose
            logits = self.step_logits[1]
            self.step_logits = None  # held for this step only
        else:  # a step between selections (or a query the choice did not rank with)
            rows = query.reshape(batch, kv_heads, heads // kv_heads * queries, head_dim)
            logits = self.sketch.logits(rows)
        first = upload(slots.first, query.device)
        logit = rest_logit(
            logits,
            slots.positions,
            first,
            self.flushed,
            scaling,
            softcap,
            padded=bool(slots.first.any()),
        )
        return RestColumn(logit=logit.view(batch, kv_heads, -1, queries), value=self.values.mean())

    def account_history(
        self, probabilities: torch.Tensor, slots: SlotMap, window: np.ndarray | None
    ) -> None:
        """Add a decode step's attention (B, H_kv, G, S) over the device slots to the history
        of the tokens they hold (only with a ``history_share``); ``window`` (B,) is the
        policy's score window, None: every step counts alike."""
        if self.history_share == 0 or self.pages is None:
            return
        if self.history is None:
            self.history = self._new_history(slots.seen, decayed=window is not None)
        self.history.add(
            probabilities,
            slots.positions,
            window,
            slots.seen,
            compiled=self.ops.compiled,
            parts=self.ops.parts,
        )

    def _new_history(self, width: int, *, decayed: bool) -> PositionHistory:
        """An empty attention history of ``width`` positions, shaped like the host region."""
        batch, heads = self.sketch.keys.shape[:2]
        return PositionHistory(
            batch,
            heads,
            width,
            self.sketch.keys.device,
            decayed=decayed,
            head_max=self.policy.head_max,  # the policy's combine_heads at decode steps
        )

    # ---- a static step (:mod:`alisa.kv.static`) -----------------------------------------

    def static_slots(self, max_len: int) -> int:
        """The budget at ``max_len`` tokens and the new token: budgets never shrink as a
        sequence grows, so a step holds at most its last choice and its token.

        Raises
        ------
        ValueError
            A host region coded to fewer bits (its scales' dtype follows the data), the
            rest's estimate or a selection every few steps: no static step yet.
        """
        unstatic = {
            "host_bits": self.host_bits == 4,
            "estimate_rest": self.estimate_rest,
            "reselect_every": self.reselect_every != 1,
        }
        for name, refused in unstatic.items():
            if refused:
                raise ValueError(
                    f"retention='host' with {name}={getattr(self, name)!r} has no static "
                    "(compiled) decode step yet (host_bits=8 and 16 have): run it eager "
                    "(compile='off' or 'auto'; a cache built without max_cache_len)"
                )
        self.static_most = int(self.policy.budget(np.array([max_len], dtype=np.int64))[0])
        self.static_width = max_len
        return min(self.static_most + 1, max_len)

    def reserve(self, pack: StepPack, batch: int) -> None:
        """Fields (B,) each (:data:`STATIC_FIELDS`); the host region, the sketch and the
        attention history allocated for every position a step may reach, and a device count
        of the tokens fetched, so that a step writes them in place."""
        super().reserve(pack, batch)
        self._fields = pack.reserve(STATIC_FIELDS, batch)
        self.pages.make_static(self.static_width)
        self.sketch.grow(self.static_width)
        if self.history_share > 0:
            if self.history is None:
                decayed = self.policy.steps_scored(np.ones(1, dtype=np.int64)) is not None
                self.history = self._new_history(self.static_width, decayed=decayed)
            self.history.reserve(self.static_width)
        if self._fetched_on_device is None:
            self._fetched_on_device = torch.zeros((), dtype=torch.int64, device=self.pack.device)

    def static_buffers(self) -> tuple[torch.Tensor, ...]:
        history = () if self.history is None else self.history.static_buffers()
        return (
            *self.pages.static_buffers(),
            *self.sketch.static_buffers(),
            *history,
            self._fetched_on_device,
        )

    def plan_step(self, slots: SlotMap) -> None:
        """The eager step's numbers, from the same shares: what :meth:`select` and
        :meth:`account_history` compute on the host."""
        step = self.step(slots)
        block = self.pack.host(self._fields, STATIC_FIELDS, self.pack.rows)
        block[0], block[1], block[3] = step.budget, step.recent, slots.first
        block[2] = step.shares if self.history is not None else 0
        if self.history is not None:
            factor = self.history.fade(self.steps_scored(slots))
            block[4] = 1.0 if factor is None else factor
            block[5] = self.history.scale.astype(np.float32)
        # The range the eager step codes into the host region now: the pending tokens, once a
        # page of them came (write) or a selection could leave one out (select).
        coded = self._page_due(slots.seen) or (not step.covers and self._left_out(slots.seen, step))
        block[6], block[7] = self.flushed, slots.seen - self.flushed if coded else 0
        if coded:
            self.flushed = slots.seen
        if not step.covers:
            slots.settle(step.budget)
            self.steps += 1

    def write_static(self, position: torch.Tensor, keys: torch.Tensor, values: torch.Tensor):
        """The sketch takes the token at once, the host region as the eager step codes it (a
        16-bit one at once: the same bytes, as every row is stored alone)."""
        start, count = (self._field(i)[:1].to(torch.int64) for i in (6, 7))
        self.pages.write_static(position, keys, values, start, count)
        self.sketch.write_at(position, keys)

    def _field(self, index: int) -> torch.Tensor:
        return self.pack.field(self._fields, self.pack.rows, index)

    def _select_static(self, slots: SlotMap, store: KVStore, query: torch.Tensor) -> None:
        """:meth:`select` with one shape and every number read from the device: the eager
        step's compiled choice, swap and fetch as one operator where the cache runs the CPU's
        kernels as operators (:attr:`Ops.operators`), else PyTorch's: choose by
        :func:`~alisa.ops.reference.select_rule_static`, place, fetch the rows the device
        lacks into their slots."""
        batch, kv_heads = slots.positions.shape[:2]
        grouped = query[:, :, -1].reshape(batch, kv_heads, -1, query.shape[-1])
        budget, recent, shares, first = (self._field(i).to(torch.int64) for i in range(4))
        logits = self.sketch.logits(grouped)
        position = self.pack.position()  # the step's token, held through the step
        seen = position + 1
        plain = store.plain_heads()
        if self.ops.operators and plain is not None:  # the eager step's choice and swap
            keys, values = plain
            history = (
                self.history.total
                if self.history is not None
                else logits.new_zeros(batch, kv_heads, 0, dtype=torch.float32)
            )
            count = library.choose_and_fetch(
                logits,
                history,
                shares,
                slots.positions,
                first,
                budget,
                recent,
                self.policy.sink_tokens,
                seen,
                list(self.pages.tensors()),
                keys,
                values,
            )
            self._fetched_on_device.add_(count)
            return
        inputs = StaticChoice(
            logits=logits,
            history=None if self.history is None else self.history.total,
            shares=shares,
            positions=slots.positions,
            first=first,
            budget=budget,
            recent=recent,
            sinks=self.policy.sink_tokens,
            seen=seen,
            width=self.static_width,
            most=self.static_most,
        )
        chosen, taken = select_rule_static(inputs)
        placement = place(slots.positions, chosen, taken, self.static_width)
        anchor = slots.holding(position)
        store.fetch_static(self.pages.tensors(), self.pages.level, placement, anchor)
        self._fetched_on_device.add_(placement.fetch.sum())

    # ---- bookkeeping ----------------------------------------------------------------------

    def host_bytes(self, keys: torch.Tensor, tokens: int) -> int:
        """The host region's most bytes for ``tokens`` positions: every token is kept."""
        batch, heads, _, head_dim = keys.shape
        return host_region_bytes(
            batch, heads, head_dim, tokens, bits=self.host_bits, element_bytes=keys.dtype.itemsize
        )

    def tier_bytes(self) -> dict[str, int]:
        """Bytes per tier: the sketch counts on the device, the pages on the host."""
        if self.pages is None:
            return {"device": 0, "host": 0}
        waiting = sum(k.nbytes + v.nbytes for k, v in self.pending)
        return {"device": self.sketch.nbytes() + waiting, "host": self.pages.nbytes()}

    def state_bytes(self) -> int:
        """Bytes of bookkeeping on the device: the attention history and the value sums."""
        history = 0 if self.history is None else self.history.nbytes()
        return history + (0 if self.values is None else self.values.nbytes())

    def shift_positions(self, delta: int, slots: SlotMap) -> None:
        """Move the host region, the sketch and the history with the tokens (``delta < 0``:
        positions below ``-delta`` hold no sequence's token and are dropped)."""
        if self.pages is None:
            return
        if self.flushed < -delta:  # pending tokens would land below position 0
            self._flush(slots)
        self.pages.shift(delta)
        self.sketch.shift(delta)
        if self.history is not None:
            self.history.shift_columns(delta)
        self.flushed += delta

    def extend_rows(self, other: Keeper, slots: SlotMap, other_slots: SlotMap) -> None:
        """Append ``other``'s sequences (same ``seen``): both write their pending tokens, then
        the host regions, sketches and histories concatenate.

        Writing early changes nothing a selection sees (pending tokens are in the recent
        window), except the sketch's channels when a batch has not chosen them yet: a prompt
        under ``PAGE_TOKENS`` tokens chooses them from the prompt alone rather than from its
        first page.
        """
        super().extend_rows(other, slots, other_slots)
        self._flush(slots)
        other._flush(other_slots)
        self.pages.extend_rows(other.pages)
        self.sketch.extend_rows(other.sketch)
        if self.values is not None:
            self.values.extend_rows(other.values)
        if self.history is not None or other.history is not None:
            mine = self.history or other.history.empty_like(len(slots.first))
            theirs = other.history or self.history.empty_like(len(other_slots.first))
            mine.extend_rows(theirs)
            self.history = mine
        self.steps = max(self.steps, other.steps)

    def select_batch(self, indices: torch.Tensor) -> None:
        if self.history is not None:
            self.history.select_batch(indices)
        self.pending = [
            (k.index_select(0, indices), v.index_select(0, indices)) for k, v in self.pending
        ]
        if self.pages is not None:
            self.pages.select_batch(indices)
            self.sketch.select_batch(indices)
        if self.values is not None:
            self.values.select_batch(indices)
