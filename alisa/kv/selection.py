"""Token selection shared by every keeper: protections first, then the top-k of the scores.

Both ways of keeping a layer's KV choose tokens the same way. Dropping (ALISA's SWA, H2O, ...)
picks each sequence's ``excess`` lowest-priority slots as victims; host retention picks each
(sequence, KV head)'s ``budget`` highest-priority positions to attend. In both the policy's
protections (sinks, the recent window: :meth:`~alisa.policies.KVPolicy.protected`) are given an
infinite priority, so they are never a victim and always chosen, and what must never be chosen
(empty slots, left padding) the opposite extreme.

ALISA, https://arxiv.org/abs/2403.17312, Alg. 1 (SWA: k recent plus the top-k of the summed
attention).
"""

from __future__ import annotations

import numpy as np
import torch

from alisa.storage.transfer import upload


def with_protections(
    scores: torch.Tensor,
    protected: torch.Tensor,
    excluded: torch.Tensor | None = None,
    *,
    inplace: bool = False,
) -> torch.Tensor:
    """Scores made priorities: +inf where ``protected``, -inf where ``excluded``.

    Parameters
    ----------
    scores
        (B, Hs, n) float scores; overwritten only when ``inplace`` (a policy's scores may be a
        view of its attention sums).
    protected, excluded
        bool masks broadcastable to ``scores`` (e.g. (B, 1, n)).
    """
    priority = (
        scores.masked_fill_(protected, torch.inf)
        if inplace
        else scores.masked_fill(protected, torch.inf)
    )
    if excluded is not None:
        priority.masked_fill_(excluded, -torch.inf)
    return priority


def put_taken(target: torch.Tensor, index: torch.Tensor, taken: torch.Tensor, value: float) -> None:
    """Write ``value`` into ``target`` at ``index`` along the last dimension where ``taken``
    (as :func:`top_k` returns them: False past a row's count), in place. An index taken in a
    row must not appear again in that row (both writes would race).

    A masked scatter: the entries not taken write back what they read. Indexing only the taken
    entries would first read the mask on the host (``nonzero``), a device round trip per layer
    and step.
    """
    target.scatter_(-1, index, torch.where(taken, value, target.gather(-1, index)))


def top_k(
    priority: torch.Tensor, counts: np.ndarray, *, largest: bool = True, ordered: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``counts[b]`` highest (or lowest) entries of each (B, Hs, n) row.

    Parameters
    ----------
    priority
        (B, Hs, n) priorities (protected entries +inf).
    counts
        (B,) entries wanted per sequence (host-side integers: no device sync).
    largest
        Highest first (choose what to keep) or lowest first (choose victims).
    ordered
        Rank the entries even when every row takes the same count.

    Returns
    -------
    tuple
        (B, Hs, max count) indices and a bool of the same shape that is False past a row's
        count (rows with smaller counts take the first of the ranked entries: only then sort).
    """
    count = int(counts.max())
    ranked = ordered or bool((counts != count).any())
    top = torch.topk(priority, count, dim=-1, largest=largest, sorted=ranked).indices
    wanted = torch.arange(count, device=priority.device).view(1, 1, -1)
    taken = wanted < upload(counts, priority.device).view(-1, 1, 1)
    return top, taken.expand_as(top).clone()
