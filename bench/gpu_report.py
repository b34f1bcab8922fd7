"""The printed table of `kvgate bench gpu` (the JSON holds everything)."""

from __future__ import annotations

from bench.gpu_kv import kv_rows


def _err(section) -> str | None:
    if section is None:
        return "not run"
    return section.get("error") or section.get("skipped")


def _throughput_rows(report: dict) -> list[str]:
    rows = ["| architecture | peer | tok/s | wall (s) | peak GPU MiB |", "|---|---|---:|---:|---:|"]
    main = ("throughput_kvgate", "throughput_hf", "throughput_kvgate_no_overlap", "throughput_kvgate_eager")
    pairs = [(report.get("architecture"), report.get(key)) for key in main if key in report]
    for key, section in report.items():
        if key.startswith("throughput_") and key not in main:
            arch = key.removeprefix("throughput_")
            pairs += ([(arch, section.get("kvgate")), (arch, section.get("hf"))] if not _err(section)
                      else [(arch, section)])
    for arch, r in pairs:
        if _err(r):
            rows.append(f"| {arch} | {_err(r)} ||||")
            continue
        peak = "n/a" if r.get("peak_gpu_mib") is None else f"{r['peak_gpu_mib']:.0f}"
        rows.append(f"| {arch} | {r['peer']} | {r['tokens_per_s']:.1f} | {r['wall_s']:.2f} | {peak} |")
    return rows


_ATTENTION_METHODS = ("kvgate", "kvgate_eager", "kvgate_int8", "kvgate_int8_nof16", "kvgate_fp8",
                      "kvgate_fp8_nof16", "triton_rows", "sdpa_contiguous")


def _attention_rows(section: dict | None) -> list[str]:
    if _err(section):
        return [f"attention: {_err(section)}"]
    rows = [f"decode attention, one layer, heads {section['heads']}, {section['dtype']}; device copy "
            f"{section['copy_gbs']:.0f} GB/s (read + write); GB/s over the bytes each method must read, "
            "timed in a CUDA graph except 'eager'",
            "| batch | ctx | KV MiB | kvgate | kvgate eager | int8 KV | int8 KV, bf16 products | fp8 KV | "
            "fp8 KV, bf16 products | Triton rows | SDPA contiguous | kvgate / copy | best swept setting |",
            "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for r in section["rows"]:
        if "error" in r:
            rows.append(f"| {r['batch']} | {r['ctx']} | {r['error']} ||||||||||")
            continue
        cells = [f"{r[m + '_gbs']:.0f}" if m + "_gbs" in r else ("error" if m + "_error" in r else "")
                 for m in _ATTENTION_METHODS]
        cells.append(f"{r['kvgate_gbs'] / section['copy_gbs']:.0%}" if "kvgate_gbs" in r else "")
        swept = {k.removesuffix("_gbs"): v for k, v in r.items()
                 if k.startswith("split_") and k.endswith("_gbs")}
        best = max(swept, key=swept.get) if swept else None
        cells.append(f"{best} {swept[best]:.0f} ({swept[best] / section['copy_gbs']:.0%})" if best else "")
        rows.append(f"| {r['batch']} | {r['ctx']} | {r['kv_mib']:.1f} | " + " | ".join(cells) + " |")
    return rows


def _prefill_rows(section: dict | None) -> list[str]:
    if _err(section):
        return [f"prefill: {_err(section)}"]
    rows = ["prefill attention, one layer, eager: the Triton kernel (one launch) against gather + SDPA "
            "per chunk",
            "| chunks | cached tokens | chunk tokens | Triton ms | torch ms | speed-up | rel. error |",
            "|---:|---:|---:|---:|---:|---:|---:|"]
    for r in section["rows"]:
        rows.append(f"| {r['chunks']} | {r['cached']} | {r['chunk_tokens']} | {r['triton_ms']:.3f} | "
                    f"{r['torch_ms']:.3f} | {r['torch_ms'] / r['triton_ms']:.1f}x | {r['rel_err']:.1e} |")
    return rows


def format_table(report: dict) -> str:
    """Device, agreement, throughput and attention bandwidth as markdown tables."""
    env = report.get("environment", {})
    lines = [f"device: {env.get('name', env.get('device'))}, torch {env.get('torch')}, "
             f"transformers {env.get('transformers')}; weights: {report.get('weights')}"]
    corr = report.get("correctness")
    if _err(corr):
        lines.append(f"agreement: {_err(corr)}")
    else:
        lines.append(f"greedy agreement with transformers (float32): {_agreement(corr)}")
        if "overlap_vs_stepwise" in corr:
            o = corr["overlap_vs_stepwise"]
            lines.append(f"overlapped steps against stepping in turn (float32): greedy {o['greedy_exact']}/"
                         f"{o['prompts']} prompts identical, seeded draws {o['seeded_exact']}/{o['prompts']}")
    modes = report.get("default_modes")
    if modes is not None:
        bi = modes.get("batch_invariant_vs_hf")
        lines.append(f"default modes: {_err(modes) or modes.get('modes')}"
                     + (f"; batch_invariant vs transformers: {_agreement(bi)}" if bi else "")
                     + (f"; batch_invariant off: {modes['bi_error']}" if modes.get("bi_error") else ""))
    inv = report.get("bi_invariance")
    if inv is not None:
        lines.append(f"batch_invariant alone vs under load and chunked ({inv.get('dtype')}): " + (
            _err(inv) or f"{inv['identical']}/{inv['runs']} runs of {inv['targets']} targets identical "
                         f"bit for bit, {inv['blocks_held_after']} blocks held after"))
    for key, section in report.items():  # the extra architectures'
        arch_corr = section.get("correctness") if key.startswith("throughput_") else None
        if arch_corr and not _err(arch_corr):
            lines.append(f"greedy agreement with transformers on {key.removeprefix('throughput_')} "
                         f"(float32): {_agreement(arch_corr)}")
    tables = (_throughput_rows(report) + [""] + _attention_rows(report.get("attention")) + [""]
              + _prefill_rows(report.get("prefill")) + [""] + kv_rows(report.get("kv_cache")))
    return "\n".join(lines + [""] + tables)


def _agreement(a: dict) -> str:
    parted = [r["hf_margin_at_divergence"] for r in a["rows"] if r["hf_margin_at_divergence"] is not None]
    margins = f", transformers' top-2 margin where they part: {max(parted):.2e}" if parted else ""
    return (f"{a['exact']}/{a['prompts']} prompts exact, {a['token_agreement']:.1%} of tokens before a "
            f"divergence, max logprob gap {a['max_logprob_gap']:.2e}{margins}")
