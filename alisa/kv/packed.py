"""One forward for two caches: the running rows' decode step inside a newcomer's prefill.

Continuous batching prefills each newcomer and then runs a decode step over the running rows: two
forwards, each reading every weight once. A mixed forward (Sarathi-Serve's piggybacking,
https://arxiv.org/abs/2403.02310) packs both into one (1, B + T) forward: columns [0, B) are the
B running rows' next tokens, one each, and columns [B, B + T) one newcomer's prompt. Every
linear layer, norm and RoPE works token by token, so packing changes nothing there; attention is
where the two parts differ, and it is split here: the running rows attend over their
:class:`~alisa.kv.cache.AlisaCache` as at any decode step, the newcomer over its own prompt as
at any prefill (causal, into a cache of its own), each through the same code path as alone.

:class:`~alisa.kv.cache.PackedCache` is what the model is given as ``past_key_values``; its
layers (:class:`PackedLayer`) reach the ``alisa`` attention function through the usual pre-hook.
``probes.bench_packing`` measures what it saves (a forward's fixed cost).
"""

from __future__ import annotations

import torch
from transformers.cache_utils import CacheLayerMixin

from alisa.kv.layer import AlisaLayer


def running_columns(states: torch.Tensor, rows: int) -> torch.Tensor:
    """The running rows' columns of a packed (1, H, N, D) tensor, as (rows, H, 1, D)."""
    return states[0, :, :rows].transpose(0, 1).unsqueeze(2)


def prompt_columns(states: torch.Tensor, rows: int) -> torch.Tensor:
    """The newcomer's columns of a packed (1, H, N, D) tensor: (1, H, N - rows, D)."""
    return states[:, :, rows:]


def split_kv(
    key_states: torch.Tensor, value_states: torch.Tensor, rows: int
) -> tuple[tuple[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]:
    """A packed forward's (1, H_kv, N, D) keys and values, as ((running keys, values),
    (newcomer keys, values)): what each part's cache stores."""
    running = (running_columns(key_states, rows), running_columns(value_states, rows))
    return running, (prompt_columns(key_states, rows), prompt_columns(value_states, rows))


class PackedLayer(CacheLayerMixin):
    """One attention layer of a mixed forward: a running batch's layer and a newcomer's.

    Parameters
    ----------
    running
        The running rows' layer (prefilled; this forward is one decode step for them).
    newcomer
        The newcomer's layer (empty; this forward is its prefill).
    rows
        B: the packed forward's first B columns are the running rows' tokens.
    """

    is_compileable = False
    is_sliding = False

    def __init__(self, running: AlisaLayer, newcomer: AlisaLayer, rows: int) -> None:
        super().__init__()
        self.running, self.newcomer, self.rows = running, newcomer, rows

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        self.is_initialized = True

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Store each part's (1, H_kv, N, D) columns in its own layer; return them packed."""
        running, prompt = split_kv(key_states, value_states, self.rows)
        self.running.update(*running)
        self.newcomer.update(*prompt)
        return key_states, value_states

    def get_seq_length(self) -> int:
        return 0  # the packed forward is its own sequence: its mask spans its N columns only

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        # HF's mask is not read: each part masks as it would alone.
        return query_length, 0

    def get_max_length(self) -> int:
        return -1

    def receive_inputs(self, hidden: torch.Tensor, position_ids: torch.Tensor | None) -> None:
        """Hand each layer its part of the (1, N, hidden) attention input and (1, N) positions."""
        rows = self.rows
        positions = (None, None)
        if position_ids is not None:
            positions = (position_ids[0, :rows].unsqueeze(1), position_ids[:, rows:])
        self.running.receive_inputs(hidden[0, :rows].unsqueeze(1), positions[0])
        self.newcomer.receive_inputs(hidden[:, rows:], positions[1])
