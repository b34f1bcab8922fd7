"""Determinism modes, the batch-invariance self-check, system fingerprints and output hash chains."""

from __future__ import annotations

import contextlib
import hashlib
import logging
from collections.abc import Iterator

import torch

logger = logging.getLogger("kvgate.engine")

FAST, FIXED, BATCH_INVARIANT = "fast", "fixed", "batch_invariant"
MODES = (FAST, FIXED, BATCH_INVARIANT)
# Hashed into every system fingerprint: bump it whenever the same request and seed can give other tokens
# (a new sampler draw, as in 0.3.0's inverse CDF), so an old receipt replays as from another system.
ENGINE_VERSION = "0.3.0"
# A matmul's per-row result depends on the call's row count: BLAS picks gemv/small-M kernels, K blocking
# and thread splits by shape (measured on 2-core Xeons: rows change below 12 and again at 63..129 rows for
# K=1536 but not for K=576). Batch-invariant steps therefore run every matmul as calls of fixed row counts
# (tiles), the last zero-padded, so a row's bits never depend on the step's size. The base tile is always
# allowed; a larger tile is used for a weight only when the start-up check shows it gives every row exactly
# the bits the base tile gives (so which tiles a machine may use changes speed, never results).
INVARIANT_TILE_ROWS = 32
_LARGE_TILES = (256, 128, 64)

Linear = tuple[torch.Tensor, torch.Tensor | None]  # (weight, bias)


def check_mode(mode: str | None, field: str = "determinism") -> None:
    if mode is not None and mode not in MODES:
        raise ValueError(f"{field} must be one of {MODES}, got {mode!r}")


def _tiles(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, tile: int) -> torch.Tensor:
    """``x`` (rows a multiple of ``tile``) as separate calls of ``tile`` rows."""
    if x.shape[0] == tile:
        return torch.nn.functional.linear(x, weight, bias)
    return torch.cat([torch.nn.functional.linear(x[i:i + tile], weight, bias)
                      for i in range(0, x.shape[0], tile)])


