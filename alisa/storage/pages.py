"""The host region of ``retention="host"``: every token's K/V, page-organised, 16/8/4 bits.

Nothing is deleted here. Tokens are written once, at their position, into pages of
``PAGE_TOKENS`` (the buffers grow by whole pages), quantized per token and KV head (ALISA's
asymmetric min/max, :mod:`quant`) unless ``bits`` is 16. A decode step copies back only the
tokens its selection wants that the device does not already hold (:meth:`HostPages.fetch`):
an index gather of those rows, then dequantization of just them (a device region with the same
INT8/INT4 format takes the codes as they are; on a CPU a float32 region takes INT8 rows in one
compiled pass, :mod:`alisa.ops.cpu`). On CUDA the buffers are pinned, so the device can
read the rows itself (:func:`alisa.ops.cuda.fetch_placed` on :meth:`HostPages.region`: no fetch list
on the host, no wait) or, by :meth:`HostPages.fetch`, the host gathers them and the copy up is
asynchronous. Either runs on the compute stream, not a side stream: the rows are known only once
this layer's query has been scored and this layer's attention waits for them, so there is nothing
to overlap them with (the tiered host pool, whose rows are known a step ahead, does use a side
stream). On a CPU both regions are ordinary memory and the saving is the bytes read per step.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from alisa.config import KV_BITS
from alisa.ops.cpu import HALVES, fetch_rows, kernel_parts, move_rows
from alisa.ops.reference import HostRegion
from alisa.storage.quantized import SCALE_DTYPE, QuantizedPair
from alisa.storage.store import byte_view, flat_rows, page_locked, range_rows, with_capacity
from quant.asymmetric import SCALE_LEVELS, quantize_fixed


@dataclass(frozen=True)
class FetchedRows:
    """E tokens of :class:`HostPages` for a device region to take
    (:class:`~alisa.storage.store.HostRows`), read when the region asks for them.

    ``region`` is the host region's plain (2, N, D) keys/values or its (data, scale, zero point)
    codes, each (2, N, ·) with N = B * H_kv * capacity; ``flat`` (E,) the rows to read, on the
    host. With ``compiled``, the kernels that read them split the rows into ``parts`` parts run
    in parallel (:func:`alisa.ops.cpu.kernel_parts`; None: its own count).
    """

    region: tuple[torch.Tensor, ...]
    flat: torch.Tensor
    pair: QuantizedPair | None
    device: torch.device
    pin: bool
    compiled: bool
    parts: int | None = None

    def _stored(self) -> tuple[torch.Tensor, ...]:
        """The rows as stored, each (2, E, ·), on the model's device.

        Gathered on the host by :func:`gathered`, straight into
        page-locked memory when the device is CUDA, so each copy up is asynchronous (on the
        compute stream: see the module) without a second host copy to pin it.
        """
        picked = (
            gathered(t, self.flat, pin=self.pin, compiled=self.compiled, parts=self.parts)
            for t in self.region
        )
        return tuple(t.to(self.device, non_blocking=True) for t in picked)

    def decoded(self) -> tuple[torch.Tensor, torch.Tensor]:
        stored = self._stored()
        if self.pair is None:
            return stored[0][0], stored[0][1]
        return self.pair.decode(*stored)

    def codes(self, bits: int, group: int) -> tuple[torch.Tensor, ...] | None:
        if self.pair is None or (self.pair.bits, self.pair.group) != (bits, group):
            return None
        return self._stored()

    def codes_into(
        self, bits: int, group: int, codes: tuple[torch.Tensor, ...], rows: torch.Tensor
    ) -> bool:
        mine = self.pair
        if not (
            self.compiled
            and mine is not None
            and (mine.bits, mine.group) == (bits, group)
            and all(t.dtype == c.dtype for t, c in zip(self.region, codes, strict=True))
        ):
            return False
        parts = kernel_parts(rows.shape[0], self.parts)
        for source, target in zip(self.region, codes, strict=True):
            flat = target.view(2, -1, target.shape[-1])  # (2, B * H_kv * capacity, ·)
            move_rows(byte_view(source), self.flat.numpy(), byte_view(flat), rows.numpy(), parts)
        return True

    def write_into(self, keys: torch.Tensor, values: torch.Tensor, rows: torch.Tensor) -> None:
        """Write the tokens' keys and values into rows (E,) of (M, D) device buffers.

        With ``compiled``, INT8 codes with a float16 scale per row going to float32 buffers
        are decoded and written in one pass by :func:`alisa.ops.cpu.fetch_rows` (the
        same values as :meth:`decoded`, bit for bit); otherwise :meth:`decoded` and two
        scatters.
        """
        if self._kernel_takes(keys, values):
            fetch_rows(
                *decodable(self.region),
                HALVES,
                self.flat.numpy(),
                rows.numpy(),
                keys.numpy(),
                values.numpy(),
                kernel_parts(rows.shape[0], self.parts),
            )
            return
        decoded_keys, decoded_values = self.decoded()
        keys.index_copy_(0, rows, decoded_keys.to(keys.dtype))
        values.index_copy_(0, rows, decoded_values.to(values.dtype))

    def _kernel_takes(self, keys: torch.Tensor, values: torch.Tensor) -> bool:
        return (
            self.compiled
            and kernel_decodes(self.pair)
            and keys.dtype == values.dtype == torch.float32
            and keys.is_contiguous()
            and values.is_contiguous()
        )


def kernel_decodes(pair: QuantizedPair | None) -> bool:
    """Whether :func:`fetch_rows` decodes a region coded as ``pair``: INT8 rows with one float16
    scale each (widened scales take PyTorch's path), coded from float32 (dequantization computes
    in float32, as the kernel)."""
    return pair is not None and pair.int8_rows() and pair.dtype == torch.float32


def decodable(region: tuple[torch.Tensor, ...]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A (2, N, ·) INT8 region's (data, scale, zero point) as :func:`fetch_rows` reads them:
    (2, N, D) uint8 codes, and the (2, N) int16 bits of each row's float16 scale and zero point
    (numpy views: no dispatched operator)."""
    data, scale, zero = (t.detach().numpy() for t in region)
    return data, scale.view(np.int16)[..., 0], zero.view(np.int16)[..., 0]


