"""Hugging Face ``transformers`` on the same GGUF file: the independent peer (optional)."""
from __future__ import annotations

import contextlib
import functools
import importlib
import importlib.util
import sys
import time
from unittest import mock

import torch
from tqdm import tqdm  # disable=None: bars on a terminal only, none in logs or notebooks

from enginelib.bench.results import SystemResult
from enginelib.bench.workloads import QUESTIONS, Workload, chat_prompt
from enginelib.model.tokenizer import Tokenizer


def load_hf(device: torch.device, dtype: torch.dtype):
    """transformers' own model on the same GGUF file, or None when transformers is absent."""
    try:
        import transformers
        from transformers.utils import logging as hf_logging
    except ImportError:
        return None
    from enginelib.model.weights import fetch

    path = fetch()
    bars = hf_logging.is_progress_bar_enabled()
    quiet = contextlib.nullcontext()
    if not sys.stderr.isatty():  # like our own bars: none in logs or notebooks
        hf_logging.disable_progress_bar()
        # The GGUF loader draws its own tqdm.auto bar ("Converting and de-quantizing GGUF tensors"),
        # which disable_progress_bar() does not reach and a notebook shows as a widget.
        gguf = sys.modules.get("transformers.modeling_gguf_pytorch_utils")
        if gguf is None and importlib.util.find_spec("transformers.modeling_gguf_pytorch_utils"):
            gguf = importlib.import_module("transformers.modeling_gguf_pytorch_utils")
        if gguf is not None and hasattr(gguf, "tqdm"):
            quiet = mock.patch.object(gguf, "tqdm", functools.partial(gguf.tqdm, disable=True))
    try:
        with quiet:
            hf = transformers.AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                                   dtype=dtype)
    finally:
        if bars:
            hf_logging.enable_progress_bar()
    return hf.to(device).eval()


@torch.inference_mode()
def run_hf_static(hf, tok: Tokenizer, wl: Workload, batch_size: int, device: torch.device) -> SystemResult:
    """Hugging Face ``generate``, greedy, in padded static batches of ``batch_size``."""
    result = SystemResult("hf_static", len(wl.requests), 0, 0.0, note=f"transformers generate, B={batch_size}")
    pad = tok.eos_token_id
    start = time.perf_counter()
    for i in tqdm(range(0, len(wl.requests), batch_size), desc="hf_static", leave=False, disable=None):
        group = wl.requests[i:i + batch_size]
        width = max(len(r.prompt_ids) for r in group)
        ids = torch.tensor([[pad] * (width - len(r.prompt_ids)) + r.prompt_ids for r in group], device=device)
        mask = torch.tensor([[0] * (width - len(r.prompt_ids)) + [1] * len(r.prompt_ids) for r in group],
                            device=device)
        longest = max(r.max_tokens for r in group)
        # eos_token_id=None: run to max_new_tokens as our systems do with ignore_eos (min_new_tokens
        # would instead forbid EOS and change the tokens).
        out = hf.generate(input_ids=ids, attention_mask=mask, max_new_tokens=longest, do_sample=False,
                          pad_token_id=pad, eos_token_id=None if wl.ignore_eos else tok.eos_token_id)
        if device.type == "cuda":
            torch.cuda.synchronize()
        done = time.perf_counter()
        for row, r in enumerate(group):
            mine = out[row, width:width + r.max_tokens].tolist()
            result.output_tokens += len(mine)
            result.outputs.append(mine)
            result.e2e.append(done - (start + r.arrival_s))
    result.seconds = time.perf_counter() - start
    return result


@torch.inference_mode()
def hf_single_stream(hf, tok: Tokenizer, device: torch.device, new_tokens: int) -> float:
    """transformers' single-stream decode tok/s on one chat: the yardstick for our own (the roofline section)."""
    ids = torch.tensor([chat_prompt(tok, QUESTIONS[0])], device=device)
    hf.generate(ids, max_new_tokens=2, do_sample=False)
    t = time.perf_counter()
    hf.generate(ids, max_new_tokens=new_tokens + 1, do_sample=False, eos_token_id=None)
    t1 = time.perf_counter()
    hf.generate(ids, max_new_tokens=1, do_sample=False)
    prefill = time.perf_counter() - t1
    return new_tokens / (t1 - t - prefill)
