"""CUDA decode steps: a persistent pinned input batch, one copy per step, and CUDA graphs of the whole
forward pass plus LM head at bucketed batch sizes.

A decode step of a small model is bound by the host: 30 layers of ~150 launches each, and before this
about a dozen small blocking copies of the step's inputs. Here a decode-only ``fast`` step writes its
inputs into one pinned host buffer, copies it to the device without blocking, and replays the graph
captured for the smallest bucket that holds its rows. The rows past the real ones (padding) decode token
0 at position 0 into the reserved null block (``engine.runner.setup.load_model``'s last block, which no
sequence owns) and read only it; each layer zeroes it again after its attention, so it stays the zeros
every kernel that reads table padding relies on.

Every bucket's graph is captured at start-up, largest first, into one shared memory pool (the largest
bucket's activations, plus each bucket's logits: about 40 MB up to 64 rows of the default model; about
0.4 s a bucket on an H200). Captured lazily instead, the first step of each size stalled (in the
2026-11-26 bench the median time to first token went from 0.21 s to 3.8 s). A capture that fails, or a
GPU with too little free memory for one, turns graphs off for the process (logged once) and decode steps
run eagerly from the same buffers.
"""

from __future__ import annotations

import logging

import torch

from engine.request import Sequence
from kernels import AttentionMetadata, DecodeGroup

logger = logging.getLogger("kvgate.engine")

_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512)
_CAPTURE_HEADROOM = 256 << 20  # free device memory a capture must leave


def buckets(max_rows: int) -> tuple[int, ...]:
    """Batch sizes with a graph: the fixed ladder below ``max_rows``, then ``max_rows`` itself."""
    return tuple(b for b in _BUCKETS if b < max_rows) + (max_rows,)