def gathered(
    region: torch.Tensor,
    rows: torch.Tensor,
    *,
    pin: bool,
    compiled: bool,
    parts: int | None = None,
) -> torch.Tensor:
    """Rows (E,) of a host (2, N, ·) tensor as a new (2, E, ·) host tensor (page-locked with
    ``pin``): ``region.index_select(1, rows)``, with ``compiled`` by one parallel compiled pass
    over the bytes (:func:`alisa.ops.cpu.move_rows`).

    Parameters
    ----------
    region
        (2, N, ·) host tensor.
    rows
        (E,) int64 rows to copy, in order, below N (unchecked here: :meth:`HostPages.fetch`
        checks the rows it makes).
    pin
        Page-lock the new tensor.
    compiled
        Copy by the compiled kernel; else ``index_select``.
    parts
        With ``compiled``, the rows are split into this many parts, run in parallel
        (:func:`alisa.ops.cpu.kernel_parts`; None: its own count).

    Returns
    -------
    torch.Tensor
        (2, E, ·) the rows, ``region``'s dtype.
    """
    out = torch.empty((2, rows.shape[0], *region.shape[2:]), dtype=region.dtype, pin_memory=pin)
    if not compiled:
        return torch.index_select(region, 1, rows, out=out)
    order = np.arange(rows.shape[0], dtype=np.int64)  # out's rows, in the order asked
    split = kernel_parts(rows.shape[0], parts)
    move_rows(byte_view(region), rows.numpy(), byte_view(out), order, split)
    return out


