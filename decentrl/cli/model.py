"""`decentrl model init`: write a tiny chat model directory for a run config's task.

Thin entry point over decentrl/model/chat_model.py; registered on the main app in decentrl/cli/main.py.
"""

from __future__ import annotations

import json
from typing import Annotated

import typer

from decentrl.cli.loading import load_run_config

model_app = typer.Typer(help="Make model directories locally (no hub).", no_args_is_help=True)


@model_app.command("init")
def init(
    config: Annotated[str, typer.Argument(help="Run config (TOML): the tokenizer learns from its task's prompts.")],
    out: Annotated[str, typer.Option(help="Directory to write (an HF model directory).")],
    vocab_size: Annotated[int, typer.Option(min=260, max=65536, help="BPE vocabulary (256 bytes + 3 specials + merges).")] = 320,
    hidden_size: Annotated[int, typer.Option(min=16, max=4096)] = 128,
    num_layers: Annotated[int, typer.Option(min=1, max=64)] = 2,
    num_heads: Annotated[int, typer.Option(min=1, max=64)] = 4,
    intermediate_size: Annotated[int, typer.Option(min=16)] = 256,
    texts: Annotated[int, typer.Option(min=2, help="Prompts (and answers) the tokenizer is trained on, at most.")] = 20000,
    seed: Annotated[int, typer.Option(min=0, help="Seed of the initial weights.")] = 0,
    shape: Annotated[
        str | None,
        typer.Option(help="A real model's shape with random weights in bf16, e.g. smollm2-135m or qwen3-0.6b "
                     "(decentrl/model/chat_model.py SHAPES): the sizes above are ignored, the tokenizer is padded to its vocabulary."),
    ] = None,
) -> None:
    """Train a byte-level BPE tokenizer with a chat template on the task's text and save it with a
    tiny Qwen2 model: use the directory as `[model] type = "pretrained"`, `path = OUT`."""
    from decentrl.model.chat_model import SHAPES, ChatModelSpec, task_texts, write_chat_model, write_shaped_model
    from decentrl.tasks import build_task
    from decentrl.tasks.sources import AnswerSource

    if shape is not None and shape not in SHAPES:
        typer.echo(f"error: --shape {shape!r} is not a known shape: choose one of {', '.join(SHAPES)}", err=True)
        raise typer.Exit(2)
    if hidden_size % num_heads:
        typer.echo(f"error: --hidden-size ({hidden_size}) must be a multiple of --num-heads ({num_heads})", err=True)
        raise typer.Exit(2)
    task = build_task(load_run_config(config).task)
    count = min(texts, task.num_prompts)
    prompts = [task.prompt(i).text for i in range(count)]
    answers = [task.answer(i) for i in range(count)] if isinstance(task, AnswerSource) else []
    if shape is not None:
        directory = write_shaped_model(task_texts(prompts, answers), out, shape, seed=seed, tokenizer_vocab=vocab_size)
        typer.echo(f"wrote {directory} ({shape}, random weights, bf16); use it as [model] type = \"pretrained\", path = \"{out}\"")
        return
    spec = ChatModelSpec(vocab_size, hidden_size, num_layers, num_heads, intermediate_size, seed=seed)
    directory = write_chat_model(task_texts(prompts, answers), out, spec)
    learned = json.loads((directory / "config.json").read_text())["vocab_size"]
    short = f" of the {vocab_size} asked: the task's text holds no more merges" if learned < vocab_size else ""
    typer.echo(f"wrote {directory} (vocabulary {learned}{short}); use it as [model] type = \"pretrained\", path = \"{out}\"")


@model_app.command("import")
def import_(
    src: Annotated[str, typer.Argument(help="An HF model directory (config.json, weights, tokenizer) or a GGUF file.")],
    out: Annotated[str, typer.Option(help="Directory to write (must not exist, or be empty).")],
    dtype: Annotated[str, typer.Option(help="dtype of the written weights: bf16, fp32 or fp16.")] = "bf16",
) -> None:
    """Convert a model to a directory every role loads: safetensors in DTYPE, config.json without a
    quantization flag, tokenizer and chat template, generation_config.json; then load it back to
    check it. A GGUF file is dequantized by transformers (needs the gguf package: extra `model`)."""
    from decentrl.model.importing import ModelImportError, import_model

    if dtype not in ("bf16", "fp32", "fp16"):
        typer.echo(f"error: --dtype {dtype!r}: choose bf16, fp32 or fp16", err=True)
        raise typer.Exit(2)
    try:
        report = import_model(src, out, dtype)  # type: ignore[arg-type]  # checked just above
    except ModelImportError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from None
    template = "" if report.chat_template else (
        "; it has no chat template: set [prompt] template_file, or prompt.format = \"raw\""
    )
    typer.echo(
        f"wrote {report.out} ({report.architecture}, {report.parameters / 1e6:.1f}M parameters, {report.dtype}, "
        f"{report.weight_bytes / 2**20:.1f} MiB; loaded back and checked){template}; "
        f"use it as [model] type = \"pretrained\", path = \"{out}\""
    )
