"""Decode attention's achieved bandwidth on one layer: kvgate's paged paths against SDPA over a cache that
is already contiguous (the bytes every method must read at least once: each row's K and V), and a few
tile and warp settings of the split-KV kernel at the large sizes."""

from __future__ import annotations

import statistics
import time

import torch

from kernels import AttentionMetadata, DecodeGroup, paged_attention

_GROUP = 16  # decode rows per group, as the model runner forms them


ATTENTION_SIZES = [(1, 512), (1, 32768), (16, 8192), (32, 4096), (32, 8192), (32, 32768), (64, 512),
                   (64, 4096), (64, 8192), (128, 4096), (256, 512), (256, 4096)]
_SWEEP_SIZES = {(32, 4096), (64, 8192), (256, 4096)}  # where the split kernel's settings are swept


def time_ms(fn, device: torch.device, reps: int = 20, graph: bool = True) -> float:
    """Median milliseconds of one ``fn()`` after two warm-up calls. On CUDA with ``graph``, as the engine
    runs it: ten calls captured in one CUDA graph and replayed (no host launch cost); else device events
    around each eager call (on the CPU, the wall clock)."""
    for _ in range(2):
        fn()
    if device.type == "cuda" and graph:
        return _graph_ms(fn, reps)
    times = []
    for _ in range(reps):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def _graph_ms(fn, reps: int, inner: int = 10) -> float:
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(inner):
            fn()
    g.replay()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        g.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / inner)
    return statistics.median(times)


