"""A probe's forward failing, said as whose fault it is: klpipe's own code (a bug: exit 1) or the model's (exit 2)."""

from __future__ import annotations

import traceback
from contextlib import contextmanager
from pathlib import Path

import torch

from klpipe.errors import KlpipeError, ModelError, first_line

KLPIPE_DIR = Path(__file__).resolve().parents[1]  # a failure raised in here is klpipe's bug, not the model's
TORCH_DIR = Path(torch.__file__).resolve().parent


@contextmanager
def failing_in_one_line(model):
    """Within: a probe's forward of `model`; its failure said in one line (forward_failure), the exception it
    replaces kept as its context (KLPIPE_DEBUG's traceback shows both)."""
    try:
        yield
    except KlpipeError:
        raise  # in its own words (a streamed layer's file that cannot be read)
    except Exception as exc:  # every failure of a forward, said as what it is
        raise forward_failure(model, exc) from exc  # its cause: the failure it replaces


def forward_failure(model, exc: Exception) -> Exception:
    """What a probe's forward failing with `exc` says: a klpipe bug (exit 1) where klpipe's own code raised it (an
    adapter's hook: lora.py), else the model's own forward failing (exit 2)."""
    what, name = f"{type(exc).__name__}: {first_line(exc)}", type(model).__name__
    ours = raised_in_klpipe(exc)
    if ours is not None:
        return RuntimeError(f"klpipe bug: {ours} fails in {name}'s forward on a probe sequence ({what})")
    return ModelError(f"{name}: its own forward fails on a probe sequence ({config_cause(model) or what})")


def raised_in_klpipe(exc: BaseException) -> str | None:
    """klpipe's file (`klpipe/model/lora.py`) where `exc` was raised, or None where the model's code raised it: the
    innermost frame of its traceback outside torch's own Python code (a torch call fails in its caller's line) and
    wide.py's fp64 mode (every torch call passes through it)."""
    from klpipe.model.wide import passes_through

    for frame, _ in reversed(list(traceback.walk_tb(exc.__traceback__))):
        file = Path(frame.f_code.co_filename).resolve()
        if passes_through(frame.f_code) or file.is_relative_to(TORCH_DIR):
            continue
        return str(file.relative_to(KLPIPE_DIR.parent)) if file.is_relative_to(KLPIPE_DIR) else None
    return None


def config_cause(model) -> str | None:
    """Why a model's own forward fails, in klpipe's words, where its config says so; None where it does not.

    Multi-head latent attention (DeepSeek-V2/V3, `kv_lora_rank`) expands its latents into keys and values for every
    query head, and transformers then repeats them `num_attention_heads // num_key_value_heads` times as if there
    were fewer: a config asking for fewer key/value heads than query heads fails inside sdpa with a bare shape
    mismatch ("The size of tensor a (4) must match the size of tensor b (8)")."""
    from klpipe.model.architecture import text_config

    config = text_config(model.config)
    heads, kv_heads = getattr(config, "num_attention_heads", None), getattr(config, "num_key_value_heads", None)
    if getattr(config, "kv_lora_rank", None) and heads and kv_heads and kv_heads != heads:
        return (f"its multi-head latent attention (kv_lora_rank {config.kv_lora_rank}) makes keys and values for "
                f"each of its {heads} query heads, and its config asks for {kv_heads} key/value heads, so "
                f"transformers repeats them into {heads * max(heads // kv_heads, 1)}; set num_key_value_heads to "
                f"num_attention_heads ({heads}), as DeepSeek's own configs do")
    return None
