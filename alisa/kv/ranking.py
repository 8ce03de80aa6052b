"""What ranks the tokens host retention keeps on the host: a key sketch and attention sums.

Both are kept on the device for every token seen. :class:`KeySketch` estimates each token's
logit against the current query; :class:`PositionHistory` holds the attention each position
received while it was on the device. A decode step's choice reads both
(:class:`alisa.ops.reference.ChoiceInputs`).

**The key sketch**: a partial copy of every key on the device, to rank every stored token
against each query.

With ``retention="host"`` every token's K/V is kept in the host region and each decode step
attends to the ``round(n*r)`` tokens that the current query is expected to attend to most. The
ranking needs a cheap view of *all* keys on the device: the sketch keeps, per (sequence, KV head),
the half of the key channels that carry the most of ``q . k`` in bfloat16, and estimates a logit
as ``q[channels] . k[channels]`` (InfiniGen, OSDI'24, https://arxiv.org/abs/2406.19707, ranks
tokens with partial channels the same way; Quest's page bounds missed by far on SmolLM2, see
``docs/retention-selection-study.md``).

Channels are taken in RoPE pairs (channel ``i`` with ``i + D/2``, Hugging Face's
``rotate_half``): rotation by position moves a key's energy within a pair, never between pairs, so
a pair's mean norm is a position-free measure of how much of ``q . k`` it can carry. The pairs are
chosen once per (sequence, KV head) from the first keys written (the prompt, or the first page
when generating from one token), leaving sinks and padding out. Measured on SmolLM2-135M
(``docs/retention-selection-study.md``), half the channels in bfloat16 rank better than all of
them at 4 bits, in the same bytes, and score faster on a CPU: the product needs no conversion.
The sketch is kept channel-major, (B, H, width, capacity), and each score is one product over
the whole allocation (unwritten positions are zeros): a (G, width) x (width, capacity) product
per (sequence, KV head) is one strided batch with no copy, and a compiled CPU kernel reads a
width's positions contiguously (:mod:`alisa.ops.cpu`).

The sketch's element is half the model's, so it costs an eighth of the dense K + V bytes whatever
the model's dtype: bfloat16 for a float32 model; for a 16-bit model (Gemma-3 runs in bfloat16)
absmax INT8 codes with one float32 scale per (token, KV head) (:func:`quant.quantize_rows`),
scored by converting the codes to bfloat16 (exact: integers up to 127) and scaling each
position's product, with no offset term to cancel. In bfloat16 a 16-bit model's sketch was a
quarter of its dense KV: Gemma-3-270M's at 16K was 12 of host retention's 26.3 MiB on the device
(now 19.9 MiB in all, 0.36 of ``DynamicCache``'s). The conversion costs a CPU step a little:
SmolLM2-135M in bfloat16, B = 8 x 2,048, 150-153 ms against 126-138 ms (README, Gemma-3 section).

**The attention history**: attention each token position received while held on the device.

Host retention gives part of each step's budget to the held tokens with the most attention
summed over the policy's score window (ALISA's "globally dynamic" tokens,
https://arxiv.org/abs/2403.17312, Alg. 1). The sums are kept per token position, so they
survive a token leaving and returning, and faded by ``1 - 1/w`` per step (a soft window of w
steps, A2SF https://arxiv.org/abs/2407.20485) when the policy has a window.

The fade is lazy: instead of multiplying every position's sum each step (a pass over every
token seen, per layer and step), each sequence keeps a scale that grows by ``1 / (1 - 1/w)`` a
step and new attention is added multiplied by it, so the stored sum is the true one times the
scale. Within a sequence the order of the stored sums is the order of the true ones, which is
all a selection reads; the sums are brought back to scale 1 when the scale grows large.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch

from alisa.ops import cpu
from alisa.ops.backends import PRODUCTS, choose_ops
from alisa.ops.cpu import kernel_parts, sketch_logits
from alisa.ops.reference import combine_queries
from alisa.ops.transfer import upload
from alisa.storage.store import headroom
from quant import quantize_rows

SKETCH_DTYPE = torch.bfloat16  # what the scores are returned in (the choice ranks 16-bit keys)
# Share of the key channels kept: at half the element size, 1/8 of the dense key + value bytes
# per token and KV head. A quarter of them lost 2.3 % perplexity at r = 0.2, three eighths 0.9 %.
KEPT_FRACTION = 0.5


def code_dtype(key_dtype: torch.dtype) -> torch.dtype:
    """The sketch's element for keys of ``key_dtype``: half its size (bfloat16 for float32
    keys, INT8 codes for 16-bit ones), so the sketch is an eighth of the dense K + V bytes."""
    return SKETCH_DTYPE if key_dtype.itemsize >= 4 else torch.int8


class Scoring(NamedTuple):
    """A step's sketch product (:meth:`KeySketch.scoring`, :meth:`KeySketch.prepared`).

    Attributes
    ----------
    operands
        The arguments of :func:`alisa.ops.cpu.sketch_logits` but ``parts``: (R, G, D)
        float32 queries, (R, W) channels, (R, W, N) codes, (R, N) or (R, 0) scales and the (R,
        G, C) uint16 output, R = B * H, for a product still to run; None: it ran.
    logits
        (B, H, G, C) bfloat16: the output's values (a view), once the product ran.
    """

    operands: tuple[np.ndarray, ...] | None
    logits: torch.Tensor


class KeySketch:
    """The strongest RoPE channel pairs of every key of one layer, on the device.

    Parameters
    ----------
    batch, heads, head_dim
        Sequences, KV heads and channels.
    capacity
        Token positions allocated (grows as needed).
    device
        The model's device.
    key_dtype
        The keys' dtype: float32 keys are sketched in bfloat16, 16-bit ones in INT8 codes with a
        scale per (token, KV head) (:func:`code_dtype`).
    product
        How the scores are computed, one of :data:`PRODUCTS` (None: the default backend's on
        ``device``, :func:`~alisa.ops.backends.choose_ops`; ``"compiled"`` needs a CPU); they
        are returned in bfloat16 either way.
    """

    def __init__(
        self,
        batch: int,
        heads: int,
        head_dim: int,
        capacity: int,
        device: torch.device,
        key_dtype: torch.dtype = torch.float32,
        product: str | None = None,
    ) -> None:
        if head_dim < 2:
            raise ValueError(f"head_dim={head_dim} must be at least 2 (keys are sketched in pairs)")
        # An odd head_dim's last channel has no partner and is never kept.
        self.width = min(head_dim // 2 * 2, max(2, 2 * round(head_dim * KEPT_FRACTION / 2)))
        dtype = code_dtype(key_dtype)
        # Channel-major, (B, H, width, capacity): the score is (G, width) @ (width, capacity), one
        # product per (sequence, KV head) over the whole allocation (see :meth:`logits`).
        self.keys = torch.zeros(batch, heads, self.width, 0, dtype=dtype, device=device)
        # (B, H, capacity) float32 per-position scales of INT8 codes; None for bfloat16 keys.
        self.scales: torch.Tensor | None = None
        if dtype == torch.int8:
            self.scales = torch.zeros(batch, heads, 0, dtype=torch.float32, device=device)
        self.grow(capacity)  # with room to spare: the first page after a prompt needs no copy
        self.channels: torch.Tensor | None = None  # (B, H, width) long, fixed at the first write
        # The compiled product's numpy views of channels, codes and scales (see _views).
        self._arrays: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None
        self.product = choose_ops(device, key_dtype).product if product is None else product
        if self.product not in PRODUCTS:
            raise ValueError(f"product={self.product!r}: one of {', '.join(PRODUCTS)}")
        if self.product == "compiled" and torch.device(device).type != "cpu":
            raise ValueError(f"product='compiled' runs on a CPU; the sketch is on {device}")

    @property
    def capacity(self) -> int:
        return self.keys.shape[3]

    @property
    def choosing(self) -> bool:
        """Whether the next write chooses the channels (it needs to know which keys count)."""
        return self.channels is None

    @property
    def scores_compiled(self) -> bool:
        """Whether :meth:`scoring` applies: the compiled product, with the channels chosen."""
        return self.product == "compiled" and self.channels is not None

    def nbytes(self) -> int:
        channels = 0 if self.channels is None else self.channels.nbytes
        scales = 0 if self.scales is None else self.scales.nbytes
        return self.keys.nbytes + scales + channels

    def grow(self, capacity: int) -> None:
        """Room for ``capacity`` positions, plus the slots' headroom so growth copies amortise."""
        if capacity <= self.capacity:
            return
        self._pad_positions(0, capacity + headroom(capacity) - self.capacity)

    def _padded(self, left: int, right: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Codes and scales with zero positions (scoring 0) before and after the allocated ones."""
        keys = torch.nn.functional.pad(self.keys, (left, right))
        if self.scales is None:
            return keys, None
        return keys, torch.nn.functional.pad(self.scales, (left, right))

    def _pad_positions(self, left: int, right: int) -> None:
        self.keys, self.scales = self._padded(left, right)
        self._arrays = None

    def write(self, start: int, keys: torch.Tensor, counted: torch.Tensor | None) -> None:
        """Keep the sketched channels of keys (B, H, m, D) of positions [start, start + m).

        ``counted`` (B, m) bool says which keys may shape the channel choice (not sinks or
        padding); needed only while :attr:`choosing`.
        """
        if self.channels is None:
            if counted is None:
                raise ValueError("the first sketch write needs `counted` to choose channels")
            self.channels = self._choose(keys, counted)
            self._arrays = None
        self.grow(start + keys.shape[2])
        end = start + keys.shape[2]
        codes, scales = self._coded(keys)
        self.keys[..., start:end] = codes
        if scales is not None:
            self.scales[:, :, start:end] = scales

    def write_at(self, position: torch.Tensor, keys: torch.Tensor) -> None:
        """A static step's (B, H, 1, D) key at ``position`` ((1,) int64 on the device): one
        shape and no host read, the channels chosen and the position allocated before."""
        codes, scales = self._coded(keys)
        self.keys.index_copy_(3, position, codes)
        if scales is not None:
            self.scales.index_copy_(2, position, scales)

    def static_buffers(self) -> tuple[torch.Tensor, ...]:
        """The tensors a static step writes in place (their addresses kept from here on)."""
        return (self.keys,) if self.scales is None else (self.keys, self.scales)

    def _coded(self, keys: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The sketched channels of (B, H, m, D) keys as stored: (B, H, width, m) codes in
        the sketch's dtype, and (B, H, m) scales of INT8 codes (None for bfloat16 ones)."""
        index = self.channels.unsqueeze(2).expand(*keys.shape[:3], self.width)
        kept = keys.gather(-1, index)
        if self.scales is None:
            return kept.mT.to(self.keys.dtype), None
        codes, scales = quantize_rows(kept)
        return codes.mT, scales

    def logits(
        self, query: torch.Tensor, upto: int | None = None, *, parts: int | None = None
    ) -> torch.Tensor:
        """Estimated logits, (B, H, G, C) bfloat16, of positions [0, C): every allocated
        position, or with ``upto`` at least [0, upto).

        Parameters
        ----------
        query
            (B, H, G, D) this step's queries grouped by KV head (G query heads per KV head).
        upto
            The positions a caller reads are below it (a choice ranks none of the recent
            window, which every selection keeps). The compiled kernel then scores only those,
            C = min(upto, capacity): at SWA r = 0.2 the recent window and the allocation's
            headroom are about a fifth of the positions. The library products still score
            every allocated position (a slice of the channel-major sketch would be copied).
        parts
            The compiled kernel splits its (sequence, KV head) rows into this many parts, run in
            parallel (:func:`alisa.ops.cpu.kernel_parts`; None: its own count); the logits do
            not depend on it.

        Positions not written yet score 0 (their rows are zeros); callers rank only written
        ones.
        """
        if self.channels is None:
            return self.keys.new_zeros(*query.shape[:3], self.capacity)
        if self.product == "compiled":
            scored = self.capacity if upto is None else max(0, min(upto, self.capacity))
            return self._compiled_logits(query, scored, parts)
        index = self.channels.unsqueeze(2).expand(*query.shape[:3], self.width)
        # (B, H, G, width), rounded to bfloat16 whatever the product: the same operands.
        picked = query.gather(-1, index).to(SKETCH_DTYPE)
        dtype = SKETCH_DTYPE if self.product == "bfloat16" else torch.float32
        # Over the whole allocation, not the first L positions (see the module's note): no copy.
        logits = torch.matmul(picked.to(dtype), self.keys.to(dtype))
        if self.scales is not None:
            logits.mul_(self.scales.unsqueeze(2))
        return logits.to(SKETCH_DTYPE)

    def _compiled_logits(self, query: torch.Tensor, scored: int, parts: int | None) -> torch.Tensor:
        """:meth:`logits` of positions [0, ``scored``) by the compiled kernel, from (B, H, G,
        D) queries: the kernel takes the channels and rounds them itself (at batch 1 the
        operators doing that cost more than the product)."""
        scoring = self.scoring(query, scored)
        sketch_logits(*scoring.operands, kernel_parts(scoring.operands[0].shape[0], parts))
        return scoring.logits

    def prepared(self, query: torch.Tensor, upto: int | None, *, defer: bool) -> Scoring:
        """:meth:`logits` of (B, H, G, D) ``query`` over positions [0, ``upto``) (None: every
        one), run now, or with ``defer`` and the compiled product (channels chosen) its
        operands for a caller that runs the product inside its own compiled call
        (:meth:`scoring`)."""
        if defer and self.scores_compiled:
            return self.scoring(query, self.capacity if upto is None else upto)
        return Scoring(None, self.logits(query, upto))

    def scoring(self, query: torch.Tensor, upto: int) -> Scoring:
        """The compiled product's operands for (B, H, G, D) ``query`` over positions [0, C),
        C = min(upto, capacity) (see :meth:`logits`), and the (B, H, G, C) bfloat16 logits its
        output fills; for a caller that runs the product inside its own compiled call
        (:mod:`alisa.ops.cpu`). Only with the ``compiled`` product, once channels are chosen.
        """
        if not self.scores_compiled:
            raise ValueError(
                f"scoring takes the compiled product with its channels chosen (product="
                f"{self.product!r}, channels chosen: {self.channels is not None})"
            )
        batch, heads, groups, head_dim = query.shape
        rows = batch * heads
        scored = max(0, min(upto, self.capacity))
        out = np.empty((rows, groups, scored), dtype=np.uint16)
        if self._arrays is None:
            self._arrays = self._views()
        grouped = query.detach().float().numpy().reshape(rows, groups, head_dim)
        logits = torch.from_numpy(out.view(np.int16)).view(SKETCH_DTYPE)
        return Scoring((grouped, *self._arrays, out), logits.view(batch, heads, groups, scored))

    def _views(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(R, W) channels, (R, W, N) codes and (R, N) or (R, 0) scales as the compiled product
        reads them: numpy views, kept until a buffer is replaced (making them is several
        dispatched operators, each a few microseconds of a decode step's every layer)."""
        batch, heads, width, capacity = self.keys.shape
        rows = batch * heads
        if self.scales is None:
            codes = self.keys.detach().view(torch.int16).numpy().view(np.uint16)
            scales = np.zeros((rows, 0), dtype=np.float32)
        else:
            codes = self.keys.detach().numpy()
            scales = self.scales.detach().numpy().reshape(rows, capacity)
        channels = self.channels.numpy().reshape(rows, width)
        return channels, codes.reshape(rows, width, capacity), scales

    def extend_rows(self, other: KeySketch) -> None:
        """Append ``other``'s sequences (same positions; both have chosen their channels)."""
        if self.channels is None or other.channels is None:
            raise ValueError("sketches join a batch once their channels are chosen")
        if self.keys.dtype != other.keys.dtype:
            raise ValueError(
                f"sketches of {self.keys.dtype} and {other.keys.dtype} codes cannot share a batch"
            )
        extra = self.capacity - other.capacity
        self._pad_positions(0, max(-extra, 0))
        keys, scales = other._padded(0, max(extra, 0))  # theirs padded, never written
        self.keys = torch.cat([self.keys, keys])
        if self.scales is not None:
            self.scales = torch.cat([self.scales, scales])
        self.channels = torch.cat([self.channels, other.channels])
        self._arrays = None

    def shift(self, delta: int) -> None:
        """Move every key ``delta`` positions (new ones on the left are zero; positions moved
        below 0 are dropped)."""
        if delta >= 0:
            self._pad_positions(delta, 0)
        else:
            self.keys = self.keys[..., -delta:].contiguous()
            if self.scales is not None:
                self.scales = self.scales[:, :, -delta:].contiguous()
            self._arrays = None

    def select_batch(self, indices: torch.Tensor) -> None:
        self.keys = self.keys.index_select(0, indices)
        if self.scales is not None:
            self.scales = self.scales.index_select(0, indices)
        if self.channels is not None:
            self.channels = self.channels.index_select(0, indices)
        self._arrays = None

    def _choose(self, keys: torch.Tensor, counted: torch.Tensor) -> torch.Tensor:
        """(B, H, width) channels: the RoPE pairs with the largest mean norm over counted keys
        (all keys of a sequence that has none counted yet)."""
        half = keys.shape[-1] // 2
        keys = keys.float()
        norms = (keys[..., :half].square() + keys[..., half : 2 * half].square()).sqrt()
        weight = counted.to(device=keys.device, dtype=keys.dtype)  # (B, m)
        weight = torch.where(weight.sum(-1, keepdim=True) > 0, weight, torch.ones_like(weight))
        strength = (norms * weight.view(weight.shape[0], 1, -1, 1)).sum(2)  # (B, H, D/2)
        pairs = strength.topk(self.width // 2, dim=-1).indices.sort(dim=-1).values
        return torch.cat([pairs, pairs + half], dim=-1)


# The attention history.

# Stored sums are rescaled to the true ones once a scale passes this (float32 holds up to 3e38,
# and a step adds at most a probability times the scale).
RESCALE_AT = 2.0**64


class PositionHistory:
    """Per-position attention sums of one layer, (B, H_kv, positions), lazily faded.

    Parameters
    ----------
    batch, heads, width
        Sequences, KV heads and positions allocated (grows as needed).
    device
        Where the sums live (the model's device).
    decayed
        Fade by the policy's window each step (else sum every step, as H2O).
    head_max
        Combine a KV head's query heads by their max (SWA's default), else their sum.
    """

    def __init__(
        self,
        batch: int,
        heads: int,
        width: int,
        device: torch.device,
        *,
        decayed: bool,
        head_max: bool,
    ) -> None:
        self.total = torch.zeros(batch, heads, width, dtype=torch.float32, device=device)
        self.scale = np.ones(batch, dtype=np.float64)  # (B,) stored sum = true sum * scale
        self.decayed = decayed
        self.head_max = head_max

    def nbytes(self) -> int:
        return self.total.nbytes

    def ranked(self, width: int) -> torch.Tensor:
        """(B, H_kv, width) stored sums: within a sequence, in the order of the true sums."""
        self.reserve(width)
        return self.total[..., :width]

    def true_sums(self, width: int) -> torch.Tensor:
        """(B, H_kv, width) the sums themselves (scale removed)."""
        scale = upload(self.scale, self.total.device, torch.float32)
        return self.ranked(width) / scale.view(-1, 1, 1)

    def add(
        self,
        probabilities: torch.Tensor,
        positions: torch.Tensor,
        window: np.ndarray | None,
        width: int,
        *,
        compiled: bool,
        parts: int | None = None,
    ) -> None:
        """Fade, then add one decode step's attention to the positions the slots hold.

        Parameters
        ----------
        probabilities
            (B, H_kv, G, S') float32 attention of each KV head's G query heads over the first
            S' slots.
        positions
            (B, H_kv, S) position each slot holds (negative: none), S >= S'; all below ``width``.
        window
            (B,) the policy's score window per sequence (None: no fading).
        width
            Positions seen (the sums grow to it).
        compiled
            Use the CPU kernel (:func:`alisa.ops.cpu.accumulate`); else PyTorch ops.
        parts
            The kernel splits its (sequence, KV head) rows into this many parts, run in
            parallel (:func:`alisa.ops.cpu.kernel_parts`; None: its own count); the sums do not
            depend on it.
        """
        self.reserve(width)
        factor = self.fade(window)
        if factor is not None:
            self.total.mul_(upload(factor, self.total.device).view(-1, 1, 1))
        scale = self.scale.astype(np.float32)
        slots = positions[..., : probabilities.shape[-1]]
        if compiled:
            cpu.accumulate(
                probabilities.numpy(),
                slots.numpy(),
                self.total.numpy(),
                scale,
                self.head_max,
                kernel_parts(slots.shape[0] * slots.shape[1], parts),
            )
            return
        self._scatter(probabilities, slots, upload(scale, probabilities.device))

    def fade(self, window: np.ndarray | None) -> np.ndarray | None:
        """The host's half of a step's fade: grow each sequence's scale by ``1 / (1 - 1/w)``
        for its window ``window`` (B,), and say what the stored sums must first be multiplied
        by: (B,) float32, 0 where a one-step window (TOVA) erases them, the inverse scale where
        they are brought back to scale 1; None: nothing (not decayed, or no such row).

        Raises
        ------
        ValueError
            A decayed history without a window.
        """
        if not self.decayed:
            return None
        if window is None:
            raise ValueError("a decayed history needs the window w of each sequence")
        keep = 1.0 - 1.0 / np.maximum(window, 1)
        factor = None
        if keep.min() > 0:  # every sequence fades (one array op: this runs every layer)
            self.scale /= keep
        else:
            erased = keep == 0  # a one-step window (TOVA): only this step's attention counts
            factor = np.where(erased, 0.0, 1.0)
            self.scale[erased] = 1.0
            self.scale[~erased] /= keep[~erased]
        if self.scale.max() > RESCALE_AT:  # back to the true sums, scale 1
            inverse = 1.0 / self.scale
            factor = inverse if factor is None else factor * inverse
            self.scale[:] = 1.0
        return None if factor is None else factor.astype(np.float32)

    def add_static(
        self,
        probabilities: torch.Tensor,
        positions: torch.Tensor,
        factor: torch.Tensor,
        scale: torch.Tensor,
    ) -> None:
        """:meth:`add` in a static step (:mod:`alisa.kv.static`): the host computed the fade
        (:meth:`fade`), the device gets its (B,) float32 ``factor`` and ``scale``; the sums are
        allocated for every position already. Same parameters as :meth:`add` otherwise."""
        self.total.mul_(factor.view(-1, 1, 1))
        self._scatter(probabilities, positions[..., : probabilities.shape[-1]], scale)

    def _scatter(self, probabilities: torch.Tensor, slots: torch.Tensor, scale: torch.Tensor):
        """Add (B, H_kv, G, S') attention, its query heads combined and times the (B,) scale,
        to the positions the (B, H_kv, S') ``slots`` hold."""
        rows = combine_queries(probabilities, self.head_max) * scale.view(-1, 1, 1)
        rows = rows.masked_fill(slots < 0, 0.0).to(self.total.dtype)  # float64 models too
        self.total.scatter_add_(-1, slots.clamp(min=0), rows)

    def static_buffers(self) -> tuple[torch.Tensor, ...]:
        """The tensor a static step writes in place (its address kept from here on)."""
        return (self.total,)

    def reserve(self, width: int) -> None:
        """Grow (with headroom) so that positions [0, width) exist; new ones are zero."""
        if self.total.shape[-1] < width:
            extra = width + headroom(width) - self.total.shape[-1]
            self.total = torch.nn.functional.pad(self.total, (0, extra))

    def shift_columns(self, delta: int) -> None:
        """Every position moved by ``delta`` (new ones on the left are zero; positions moved
        below 0 are dropped)."""
        if delta >= 0:
            self.total = torch.nn.functional.pad(self.total, (delta, 0))
        else:
            self.total = self.total[..., -delta:].contiguous()

    def extend_rows(self, other: PositionHistory) -> None:
        """Append ``other``'s sequences (each keeps its own scale)."""
        if (other.decayed, other.head_max) != (self.decayed, self.head_max):
            raise ValueError("attention histories of different kinds cannot share a batch")
        width = max(self.total.shape[-1], other.total.shape[-1])
        mine = torch.nn.functional.pad(self.total, (0, width - self.total.shape[-1]))
        theirs = torch.nn.functional.pad(other.total, (0, width - other.total.shape[-1]))
        self.total = torch.cat([mine, theirs])
        self.scale = np.concatenate([self.scale, other.scale])

    def select_batch(self, indices: torch.Tensor) -> None:
        """Keep (and reorder) sequences."""
        self.total = self.total.index_select(0, indices)
        self.scale = self.scale[indices.cpu().numpy()]

    def empty_like(self, batch: int) -> PositionHistory:
        """A history of the same kind and width for ``batch`` sequences that have none yet."""
        return PositionHistory(
            batch,
            self.total.shape[1],
            self.total.shape[-1],
            self.total.device,
            decayed=self.decayed,
            head_max=self.head_max,
        )
