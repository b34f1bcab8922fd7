"""`kvgate model prepare` and `kvgate generate`: the engine from the command line."""

from __future__ import annotations

import logging
import time
from typing import Annotated

import typer

from gateway.cli.app import app

model_app = typer.Typer(help="Prepare and inspect models.", no_args_is_help=True)
app.add_typer(model_app, name="model")


@model_app.command("prepare")
def prepare(model: str = typer.Option(None, help="HF dir or .gguf; default: SmolLM2-135M-Instruct"),
            cache_dir: str = typer.Option(None,
                                          help="Conversion cache (default $KVGATE_CACHE or ~/.cache/kvgate)")
            ) -> None:
    """Convert the model into the safetensors cache once and build the C++ CPU kernels (no-ops when done)."""
    from engine.errors import ModelLoadError
    from engine.runner.loader import resolve_model_dir

    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        path = resolve_model_dir(model, cache_dir)
    except ModelLoadError as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(2) from None
    typer.echo(f"model ready: {path}")
    from engine.runner.setup import prepare_cpu_kernels

    # batch_invariant mode's C++ kernel: build it now (about 30 s once) rather than at first start
    why_not = prepare_cpu_kernels(cache_dir)
    if why_not:
        typer.echo(f"warning: batch_invariant mode will be unavailable: {why_not}", err=True)
    else:
        typer.echo("C++ CPU kernels ready")


@app.command("generate")
def generate(prompt: Annotated[list[str], typer.Argument(help="One or more prompts")],
             model: str = typer.Option(None, help="HF dir or .gguf; default: SmolLM2-135M-Instruct"),
             max_tokens: int = typer.Option(64, min=1), temperature: float = typer.Option(0.0, min=0.0),
             dtype: str = typer.Option("float32", help="float32 or bfloat16"),
             chat: bool = typer.Option(False, help="Wrap each prompt in the model's chat template")) -> None:
    """Generate from prompts with the engine (no server) and print the completions."""
    from engine import EngineConfig, LLMEngine, SamplingParams

    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        engine = LLMEngine(EngineConfig(model=model, dtype=dtype, kv_cache_memory=256 << 20))
        prompts = [engine.tokenizer.apply_chat_template([{"role": "user", "content": p}], tokenize=False,
                                                        add_generation_prompt=True) if chat else p
                   for p in prompt]
        t0 = time.perf_counter()
        outs = engine.generate(prompts, SamplingParams(temperature=temperature, max_tokens=max_tokens))
    except ValueError as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(2) from None
    secs = time.perf_counter() - t0
    for p, out in zip(prompt, outs, strict=True):
        typer.echo(f"--- {p!r} [{out.finish_reason}, {len(out.token_ids)} tokens]\n{out.text}")
    typer.echo(f"({sum(len(o.token_ids) for o in outs)} tokens in {secs:.2f}s)")