class TilePlan:
    """The CPU plan of batch-invariant ops: BLAS matmuls in row tiles (per weight shape, the tile sizes,
    largest first, ending with ``INVARIANT_TILE_ROWS``, whose row results are bitwise those of the base
    tile on this machine and thread count), torch's per-row RMSNorm, the C++ attention kernel."""

    attention_backend = "cpp"
    rms_norm = None  # torch's: each row is reduced on its own on the CPU

    def __init__(self, sizes: dict[tuple, tuple[int, ...]]) -> None:
        self._sizes = sizes

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """The largest proven tiles first, the rest in base tiles, the last one zero-padded."""
        n, sizes = x.shape[0], self.sizes_for(weight, bias)
        parts, start = [], 0
        for tile in sizes[:-1]:
            whole = (n - start) // tile * tile
            if whole:
                parts.append(_tiles(x[start:start + whole], weight, bias, tile))
                start += whole
        if start < n:
            base = sizes[-1]
            rest = x[start:]
            padded_rows = -(-rest.shape[0] // base) * base
            if padded_rows != rest.shape[0]:
                padded = rest.new_zeros((padded_rows, x.shape[1]))
                padded[:rest.shape[0]] = rest
                rest = padded
            parts.append(_tiles(rest, weight, bias, base)[:n - start])
        return parts[0] if len(parts) == 1 else torch.cat(parts)

    @staticmethod
    def _key(weight: torch.Tensor, bias: torch.Tensor | None) -> tuple:
        return (tuple(weight.shape), weight.dtype, weight.device.type, bias is not None)

    @classmethod
    def build(cls, groups: list[tuple[list[Linear], int]], seed: int = 0) -> TilePlan:
        """``groups``: matmuls with the most rows one call of them can have (the LM head only sees
        sampled rows, far fewer than a step's tokens, so it is not planned or checked beyond them)."""
        gen = torch.Generator().manual_seed(seed)
        base = INVARIANT_TILE_ROWS
        sizes: dict[tuple, tuple[int, ...]] = {}
        for (weight, bias), max_rows in ((lin, rows) for linears, rows in groups for lin in linears):
            kept = []
            for tile in _LARGE_TILES:
                if tile > max(max_rows, base):
                    continue
                x = torch.randn(tile, weight.shape[1], generator=gen).to(weight)
                if all(torch.equal(torch.nn.functional.linear(x, weight, bias), _tiles(x, weight, bias, base))
                       for x in (x, x.flip(0) * 3)):
                    kept.append(tile)
            sizes[cls._key(weight, bias)] = (*kept, base)
        return cls(sizes)

    def sizes_for(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> tuple[int, ...]:
        return self._sizes.get(self._key(weight, bias), (INVARIANT_TILE_ROWS,))


class TritonPlan:
    """The GPU plan (kernels.triton_bi): one fixed-configuration matmul, one program per row for RMSNorm
    and per (row, KV head) for attention; the row count never changes a row's arithmetic."""

    attention_backend = "triton"

    def __init__(self) -> None:
        from kernels import triton_bi

        self._ops = triton_bi
        self.config = triton_bi.CONFIG

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return self._ops.bi_linear(x, weight, bias)

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return self._ops.bi_rms_norm(x, weight, eps)

    def sizes_for(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> tuple[int, ...]:
        return ()


def tiled_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                 plan: TilePlan | TritonPlan | None) -> torch.Tensor:
    """``F.linear``; with a plan, computed so a row's result never depends on how many rows share the
    step."""
    if plan is None:
        return torch.nn.functional.linear(x, weight, bias)
    return plan.linear(x, weight, bias)


def verify_row_invariance(linears: list[Linear], max_rows: int, plan: TilePlan | TritonPlan,
                          seed: int = 0) -> str | None:
    """Check, on this machine and thread count, that a row's ``tiled_linear`` result does not depend on
    how many rows share the call, where it sits, or what its neighbours hold. None when it holds, else
    what broke."""
    gen = torch.Generator().manual_seed(seed)
    tile = INVARIANT_TILE_ROWS
    for weight, bias in linears:
        sizes = sorted({1, 2, 7, tile - 1, tile, tile + 1, 47, 64, 129, 300, max_rows,
                        *plan.sizes_for(weight, bias)})
        probe = torch.randn(1, weight.shape[1], generator=gen).to(weight)
        ref = tiled_linear(probe, weight, bias, plan)[0]
        for m in (m for m in sizes if m <= max(max_rows, tile)):
            batch = torch.randn(m, weight.shape[1], generator=gen).to(weight)
            for pos in sorted({0, m - 1, int(torch.randint(m, (1,), generator=gen))}):
                batch[pos] = probe[0]
                if not torch.equal(tiled_linear(batch, weight, bias, plan)[pos], ref):
                    k, n = weight.shape[1], weight.shape[0]
                    return f"a [{m}, {k}] x [{k}, {n}] tiled matmul changed row {pos}"
    return None


@contextlib.contextmanager
def deterministic_algorithms(enabled: bool) -> Iterator[None]:
    """torch's deterministic algorithms (and cuDNN's) for the span of one step that holds ``fixed``
    sequences, off again after it: they are process-wide switches, and left on they would slow every
    ``fast`` step too (on CUDA every ``torch.empty`` is then filled with NaN, and ops pick slower
    kernels). A step that holds no ``fixed`` sequence runs under whatever the process had set."""
    if not enabled or torch.are_deterministic_algorithms_enabled():
        yield
        return
    cudnn = torch.backends.cudnn
    torch.use_deterministic_algorithms(True)
    try:
        with cudnn.flags(enabled=cudnn.enabled, benchmark=False, deterministic=True):
            yield
    finally:
        torch.use_deterministic_algorithms(False)


def system_fingerprint(weights_digest: str, tokenizer_digest: str, mode: str, kernel_config: dict) -> str:
    """``fp_`` + a hash of everything that decides the output bits: weights, tokenizer, engine version,
    dtype, determinism mode and kernel configuration."""
    parts = [weights_digest, tokenizer_digest, ENGINE_VERSION, mode]
    parts += [f"{k}={kernel_config[k]}" for k in sorted(kernel_config)]
    return "fp_" + hashlib.blake2b("|".join(parts).encode(), digest_size=8).hexdigest()


def token_hash_chain(fingerprint: str, token_ids: list[int]) -> str:
    """h0 = H(fingerprint); h(i+1) = H(h(i) || token i): a receipt that proves a replay produced the
    same tokens without storing them."""
    digest = hashlib.blake2b(fingerprint.encode(), digest_size=16).digest()
    for t in token_ids:
        digest = hashlib.blake2b(digest + t.to_bytes(8, "little"), digest_size=16).digest()
    return digest.hex()


def weights_digest(model: torch.nn.Module) -> str:
    """BLAKE2b over every parameter's name, dtype, shape and bytes (about 0.5 s for 135M parameters)."""
    h = hashlib.blake2b(digest_size=16)
    for name, p in model.named_parameters():
        h.update(f"{name}|{p.dtype}|{tuple(p.shape)}".encode())
        h.update(p.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def tokenizer_digest(tokenizer) -> str:
    """Hash of the tokenizer's full serialized state (fast tokenizers) or its vocabulary."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    material = backend.to_str() if backend is not None else repr(sorted(tokenizer.get_vocab().items()))
    material += repr(getattr(tokenizer, "chat_template", None))
    return hashlib.blake2b(material.encode(), digest_size=16).hexdigest()


class Determinism:
    """What the engine can promise: the modes it serves, why batch_invariant is off if it is, and one
    system fingerprint per mode."""

    def __init__(self, modes: tuple[str, ...], fingerprint_parts: tuple[str, str], kernel_config: dict,
                 bi_error: str | None = None, schedule_config: dict | None = None,
                 tile_plan: TilePlan | TritonPlan | None = None) -> None:
        self.bi_error = bi_error
        self.tile_plan = tile_plan if bi_error is None else None
        self.modes = tuple(m for m in modes if m != BATCH_INVARIANT or bi_error is None)
        # Only fixed mode's bits depend on how steps are cut (batch and chunk sizes).
        fixed_config = kernel_config | (schedule_config or {})
        per_mode = {m: fixed_config if m == FIXED else kernel_config for m in MODES}
        self.fingerprints = {m: system_fingerprint(*fingerprint_parts, m, per_mode[m]) for m in MODES}

    def resolve(self, requested: str | None, default: str) -> str:
        """The mode a request runs in; raises ValueError if this engine cannot honour it."""
        mode = requested or default
        if mode not in self.modes:
            why = f": {self.bi_error}" if mode == BATCH_INVARIANT and self.bi_error else ""
            raise ValueError(f"determinism mode {mode!r} is not available on this engine{why}")
        return mode