PAGE_TOKENS = 16
# Positions coded per call when a long prompt is written: the codes' temporaries on the model's
# device stay a bounded slice of the prompt (a prefill's peak is already the largest).
WRITE_CHUNK = 64 * PAGE_TOKENS


def grown_capacity(length: int) -> int:
    """Positions a host region holds after growing to fit ``length``: whole pages, with 1/64
    of the length (a page at least) to spare, so growth copies amortise."""
    wanted = length + max(PAGE_TOKENS, length // 64)
    return -(-wanted // PAGE_TOKENS) * PAGE_TOKENS


def host_region_bytes(
    batch: int, heads: int, head_dim: int, tokens: int, *, bits: int, element_bytes: int
) -> int:
    """The most bytes one layer's :class:`HostPages` holds for ``tokens`` positions of
    ``batch`` sequences (spare room included): 16-bit values in the model's dtype of
    ``element_bytes`` bytes, or ``bits``-bit codes with a float16 scale and zero point per token
    and KV head."""
    if bits >= 16:
        per_slot = 2 * head_dim * element_bytes
    else:
        per_slot = 2 * (head_dim * bits // 8 + 2 * SCALE_DTYPE.itemsize)
    return batch * heads * grown_capacity(tokens) * per_slot


class HostPages:
    """Keys and values of every position of one layer, (2, B, H_kv, capacity, ·) on the host.

    Writes are coded on the model's device and land here asynchronously on CUDA: the codes are
    copied into page-locked staging without waiting, and put into the region at the next read
    (:meth:`settle`), by which time the copy has run (a selection reads after its fetch list's
    round trip, which drains the queue; a read by the device waits only for pages it could read,
    and new pages are in the protected recent window), so a page costs no wait of its own.

    Parameters
    ----------
    batch, heads, head_dim
        Sequences, KV heads, channels.
    bits
        16 (the model dtype), 8 or 4.
    dtype, device
        The model's dtype and device (fetches are returned there).
    pinned
        Page-lock the buffers (the model is on CUDA: :attr:`alisa.ops.backends.Ops.pinned`), so
        copies run asynchronously and a kernel on the device can read the rows.
    defer
        Land writes at the next read (default: when ``pinned``); else at once.
    compiled
        Code writes to an INT8 region and take fetched INT8 rows by the compiled CPU kernels
        (:attr:`alisa.ops.backends.Ops.compiled`); the same bytes as quantize's path, which is
        the reference.
    """

    def __init__(
        self,
        batch: int,
        heads: int,
        head_dim: int,
        *,
        bits: int,
        dtype,
        device: torch.device,
        pinned: bool = False,
        defer: bool | None = None,
        compiled: bool = False,
    ) -> None:
        if bits not in KV_BITS:
            raise ValueError(f"host_bits={bits!r} must be one of {KV_BITS}")
        self.device = device
        self.host = torch.device("cpu")  # host memory, whatever device the model is on
        self.pin = pinned
        shape = (batch, heads, 0, head_dim)
        self.pair: QuantizedPair | None = None
        self.plain: torch.Tensor | None = None
        if bits == 16:
            self.plain = torch.zeros(2, *shape, dtype=dtype, device=self.host)
        else:
            self.pair = QuantizedPair(shape, bits, head_dim, dtype, self.host)
        self.length = 0  # positions written
        # A static step's INT8 coding (make_static): the scales' dtype chosen so far (an index
        # of SCALE_LEVELS, on the device) and the tokens not coded yet, by position mod a page.
        self.level: torch.Tensor | None = None
        self.ring: torch.Tensor | None = None
        # region()'s numpy views of the INT8 rows, until its buffers are replaced.
        self._codes: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None
        self.defer = pinned if defer is None else defer
        self.compiled = compiled
        # (index, codes in host memory, CUDA event after their copy or None), oldest first
        self._landing: list[tuple[tuple, tuple[torch.Tensor, ...], torch.cuda.Event | None]] = []
        # Replaced buffers the device may still be reading (a placed fetch), with an event
        # recorded after those reads: kept alive until it has passed.
        self._retired: list[tuple[tuple[torch.Tensor, ...], torch.cuda.Event]] = []

    @property
    def capacity(self) -> int:
        return self.tensors()[0].shape[3]

    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors())

    def pinned(self) -> bool:
        """Whether the buffers are page-locked (on CUDA they are, once a page is written)."""
        return page_locked(*self.tensors())

    def write(self, start: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Store (B, H_kv, m, D) keys and values at positions [start, start + m).

        They are quantized where they are (on CUDA the device does the O(n) work of a long
        prompt, and only the codes cross), ``WRITE_CHUNK`` positions at a time, then land as
        the class says.
        """
        end = start + keys.shape[2]
        self.settle(wait=False)
        self.reserve(end)
        self.length = max(self.length, end)
        batch, heads = keys.shape[:2]
        for first in range(0, keys.shape[2], WRITE_CHUNK):
            last = min(first + WRITE_CHUNK, keys.shape[2])
            pair = torch.stack([keys[:, :, first:last], values[:, :, first:last]])
            # In host memory (nothing is landing) the compiled coder writes the rows in place:
            # a page of a decode step's tokens cost a dozen dispatched operators per layer.
            if self.compiled and not self._landing and self.pair is not None:
                rows = range_rows(batch * heads, self.capacity, start + first, last - first)
                if self.pair.code_rows(pair, lambda rows=rows: rows):
                    continue
            index = (slice(None), slice(None), slice(None), slice(start + first, start + last))
            self._write(index, pair)

    def make_static(self, width: int) -> None:
        """Ready the region for a static step (:meth:`write_static`): room for positions [0,
        ``width``) and one page more (a step's coding writes a whole page's rows, most of them
        masked); an INT8 region's scales and zero points as float64, which holds exactly every
        dtype :func:`quant.asymmetric.quantize` may choose for them, with the region's choice so
        far kept on the device, and a ring of the tokens not coded yet."""
        self.settle()
        self.reserve(width + PAGE_TOKENS)
        if self.pair is None:
            return
        data, scale, zero = self.pair.tensors()
        level = SCALE_LEVELS.index(scale.dtype)
        self._replace((data, scale.double(), zero.double()))
        self.level = torch.tensor([level], device=self.host)
        two, batch, heads, _, head_dim = data.shape
        self.ring = torch.zeros(two, batch, heads, PAGE_TOKENS, head_dim, dtype=self.pair.dtype)

    def write_static(
        self,
        position: torch.Tensor,
        keys: torch.Tensor,
        values: torch.Tensor,
        start: torch.Tensor,
        count: torch.Tensor,
    ) -> None:
        """A static step's (B, H_kv, 1, D) token at ``position``, with one shape and no host
        read (the model's memory is the host's: a CPU). A 16-bit region takes it at once; an
        INT8 one keeps it in the ring and codes positions [``start``, ``start + count``) ((1,)
        int64 each; ``count`` <= ``PAGE_TOKENS``, 0: none), the range the eager region codes
        at this step (a page, or sooner when a selection could leave a token out), with the
        scales' dtype it would choose: the same bytes."""
        pair = torch.stack([keys, values])
        if self.plain is not None:
            self.plain.index_copy_(3, position, pair)
            return
        self.ring.index_copy_(3, position % PAGE_TOKENS, pair)
        offsets = torch.arange(PAGE_TOKENS, device=self.host)
        positions = start + offsets
        valid = offsets < count
        rows = self.ring.index_select(3, positions % PAGE_TOKENS)
        *coded, chosen = quantize_fixed(rows, valid, self.level)
        kept = valid.view(1, 1, 1, -1, 1)
        for region, new in zip(self.pair.tensors(), coded, strict=True):
            old = region.index_select(3, positions)
            region.index_copy_(3, positions, torch.where(kept, new, old))
        self.level.copy_(torch.maximum(self.level, chosen))

    def static_buffers(self) -> tuple[torch.Tensor, ...]:
        """The tensors a static step writes in place (their addresses kept from here on)."""
        coding = () if self.pair is None else (self.ring, self.level)
        return (*self.tensors(), *coding)

    def _write(self, index: tuple, pair: torch.Tensor) -> None:
        """Code (2, B, H_kv, m, D) ``pair`` and land it at ``index``."""
        codes = (pair,) if self.plain is not None else self.pair.code(pair)
        staged = tuple(self._stage(t) for t in codes)
        event = None
        if self.pin:  # the codes come from the CUDA device: land them once their copy ran
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(pair.device))
        self._landing.append((index, staged, event))
        if not self.defer:
            self.settle()

    def settle(self, *, wait: bool = True) -> None:
        """Put every write whose copy has run into the region (``wait``: every write, waiting
        for copies still running). Reads of the region call it first."""
        self._retired = [(old, event) for old, event in self._retired if not event.query()]
        while self._landing:
            index, staged, event = self._landing[0]
            if event is not None and not event.query():
                if not wait:
                    return
                event.synchronize()
            self._put(index, staged)
            self._landing.pop(0)

    def fetch(
        self,
        rows: torch.Tensor,
        heads: torch.Tensor,
        positions: torch.Tensor,
        *,
        compiled: bool | None = None,
        parts: int | None = None,
    ) -> FetchedRows:
        """E tokens (flat index triples, in host memory), for a device region to take.

        Only these rows are read (and dequantized, when the device region wants them decoded);
        nothing else of the history is touched.

        Parameters
        ----------
        rows, heads, positions
            (E,) sequence, KV head and position of each token.
        compiled
            A float32 device region may take INT8 rows through the CPU kernel
            (:meth:`FetchedRows.write_into`), and the rows are gathered by the compiled copy;
            None: the region's own ``compiled`` (a test passes either to compare the two).
        parts
            The compiled kernels that read the rows split them into this many parts, run in
            parallel (:func:`alisa.ops.cpu.kernel_parts`; a test asks for more than this
            machine's threads; None: its own count).

        Returns
        -------
        FetchedRows
            The tokens, read when the device region asks for them.

        Raises
        ------
        IndexError
            A token's row is past the host region.
        """
        self.settle()
        _, _, heads_, capacity = self.tensors()[0].shape[:4]
        flat = flat_rows(rows, heads, positions, heads_, capacity, host=True)
        if flat.device != self.host:
            flat = flat.to(self.host)
        region = self._rows()
        count, last = region[0].shape[1], flat.numpy().max(initial=-1)
        if last >= count:  # both kernels that read these rows (gather, fetch) skip bounds checks
            raise IndexError(f"row {last} of a host region of {count} rows")
        compiled = self.compiled if compiled is None else compiled
        return FetchedRows(region, flat, self.pair, self.device, self.pin, compiled, parts)

    def region(self, protected: int) -> HostRegion:
        """The region as a selection reads it (:class:`alisa.ops.reference.HostRegion`), its
        writes landed.

        Parameters
        ----------
        protected
            Positions from here on are held on the device (the selection's protected recent
            window), so never fetched: pages still landing there need no wait.
        """
        self.settle(wait=False)
        if any(index[3].start < protected for index, _, _ in self._landing):
            self.settle()
        pair = self.pair
        if not kernel_decodes(pair) or self.pin:
            self._codes = None  # scales widened by an outlier replace the pair's buffers
        elif self._codes is None:  # views made once per buffer (each is dispatched operators)
            self._codes = decodable(self._rows())
        maps = pair is None or pair.int8_rows()
        return HostRegion(tensors=self.tensors(), codes=self._codes, maps=maps)

    def select_batch(self, indices: torch.Tensor) -> None:
        self.settle()
        host = indices.to(self.host)
        self._replace(tuple(t.index_select(1, host) for t in self.tensors()))

    def extend_rows(self, other: HostPages) -> None:
        """Append ``other``'s sequences (same positions, heads and format) after these."""
        self.settle()
        other.settle()
        capacity = max(self.capacity, other.capacity)
        self._replace(
            tuple(
                torch.cat([with_capacity3(mine, capacity), with_capacity3(theirs, capacity)], 1)
                for mine, theirs in zip(self.tensors(), other.tensors(), strict=True)
            )
        )
        self.length = max(self.length, other.length)

    def shift(self, delta: int) -> None:
        """Move every token ``delta`` positions (new positions on the left are empty; positions
        moved below 0 are dropped). The copy is sized for the new length
        (:func:`grown_capacity`), so a region never keeps the room of a row that left, and the
        host bytes admission predicts for the rows it holds stay an upper bound."""
        self.settle()
        self.length = max(self.length + delta, 0)
        capacity = grown_capacity(self.length)
        self._replace(tuple(_moved3(t, delta, capacity) for t in self.tensors()))

    # ---- internals -----------------------------------------------------------------------

    def _stage(self, tensor: torch.Tensor) -> torch.Tensor:
        """A host copy of ``tensor`` that may still be running (page-locked, from CUDA)."""
        if not self.pin:
            return tensor.to(self.host)
        staged = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
        return staged.copy_(tensor, non_blocking=True)

    def _put(self, index: tuple, codes: tuple[torch.Tensor, ...]) -> None:
        if self.plain is not None:
            self.plain[index] = codes[0]
        else:
            self.pair.put(index, *codes)

    def tensors(self) -> tuple[torch.Tensor, ...]:
        """The region: (plain,) or the INT8/INT4 codes' (data, scale, zero point)."""
        return (self.plain,) if self.plain is not None else self.pair.tensors()

    def _rows(self) -> tuple[torch.Tensor, ...]:
        """The region's tensors as (2, N, ·) views, a row per (sequence, KV head, position):
        N = B * H_kv * capacity."""
        return tuple(t.flatten(1, 3) for t in self.tensors())

    def _replace(self, tensors: tuple[torch.Tensor, ...]) -> None:
        if self.pin:
            tensors = tuple(t.pin_memory() for t in tensors)
            # A mapped fetch queued on the device may still read the old buffers: PyTorch's
            # host allocator knows only of its own copies, so they stay alive until it ran.
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(self.device))
            self._retired.append((self.tensors(), event))
        if self.plain is not None:
            (self.plain,) = tensors
        else:
            self.pair.replace(tensors)
        self._codes = None

    def reserve(self, length: int) -> None:
        """Grow by whole pages, 1/64 of the length at least: the host region is the largest
        buffer, so spare room stays under 2 % while growth copies still amortise."""
        if length <= self.capacity:
            return
        capacity = grown_capacity(length)
        self._replace(tuple(with_capacity(t, capacity) for t in self.tensors()))


def _moved3(tensor: torch.Tensor, delta: int, capacity: int) -> torch.Tensor:
    """A (2, B, H, ``capacity``, ·) copy of a (2, B, H, positions, ·) buffer with every position
    moved ``delta`` later (zeros where nothing moved to; positions leaving either end cut)."""
    out = tensor.new_zeros(*tensor.shape[:3], capacity, tensor.shape[4])
    source, target = max(-delta, 0), max(delta, 0)
    count = min(tensor.shape[3] - source, capacity - target)
    if count > 0:
        out[:, :, :, target : target + count] = tensor[:, :, :, source : source + count]
    return out


def with_capacity3(tensor: torch.Tensor, capacity: int) -> torch.Tensor:
    """A (2, B, H, positions, ·) buffer with ``capacity`` positions (zero-padded or as is)."""
    extra = capacity - tensor.shape[3]
    return torch.nn.functional.pad(tensor, (0, 0, 0, extra)) if extra else tensor
