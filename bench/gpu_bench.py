"""`kvgate bench gpu`: the engine on a CUDA device, on seeded random weights of the default architecture
(no downloaded weights needed): greedy agreement with transformers on the same weights and GPU, the
standard workload's throughput beside transformers' batched generate, and decode attention bandwidth.

Each section records its error and the next one still runs; the JSON is rewritten after every section,
so a run cut short keeps what it measured. Exit code 2 when the device is not there.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

from bench.gpu_agreement import run_correctness, run_default_modes
from bench.gpu_attention import ATTENTION_SIZES, run_attention_bench, run_prefill_bench
from bench.gpu_invariance import run_bi_invariance
from bench.gpu_kv import run_kv_quant
from bench.gpu_model import (
    ARCHITECTURES,
    DTYPES,
    PAD,
    default_source,
    free_memory,
    hf_model,
    kvgate_engine,
    make_random_model,
    peak_gpu_mib,
)
from bench.gpu_report import format_table
from bench.workload import BenchRequest, percentile, standard_workload


def run_kvgate_throughput(model_dir: Path, reqs: list[BenchRequest], args, cuda_graphs: bool = True,
                          kv_cache_dtype: str = "auto", overlap: bool = True) -> dict:
    """The workload submitted at once to the engine (bfloat16), greedy, exactly max_new_tokens each;
    decode steps from CUDA graphs unless ``cuda_graphs`` is False, each recorded while the device runs
    the next unless ``overlap`` is False."""
    from engine import SamplingParams

    engine = kvgate_engine(model_dir, args.device, args.dtype, max_num_seqs=max(64, len(reqs)),
                           max_num_batched_tokens=args.max_batched_tokens, enable_prefix_caching=False,
                           cuda_graphs=cuda_graphs, kv_cache_dtype=kv_cache_dtype, overlap_steps=overlap)
    # Warm-up over the workload's own shapes (prefill chunks, mixed and decode steps of every size), so
    # that Triton compiles its kernels' specializations here and not inside the timed run (a one-request
    # warm-up left them there: the median time to first token was 3.8 s instead of 0.2 s).
    engine.generate([r.prompt_ids for r in reqs],
                    SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    free_memory(args.device)
    t0 = time.monotonic()
    for i, r in enumerate(reqs):
        engine.add_request(r.prompt_ids, SamplingParams(temperature=0, max_tokens=r.max_new_tokens,
                                                        ignore_eos=True), f"b{i}", arrival_time=t0)
    ttfts = []
    while engine.has_unfinished():
        ttfts += [o.metrics.time_to_first_token for o in engine.step() if o.finished]
    wall = time.monotonic() - t0
    gen = sum(r.max_new_tokens for r in reqs)
    decoder = engine.runner.decoder
    kv = "" if kv_cache_dtype == "auto" else f", {kv_cache_dtype} KV cache"
    ways = ("" if cuda_graphs else ", no CUDA graphs") + ("" if overlap else ", no overlapped steps")
    row = {"peer": f"kvgate ({args.dtype}{kv}{ways})",
           "requests": len(reqs),
           "generated_tokens": gen, "wall_s": wall, "tokens_per_s": gen / wall,
           "ttft_p50_s": percentile(ttfts, 50), "steps": engine.stats().num_steps,
           "max_num_batched_tokens": args.max_batched_tokens, "peak_gpu_mib": peak_gpu_mib(args.device),
           "graph_buckets": sorted(decoder.graphs) if decoder else None,
           "graphs_off": decoder.graphs_off if decoder else "no CUDA decoder", "overlap_steps": overlap}
    del engine
    free_memory(args.device)
    return row


def run_hf_throughput(model_dir: Path, reqs: list[BenchRequest], args) -> dict:
    """transformers' generate over left-padded static batches; each batch runs to its longest member, and
    only the requested tokens count."""
    hf = hf_model(model_dir, args.device, args.dtype)
    with torch.inference_mode():
        hf.generate(torch.tensor([reqs[0].prompt_ids[:8]], device=args.device), max_new_tokens=4,
                    do_sample=False, pad_token_id=PAD)  # warm-up
        free_memory(args.device)
        t0 = time.monotonic()
        for i in range(0, len(reqs), args.hf_batch):
            group = reqs[i:i + args.hf_batch]
            width = max(len(r.prompt_ids) for r in group)
            ids = [[PAD] * (width - len(r.prompt_ids)) + r.prompt_ids for r in group]
            mask = [[0] * (width - len(r.prompt_ids)) + [1] * len(r.prompt_ids) for r in group]
            new = max(r.max_new_tokens for r in group)
            hf.generate(torch.tensor(ids, device=args.device),
                        attention_mask=torch.tensor(mask, device=args.device), max_new_tokens=new,
                        min_new_tokens=new, do_sample=False, pad_token_id=PAD)
        if args.device == "cuda":
            torch.cuda.synchronize()
        wall = time.monotonic() - t0
    gen = sum(r.max_new_tokens for r in reqs)
    row = {"peer": f"transformers static batch {args.hf_batch} ({args.dtype})", "requests": len(reqs),
           "generated_tokens": gen, "wall_s": wall, "tokens_per_s": gen / wall,
           "peak_gpu_mib": peak_gpu_mib(args.device)}
    del hf
    free_memory(args.device)
    return row


def _section(report: dict, name: str, out: Path, fn, *fn_args) -> object:
    """Run one section; record its result or its traceback; rewrite the JSON either way."""
    t0 = time.monotonic()
    print(f"== {name}", flush=True)
    try:
        report[name] = result = fn(*fn_args)
    except Exception as e:  # noqa: BLE001 - a failed section must not cost the others
        report[name] = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()}
        print(report[name]["traceback"], flush=True)
        result = None
    report.setdefault("section_s", {})[name] = time.monotonic() - t0
    out.write_text(json.dumps(report, indent=2, default=str))
    return result


def environment(device: str) -> dict:
    import transformers

    env = {"torch": torch.__version__, "transformers": transformers.__version__, "device": device,
           "date": time.strftime("%Y-%m-%d")}
    if device == "cuda":
        env.update(name=torch.cuda.get_device_name(), capability=list(torch.cuda.get_device_capability()),
                   memory_gib=torch.cuda.get_device_properties(0).total_memory / 2**30)
    return env


SECTIONS = ("correctness", "throughput", "attention", "default_modes", "bi_invariance", "kv_cache",
            "throughput_256", "prefill")


def _prepare(args, report: dict):
    """The checkpoint (random or trained), its shape in the report, the agreement prompts and the workload."""
    from engine.runner.loader import load_model_config, load_tokenizer

    if args.weights == "trained":  # the checkpoint as it is (a GGUF converted once, like `kvgate serve`)
        from engine.runner.loader import resolve_model_dir

        model_dir = source = resolve_model_dir(args.model_dir)
    else:
        source = Path(args.model_dir) if args.model_dir else default_source()
        model_dir = make_random_model(source, Path(tempfile.mkdtemp(prefix="kvgate-gpu-")) / "m", args.arch,
                                      args.seed, init_device=args.device)
    args.source_dir = source  # config and tokenizer of the extra architectures
    mc = load_model_config(model_dir)
    report["model"] = {"layers": mc.num_layers, "hidden": mc.hidden_size, "heads": mc.num_heads,
                       "kv_heads": mc.num_kv_heads, "head_dim": mc.head_dim}
    tokenizer = load_tokenizer(model_dir)
    prompts = [r.prompt_ids for r in standard_workload(tokenizer, args.prompts, args.seed + 1, (64, 400))]
    return model_dir, mc, prompts, standard_workload(tokenizer, args.num_requests, args.seed)


def run(args) -> dict:
    """Every section of ``args.sections`` in turn, then the extra architectures while time is left."""
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    trained = args.weights == "trained"
    report: dict = {"environment": environment(args.device),
                    "weights": f"trained ({args.model_dir or 'the default model'})" if trained
                    else "random (seeded), not trained", "architecture": "trained" if trained else args.arch}
    model_dir, mc, prompts, reqs = _prepare(args, report)
    corr = None
    if "correctness" in args.sections:
        corr = _section(report, "correctness", out, run_correctness, model_dir, prompts, args)
    if "throughput" in args.sections:
        _section(report, "throughput_kvgate", out, run_kvgate_throughput, model_dir, reqs, args)
        _section(report, "throughput_hf", out, run_hf_throughput, model_dir, reqs, args)
        if args.device == "cuda":
            _section(report, "throughput_kvgate_no_overlap", out, run_kvgate_throughput, model_dir, reqs,
                     args, True, "auto", False)
            _section(report, "throughput_kvgate_eager", out, run_kvgate_throughput, model_dir, reqs, args,
                     False)
    if "attention" in args.sections:
        sizes = ATTENTION_SIZES if args.device == "cuda" else [(3, 64), (16, 200)]
        _section(report, "attention", out, run_attention_bench, torch.device(args.device),
                 (mc.num_heads, mc.num_kv_heads, mc.head_dim), sizes)
    if "prefill" in args.sections:
        _section(report, "prefill", out, run_prefill_bench, torch.device(args.device),
                 (mc.num_heads, mc.num_kv_heads, mc.head_dim))
    if corr is not None and "default_modes" in args.sections:
        _section(report, "default_modes", out, run_default_modes, model_dir, prompts, corr["hf"], args)
    if "bi_invariance" in args.sections:
        _section(report, "bi_invariance", out, run_bi_invariance, model_dir, prompts[:4], args)
    if "kv_cache" in args.sections:
        _section(report, "kv_cache", out, run_kv_quant, model_dir, prompts, reqs, args, run_kvgate_throughput)
    if "throughput_256" in args.sections:
        _section(report, "throughput_256req", out, run_large_batch, model_dir, args)
    for arch in args.extra_archs:
        if time.monotonic() - args.t0 > args.budget_s:
            report[f"throughput_{arch}"] = {"skipped": f"past the {args.budget_s:.0f} s budget"}
            continue
        _section(report, f"throughput_{arch}", out, run_arch_throughput, arch, args)
    out.write_text(json.dumps(report, indent=2, default=str))
    return report


def run_large_batch(model_dir: Path, args, num_requests: int = 256) -> dict:
    """The standard workload at 256 requests: kvgate, and transformers as one static batch of all of them."""
    from engine.runner.loader import load_tokenizer

    reqs = standard_workload(load_tokenizer(model_dir), num_requests, args.seed)
    kvgate = run_kvgate_throughput(model_dir, reqs, args)
    big = argparse.Namespace(**{**vars(args), "hf_batch": num_requests})
    return {"kvgate": kvgate, "hf": run_hf_throughput(model_dir, reqs, big)}


def run_arch_throughput(arch: str, args) -> dict:
    """Throughput of kvgate and transformers on another architecture's random weights (saved bfloat16),
    and with the correctness section, their float32 greedy agreement on those weights."""
    from engine.runner.loader import load_tokenizer

    model_dir = make_random_model(args.source_dir, Path(tempfile.mkdtemp(prefix=f"kvgate-{arch}-")), arch,
                                  args.seed, torch.bfloat16, args.device)
    tokenizer = load_tokenizer(model_dir)
    reqs = standard_workload(tokenizer, args.num_requests, args.seed)
    row = {"kvgate": run_kvgate_throughput(model_dir, reqs, args),
           "hf": run_hf_throughput(model_dir, reqs, args)}
    if "correctness" in args.sections:
        prompts = [r.prompt_ids
                   for r in standard_workload(tokenizer, args.prompts, args.seed + 1, (64, 400))]
        row["correctness"] = run_correctness(model_dir, prompts, args)
    return row


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="kvgate bench gpu", description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda", help="cuda, or cpu for a dry run")
    p.add_argument("--model-dir", help="Directory with the default model's config.json and tokenizer files "
                                       "(default: the prepared default model)")
    p.add_argument("--arch", default="default", choices=sorted(ARCHITECTURES))
    p.add_argument("--weights", default="random", choices=("random", "trained"),
                   help="random: seeded weights of --arch over --model-dir's config (nothing to download); "
                        "trained: --model-dir (a model directory or a .gguf) or the default model as it is")
    p.add_argument("--tiny", action="store_true", help="Tiny architecture and workload: a quick dry run")
    p.add_argument("--extra-archs", default="", help="Comma list of more architectures to time (e.g. 1b)")
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--prompts", type=int, default=8, help="Prompts of the agreement check")
    p.add_argument("--new-tokens", type=int, default=32, help="Greedy tokens per agreement prompt")
    p.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPES), help="Throughput dtype")
    p.add_argument("--hf-batch", type=int, default=64, help="transformers' static batch size")
    p.add_argument("--max-batched-tokens", type=int, default=2048)
    p.add_argument("--sections", default=",".join(SECTIONS), help=f"Comma list of {', '.join(SECTIONS)} "
                                                                  "(default_modes needs correctness)")
    p.add_argument("--budget-s", type=float, default=240.0, help="Extra architectures start only before this")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="bench-results/gpu.json")
    args = p.parse_args(argv)
    args.extra_archs = [a for a in args.extra_archs.split(",") if a]
    args.sections = [s for s in args.sections.split(",") if s]
    if unknown := set(args.sections) - set(SECTIONS):
        p.error(f"unknown sections {sorted(unknown)}; known: {SECTIONS}")
    if args.tiny:
        args.arch, args.num_requests, args.prompts, args.new_tokens = "tiny", 4, 2, 8
    args.t0 = time.monotonic()
    return args


def main(argv: list[str] | None = None) -> int:
    """Run the bench; 2 when CUDA was asked for and there is none."""
    args = parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("kvgate bench gpu: no CUDA device here (torch.cuda.is_available() is False); "
              "use --device cpu for a dry run", file=sys.stderr)
        return 2
    report = run(args)
    print(format_table(report))
    print(f"JSON: {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
