"""The attention a host-retention step gives the tokens it leaves on the host, estimated.

A ``retention="host"`` decode step attends exactly to the tokens chosen for it. Left there, the
softmax is renormalised over the chosen set: every chosen token's weight is its dense weight
divided by the share of attention the chosen set holds, and when a model spreads its attention
thinly (small models, long contexts) that share is small and the weights come out far too
large. SmolLM2-135M at 8K tokens and r = 0.1 missed needles dense attention finds even with
exact ``q . k`` ranking, and found them at r = 0.2 with the same number of ranked tokens and a
longer recent window of filler (docs/ruler.md): what it lacked was the mass, not the needle.

So the tokens left out are estimated instead of ignored, as RetroInfer's "estimation zone"
does for the clusters it does not retrieve (https://arxiv.org/abs/2505.02922, §4): one more
softmax column per query head carries their summed ``exp(q . k * scale)``, estimated from the
key sketch's logits (already computed for the choice), and their output, estimated by the mean
value of the tokens written so far (a running sum, one pass over each page when it is coded).
The chosen tokens then get their dense weights up to the sketch's error, and the rest
contributes its average instead of nothing.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class RestColumn:
    """The tokens a step leaves out, as one softmax column per query head.

    Attributes
    ----------
    logit
        (B, H_kv, G, q) log of their estimated ``sum exp(logit)`` per query head and query
        (``-inf`` where a sequence leaves nothing out).
    value
        (B, H_kv, D) the output that column contributes per unit of probability.
    """

    logit: torch.Tensor
    value: torch.Tensor


def rest_logit(
    logits: torch.Tensor,
    held: torch.Tensor,
    first: torch.Tensor,
    written: int,
    scaling: float,
    softcap: float | None = None,
    *,
    padded: bool = True,
) -> torch.Tensor:
    """Log of the estimated attention mass of the written positions the slots do not hold.

    Parameters
    ----------
    logits
        (B, H_kv, R, C) sketch logits ``q . k_hat`` of positions [0, C), R query rows per KV
        head (query heads times queries), C >= ``written``.
    held
        (B, H_kv, S) positions the device slots hold (negative: none).
    first
        (B,) first real position of each sequence (before it: padding, never counted).
    written
        Positions [0, written) are estimated (later ones are held, pending their page).
    scaling, softcap
        As attention applies them to ``q . k``.
    padded
        False when every ``first`` is 0 (a host-side fact: no mask over the positions).

    Returns
    -------
    torch.Tensor
        (B, H_kv, R) float32 ``log sum exp`` over the positions left out (``-inf``: none).

    The mass left out is the mass of every written position less that of the held ones: two
    reductions, one over every position (no mask unless a sequence is padded) and one over
    the slots, instead of marking the held positions among all of them.
    """
    if written == 0:
        return logits.new_full(logits.shape[:3], float("-inf"), dtype=torch.float32)
    estimate = logits[..., :written].float() * scaling
    if softcap is not None:
        estimate = torch.tanh(estimate / softcap) * softcap
    if padded:
        position = torch.arange(written, device=held.device)
        estimate = estimate.masked_fill(position < first.view(-1, 1, 1, 1), float("-inf"))
    every = torch.logsumexp(estimate, dim=-1)  # (B, H_kv, R)
    counted = (held >= 0) & (held < written)  # padding slots hold negative positions
    index = torch.where(counted, held, 0).unsqueeze(2).expand(-1, -1, estimate.shape[2], -1)
    on_device = estimate.gather(-1, index).masked_fill(~counted.unsqueeze(2), float("-inf"))
    kept = torch.logsumexp(on_device, dim=-1)
    # log(e^every - e^kept); the held share rounds to at most 1 (then nothing is left out).
    share = torch.exp(kept - every).nan_to_num(nan=0.0)  # -inf - -inf: nothing counted
    return every + torch.log1p(-share.clamp(max=1.0))


class ValueTotals:
    """Running sum of the values of every real position written, per (sequence, KV head).

    Parameters
    ----------
    batch, heads, head_dim
        Sequences, KV heads, channels.
    device
        The model's device (the sums stay there: no host round trip reads them).
    """

    def __init__(self, batch: int, heads: int, head_dim: int, device: torch.device) -> None:
        self.total = torch.zeros(batch, heads, head_dim, dtype=torch.float32, device=device)
        self.count = torch.zeros(batch, dtype=torch.float32, device=device)

    def nbytes(self) -> int:
        return self.total.nbytes + self.count.nbytes

    def add(self, values: torch.Tensor, real: torch.Tensor) -> None:
        """Count (B, H_kv, m, D) ``values`` where ``real`` (B, m) says a position is a token."""
        weight = real.to(device=values.device, dtype=torch.float32)
        self.total += torch.einsum("bhmd,bm->bhd", values.float(), weight)
        self.count += weight.sum(dim=1)

    def mean(self) -> torch.Tensor:
        """(B, H_kv, D) mean value (zeros for a sequence with nothing counted yet)."""
        return self.total / self.count.clamp(min=1).view(-1, 1, 1)

    def select_batch(self, indices: torch.Tensor) -> None:
        self.total = self.total.index_select(0, indices)
        self.count = self.count.index_select(0, indices)

    def extend_rows(self, other: ValueTotals) -> None:
        self.total = torch.cat([self.total, other.total])
        self.count = torch.cat([self.count, other.count])
