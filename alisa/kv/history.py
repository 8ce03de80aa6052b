"""Attention each token position received while held on the device (``retention="host"``).

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

import numpy as np
import torch

from alisa.ops import cpu
from alisa.ops.cpu import kernel_parts
from alisa.ops.reference import combine_queries
from alisa.ops.transfer import upload
from alisa.storage.store import headroom

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