def copy_bandwidth_gbs(device: torch.device, nbytes: int) -> float:
    """A device-to-device copy's GB/s counting bytes read plus written: the memory ceiling here."""
    src = torch.randn(nbytes // 4, device=device)
    dst = torch.empty_like(src)
    # eager: captured in a graph, a device-to-device copy becomes a copy-engine node (~2.7 against
    # ~4.2 TB/s on an H200), not the SM kernel that bounds what a kernel can stream
    return 2 * nbytes / time_ms(lambda: dst.copy_(src), device, graph=False) / 1e6


def _case(batch: int, ctx: int, heads: tuple[int, int, int], dtype: torch.dtype, device: torch.device,
          block_size: int = 16):
    """A paged cache whose rows own shuffled blocks, each row holding exactly ``ctx`` tokens."""
    num_heads, num_kv_heads, head_dim = heads
    nb = -(-ctx // block_size)
    gen = torch.Generator(device).manual_seed(batch * 7919 + ctx)  # on the device: GiB-sized cases
    total = batch * nb + 1
    k_cache = torch.randn(total, block_size, num_kv_heads, head_dim, generator=gen, device=device).to(dtype)
    v_cache = torch.randn(total, block_size, num_kv_heads, head_dim, generator=gen, device=device).to(dtype)
    tables = (torch.randperm(total - 1, generator=gen, device=device)[:batch * nb] + 1).view(batch, nb)
    q = torch.randn(batch, num_heads, head_dim, generator=gen, device=device).to(dtype)
    mask = None
    if ctx != nb * block_size:
        mask = (torch.arange(nb * block_size, device=device) < ctx)[None, None, None, :].expand(
            _GROUP, 1, 1, -1)
    groups = [DecodeGroup(s, min(s + _GROUP, batch), tables[s:s + _GROUP],
                          None if mask is None else mask[:min(_GROUP, batch - s)])
              for s in range(0, batch, _GROUP)]
    meta = AttentionMetadata(torch.empty(0, dtype=torch.long, device=device), batch, groups, [])
    return q, k_cache, v_cache, tables, meta


def _contiguous(cache: torch.Tensor, tables: torch.Tensor, ctx: int) -> torch.Tensor:
    """[B, Hkv, ctx, D] copy of each row's context, the layout SDPA reads."""
    batch, nb = tables.shape
    bs, num_kv_heads, head_dim = cache.shape[1:]
    rows = cache[tables.reshape(-1)].view(batch, nb * bs, num_kv_heads, head_dim)[:, :ctx]
    return rows.transpose(1, 2).contiguous()


def measure_case(batch: int, ctx: int, heads: tuple[int, int, int], dtype: torch.dtype,
                 device: torch.device) -> dict:
    """GB/s of each method over the K/V bytes of ``batch`` rows of ``ctx`` tokens, and how far the paged
    results are from SDPA's."""
    from kernels.triton_bi import paged_attention_rows_triton

    q, k_cache, v_cache, tables, meta = _case(batch, ctx, heads, dtype, device)
    scale = heads[2] ** -0.5
    k, v = _contiguous(k_cache, tables, ctx), _contiguous(v_cache, tables, ctx)
    qs = q[:, :, None, :]  # [B, H, 1, D]
    seq = torch.arange(batch, device=device)
    lens = torch.full((batch,), ctx, dtype=torch.long, device=device)
    methods = {
        # the engine's decode path on this device (on CUDA the split-KV kernel), from the step's groups
        "kvgate": lambda: paged_attention(q, k_cache, v_cache, meta, scale),
        "kvgate_eager": lambda: paged_attention(q, k_cache, v_cache, meta, scale),
        "triton_rows": lambda: paged_attention_rows_triton(q, k_cache, v_cache, tables, seq, lens, scale),
        "sdpa_contiguous": lambda: torch.nn.functional.scaled_dot_product_attention(
            qs, k, v, scale=scale, enable_gqa=heads[0] != heads[1]),
    }
    ref = methods["sdpa_contiguous"]()[:, :, 0].float()
    nbytes = 2 * batch * ctx * heads[1] * heads[2] * dtype.itemsize
    row = {"batch": batch, "ctx": ctx, "kv_mib": nbytes / 2**20}
    read = dict.fromkeys(methods, nbytes)
    if device.type == "cuda":
        quant = _quantized_methods(q, k_cache, v_cache, tables, lens, scale)
        methods.update(quant)
        read.update(dict.fromkeys(quant, nbytes * (heads[2] + 4) // (heads[2] * dtype.itemsize)))
        if (batch, ctx) in _SWEEP_SIZES:
            sweep = _split_variants(q, k_cache, v_cache, tables, lens, scale)
            methods.update(sweep)
            read.update(dict.fromkeys(sweep, nbytes))
    for name, fn in methods.items():
        try:
            out = fn().view(batch, heads[0], -1).float() if name != "sdpa_contiguous" else ref
            row[f"{name}_ms"] = ms = time_ms(fn, device, graph=name != "kvgate_eager")
        except Exception as e:  # noqa: BLE001 - one method's failure must not cost the others
            row[f"{name}_error"] = f"{type(e).__name__}: {e}"
            continue
        row[f"{name}_gbs"] = read[name] / ms / 1e6
        row[f"{name}_rel_err"] = float((out - ref).norm() / ref.norm())
    return row


def _quantized_methods(q, k_cache, v_cache, tables, lens, scale) -> dict:
    """The split kernel over int8 and fp8 copies of the cache (their GB/s count the 8-bit values and the
    scales they read; their error against SDPA includes the quantization's)."""
    from kernels.kv_quant import QUANT_DTYPES, QuantizedKV, quantize
    from kernels.paged_attention import num_sms
    from kernels.triton_decode import pick_num_splits, split_decode_attention

    splits = pick_num_splits(q.shape[0], k_cache.shape[2], num_sms(q.device))
    methods = {}
    for kind, qdtype in QUANT_DTYPES.items():
        kq, vq = (QuantizedKV(*quantize(c, qdtype), c.dtype) for c in (k_cache, v_cache))
        for f16, suffix in ((True, ""), (False, "_nof16")):
            methods[f"kvgate_{kind}{suffix}"] = (lambda kq=kq, vq=vq, f16=f16: split_decode_attention(
                q, kq, vq, tables, lens, scale, splits, f16=f16))
    return methods


def _split_variants(q, k_cache, v_cache, tables, lens, scale) -> dict:
    """The split-KV kernel at other tiles, warps, pipeline depths and split counts than the engine's."""
    from kernels.paged_attention import num_sms
    from kernels.triton_decode import pick_num_splits, split_decode_attention

    picked = pick_num_splits(q.shape[0], k_cache.shape[2], num_sms(q.device))

    def variant(tile: int, warps: int, stages: int, splits: int):
        return lambda: split_decode_attention(q, k_cache, v_cache, tables, lens, scale, splits, tile=tile,
                                              num_warps=warps, stages=stages)

    settings = [(t, 4, st, picked) for t in (64, 128) for st in (2, 3)] + [(128, 8, 2, picked)]
    settings += [(128, 4, 2, 2 * picked), (128, 4, 2, max(1, picked // 2))]
    return {f"split_t{t}_w{w}_st{st}_s{s}": variant(t, w, st, s) for t, w, st, s in settings}


def run_attention_bench(device: torch.device, heads: tuple[int, int, int], sizes: list[tuple[int, int]],
                        dtype: torch.dtype = torch.bfloat16) -> dict:
    """Every (batch, ctx) of ``sizes``; a failing size records its error and the rest still run."""
    rows = []
    for batch, ctx in sizes:
        try:
            rows.append(measure_case(batch, ctx, heads, dtype, device))
        except Exception as e:  # noqa: BLE001 - one size's failure must not cost the others
            rows.append({"batch": batch, "ctx": ctx, "error": f"{type(e).__name__}: {e}"})
    ceiling = copy_bandwidth_gbs(device, (1 << 30) if device.type == "cuda" else (64 << 20))
    return {"heads": list(heads), "dtype": str(dtype), "copy_gbs": ceiling, "rows": rows}


def run_prefill_bench(device: torch.device, heads: tuple[int, int, int], dtype: torch.dtype = torch.bfloat16,
                      cases: tuple[tuple[int, int, int], ...] = ((8, 0, 512), (8, 2048, 512), (64, 0, 128))
                      ) -> dict:
    """One layer's prefill attention over the paged cache for ``(chunks, cached tokens, chunk tokens)``:
    the Triton kernel (all chunks in one launch) against the torch path (gather each chunk's context,
    SDPA), both eager as the engine runs prefill steps."""
    rows = [_prefill_case(device, heads, dtype, *case) for case in cases]
    return {"heads": list(heads), "dtype": str(dtype), "rows": rows}


def _prefill_case(device: torch.device, heads: tuple[int, int, int], dtype: torch.dtype, chunks: int,
                  cached: int, n: int) -> dict:
    from kernels import AttentionMetadata, PrefillSpan
    from kernels.paged_attention import prefill_torch
    from kernels.triton_prefill import PrefillPlan, prefill_attention

    num_heads, num_kv_heads, head_dim = heads
    nb = -(-(cached + n) // 16)
    k, v = (torch.randn(chunks * nb + 1, 16, num_kv_heads, head_dim, device=device).to(dtype) for _ in "kv")
    perm = torch.randperm(chunks * nb, device=device).view(chunks, nb)
    pos = torch.arange(cached + n, device=device)
    mask = pos[None, :] <= pos[cached:, None] if cached else None
    spans = [PrefillSpan(i * n, n, perm[i][pos // 16] * 16 + pos % 16, mask) for i in range(chunks)]
    meta = AttentionMetadata(torch.zeros(chunks * n, dtype=torch.long, device=device), 0, [], spans)
    q = torch.randn(chunks * n, num_heads, head_dim, device=device).to(dtype)
    out, ref = torch.empty_like(q), torch.empty_like(q)
    plan = PrefillPlan.build(spans, device)
    scale = head_dim ** -0.5
    triton_ms = time_ms(lambda: prefill_attention(q, k, v, plan, scale, out), device, graph=False)
    torch_ms = time_ms(lambda: prefill_torch(q, k, v, meta, scale, ref), device, graph=False)
    err = float((out.float() - ref.float()).norm() / ref.float().norm())
    return {"chunks": chunks, "cached": cached, "chunk_tokens": n, "triton_ms": triton_ms,
            "torch_ms": torch_ms, "rel_err": err}