class DecodeInputs:
    """One decode step's inputs: pinned on the host, mirrored on the device, one copy per step.

    Layout of the flat int64 buffer (M = ``max_rows``, W = ``max_blocks``)::

        | token ids [M] | positions [M] | slots [M] | context lengths [M] | block tables [M x W] |

    A step of B rows copies the first four fields whole and the first B table rows: one contiguous copy.
    """

    def __init__(self, max_rows: int, max_blocks: int, device: torch.device) -> None:
        self.max_rows, self.max_blocks = max_rows, max_blocks
        size = 4 * max_rows + max_rows * max_blocks
        on_cuda = device.type == "cuda"
        self.host = torch.zeros(size, dtype=torch.long, pin_memory=on_cuda)
        self._np = self.host.numpy()
        self.dev = torch.zeros(size, dtype=torch.long, device=device)
        # the host buffer may be written again once the last copy from it is done
        self._copied = torch.cuda.Event() if on_cuda else None

    def views(self, rows: int) -> tuple[torch.Tensor, ...]:
        """Device views (ids, positions, slots, context lengths, tables [rows, W]) of the first rows."""
        m, d = self.max_rows, self.dev
        tables = d[4 * m:4 * m + rows * self.max_blocks].view(rows, self.max_blocks)
        return d[:rows], d[m:m + rows], d[2 * m:2 * m + rows], d[3 * m:3 * m + rows], tables

    def fill(self, seqs: list[Sequence], rows: int, block_size: int, null_block: int,
             pending: list[int] | None = None) -> None:
        """Write the rows of ``seqs`` (each decoding its token at ``num_computed_tokens``, or with
        ``pending``, the token ``pending[i]`` sampled but not yet appended, at the position after) and pad
        up to ``rows`` with rows on the null block; start their copy to the device."""
        if self._copied is not None:
            self._copied.synchronize()
        m, h, w = self.max_rows, self._np, self.max_blocks
        n, ahead = len(seqs), int(pending is not None)
        for i, s in enumerate(seqs):
            pos = s.num_computed_tokens + ahead
            nb = pos // block_size + 1
            h[i] = pending[i] if ahead else s.all_token_ids[pos]
            h[m + i] = pos
            h[2 * m + i] = s.block_ids[pos // block_size] * block_size + pos % block_size
            h[3 * m + i] = pos + 1
            h[4 * m + i * w:4 * m + i * w + nb] = s.block_ids[:nb]
        if rows > n:
            h[n:rows] = 0
            h[m + n:m + rows] = 0
            h[2 * m + n:2 * m + rows] = null_block * block_size
            h[3 * m + n:3 * m + rows] = 1
            h[4 * m + n * w:4 * m + rows * w:w] = null_block
        end = 4 * m + rows * w
        self.dev[:end].copy_(self.host[:end], non_blocking=True)
        if self._copied is not None:
            self._copied.record()


class CudaDecoder:
    """Decode-only ``fast`` steps on CUDA: inputs through ``DecodeInputs``, the forward pass and LM head
    replayed from a CUDA graph per bucket (or run eagerly when graphs are off). Returns logits on the
    device; sampling is the caller's."""

    def __init__(self, model, kv_caches: list[tuple[torch.Tensor, torch.Tensor]], block_size: int,
                 null_block: int, max_rows: int, max_model_len: int, use_graphs: bool = True) -> None:
        self.model, self.kv_caches = model, kv_caches
        self.block_size, self.null_block = block_size, null_block
        self.buckets = buckets(max_rows)
        device = kv_caches[0][0].device
        self.inputs = DecodeInputs(max_rows, -(-max_model_len // block_size), device)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self._pool = None
        self.graphs_off: str | None = None if use_graphs else "turned off"

    def capture_all(self) -> None:
        """Capture every bucket now, largest first (the smaller ones reuse its memory), on padding rows
        only: nothing but the null block is written."""
        for rows in reversed(self.buckets):
            if self.graphs_off is not None:
                return
            self.inputs.fill([], rows, self.block_size, self.null_block)
            self._capture(rows)

    def can_run(self, num_rows: int) -> bool:
        return 0 < num_rows <= self.buckets[-1]

    def logits(self, seqs: list[Sequence], pending: list[int] | None = None) -> torch.Tensor:
        """[len(seqs), vocab] float32 logits of each sequence's next token (its K/V written); with
        ``pending``, of the token after ``pending[i]``, sampled but not yet appended (``DecodeInputs.fill``).
        The work is queued on the device, not waited for."""
        n = len(seqs)
        rows = next(b for b in self.buckets if b >= n) if self.graphs_off is None else n
        self.inputs.fill(seqs, rows, self.block_size, self.null_block, pending)
        graph = None if self.graphs_off is not None else self.graphs.get(rows) or self._capture(rows)
        if graph is None:  # eager, from the same buffers (padded to the bucket if a capture just failed)
            return self._forward(rows, rows > n)[:n]
        graph[0].replay()
        return graph[1][:n]

    def _forward(self, rows: int, padded: bool) -> torch.Tensor:
        """The forward pass and LM head over the first ``rows`` input rows; ``padded``: some of them
        are padding, which writes the null block (zeroed again after each layer's attention)."""
        ids, positions, slots, lens, tables = self.inputs.views(rows)
        scratch = self.null_block if padded else None
        meta = AttentionMetadata(slots, rows, [DecodeGroup(0, rows, tables, None)], [],
                                 decode_rows=(tables, lens), scratch_block=scratch)
        hidden = self.model(ids, positions, meta, self.kv_caches)
        return self.model.compute_logits(hidden)

    def _capture(self, rows: int) -> tuple[torch.cuda.CUDAGraph, torch.Tensor] | None:
        """Warm up (compiles the kernels for this shape) and capture the forward pass of ``rows`` rows;
        None, with graphs turned off, when it cannot."""
        free, _ = torch.cuda.mem_get_info()
        if free < _CAPTURE_HEADROOM:
            self._turn_off(f"{free >> 20} MiB free on the device")
            return None
        try:
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                self._forward(rows, True)  # the inputs are this step's: it writes the K/V the replay writes
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self._pool):
                logits = self._forward(rows, True)
        except Exception as e:  # noqa: BLE001  (graphs are an optimisation: eager decoding still works)
            self._turn_off(f"capturing {rows} rows failed with {type(e).__name__}: {e}")
            return None
        self._pool = graph.pool()
        self.graphs[rows] = (graph, logits)
        logger.debug("captured the decode graph of %d rows", rows)
        return graph, logits

    def _turn_off(self, why: str) -> None:
        self.graphs_off = why
        self.graphs.clear()
        logger.warning("CUDA graphs for decode steps turned off, decoding eagerly: %s", why)
