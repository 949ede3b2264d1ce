"""Loading checkpoints: GGUF and safetensors files the tests write themselves, and bad inputs."""
from __future__ import annotations

import json
from dataclasses import replace

import gguf
import numpy as np
import pytest
import torch
from tokenizers import AddedToken, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer

import enginelib
from enginelib.model import ModelConfig, Transformer
from enginelib.model.device import PackedLinear
from enginelib.model.weights import read_checkpoint, resolve

from .conftest import hf_weights

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
MERGES = [("h", "e"), ("l", "l"), ("he", "ll"), ("Ġ", "w")]
TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def vocabulary() -> list[str]:
    """Specials, the 256 byte-level symbols, then one token per merge."""
    return SPECIALS + sorted(pre_tokenizers.ByteLevel.alphabet()) + [a + b for a, b in MERGES]


def tiny_model(**changes) -> Transformer:
    torch.manual_seed(0)
    model = Transformer(ModelConfig.tiny(vocab_size=len(vocabulary()), **changes))
    for p in model.parameters():
        torch.nn.init.normal_(p, std=0.2)
    return model.eval().requires_grad_(False)


def llama_cpp_permute(w: np.ndarray, heads: int) -> np.ndarray:
    """What llama.cpp's converter does to q/k rows (so our loader must undo it)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


GGUF_NAMES = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
              "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
              "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm",
              "post_attention_layernorm": "ffn_norm"}


def write_gguf(path, model: Transformer, arch: str = "llama", layers: gguf.GGMLQuantizationType | None = None,
               embedding: gguf.GGMLQuantizationType | None = None) -> None:
    """The model as llama.cpp's converter writes it: float32, or its layers (matrices) and its embedding
    stored as ``layers`` and ``embedding`` (e.g. Q4_1 and Q8_0, as the shipped file)."""
    cfg = model.cfg
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(cfg.num_layers)
    w.add_context_length(cfg.context_length)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_heads)
    w.add_head_count_kv(cfg.num_kv_heads)
    w.add_rope_freq_base(cfg.rope_theta)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("gpt2")
    w.add_token_list(vocabulary())
    w.add_token_types([3] * len(SPECIALS) + [1] * (len(vocabulary()) - len(SPECIALS)))
    w.add_token_merges([f"{a} {b}" for a, b in MERGES])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_chat_template(TEMPLATE)
    for name, t in hf_weights(model).items():
        array = t.numpy()
        if name == "model.embed_tokens.weight":
            gname = "token_embd.weight"
        elif name == "model.norm.weight":
            gname = "output_norm.weight"
        else:
            _, _, layer, rest = name.split(".", 3)
            module, kind = rest.rsplit(".", 1)
            gname = f"blk.{layer}.{GGUF_NAMES[module]}.{kind}"
            if module == "self_attn.q_proj":
                array = llama_cpp_permute(array, cfg.num_heads)
            if module == "self_attn.k_proj":
                array = llama_cpp_permute(array, cfg.num_kv_heads)
        kind = embedding if gname == "token_embd.weight" else layers if array.ndim == 2 else None
        if kind is None:
            w.add_tensor(gname, np.ascontiguousarray(array))
        else:
            w.add_tensor(gname, gguf.quants.quantize(np.ascontiguousarray(array), kind), raw_dtype=kind)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def write_safetensors(folder, model: Transformer) -> None:
    from safetensors.torch import save_file

    cfg = model.cfg
    folder.mkdir(exist_ok=True)
    save_file(hf_weights(model), folder / "model.safetensors")
    (folder / "config.json").write_text(json.dumps(dict(
        model_type="llama", vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size, num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads, num_key_value_heads=cfg.num_kv_heads,
        rope_theta=cfg.rope_theta, rms_norm_eps=cfg.rms_norm_eps,
        max_position_embeddings=cfg.context_length, tie_word_embeddings=cfg.tie_word_embeddings)))
    vocab = {t: i for i, t in enumerate(vocabulary())}
    tok = HFTokenizer(models.BPE(vocab, MERGES))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in SPECIALS])
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps(
        dict(eos_token="<|im_end|>", bos_token="<|im_start|>", chat_template=TEMPLATE)))


@pytest.fixture
def original() -> Transformer:
    return tiny_model()


def check_same_model(loaded: Transformer, original: Transformer) -> None:
    ids = torch.randint(0, original.cfg.vocab_size, (2, 9))
    torch.testing.assert_close(loaded(ids), original(ids), atol=1e-5, rtol=1e-5)


def test_gguf_round_trip_undoes_llama_cpp_permutation(tmp_path, original):
    write_gguf(tmp_path / "tiny.gguf", original)
    model, tok = enginelib.load_model(tmp_path / "tiny.gguf", device="cpu", progress=False)
    assert model.cfg.rms_norm_eps == pytest.approx(original.cfg.rms_norm_eps)  # stored as float32
    assert replace(model.cfg, rms_norm_eps=original.cfg.rms_norm_eps) == original.cfg
    check_same_model(model, original)
    assert tok.encode("hello world<|im_end|>") == [vocabulary().index(t) for t in ("hell", "o", "Ġw", "o", "r", "l", "d")] + [2]
    assert tok.decode(tok.encode("hello world")) == "hello world"
    assert tok.eos_token_id == 2


def test_safetensors_checkpoint_loads_the_same_model_and_tokenizer(tmp_path, original):
    write_safetensors(tmp_path / "ckpt", original)
    write_gguf(tmp_path / "tiny.gguf", original)
    model, tok = enginelib.load_model(tmp_path / "ckpt", device="cpu", progress=False)
    check_same_model(model, original)
    _, gguf_tok = enginelib.load_model(tmp_path / "tiny.gguf", device="cpu", progress=False)
    text = "hello world, <|im_start|>user\nhi<|im_end|>"
    assert tok.encode(text) == gguf_tok.encode(text)
    messages = [{"role": "user", "content": "hi"}]
    assert tok.apply_chat_template(messages) == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert tok.eos_token_id == 2


def test_qwen2_style_qkv_bias_loads_from_safetensors(tmp_path):
    original = tiny_model(qkv_bias=True)
    write_safetensors(tmp_path / "ckpt", original)
    config = json.loads((tmp_path / "ckpt" / "config.json").read_text())
    (tmp_path / "ckpt" / "config.json").write_text(json.dumps({**config, "model_type": "qwen2"}))
    model, _ = enginelib.load_model(tmp_path / "ckpt", device="cpu", progress=False)
    assert model.cfg.qkv_bias
    check_same_model(model, original)


def test_packing_is_the_cpu_float32_default_where_it_pays_and_can_be_turned_off(tmp_path, original):
    write_safetensors(tmp_path / "ckpt", original)
    kinds = {pack: {type(m) for m in enginelib.load_model(tmp_path / "ckpt", device="cpu", progress=False,
                                                          pack=pack)[0].modules() if isinstance(m, torch.nn.Linear)}
             for pack in (None, False)}
    assert kinds[False] == {torch.nn.Linear}
    packs = enginelib.load_model(tmp_path / "ckpt", device="cpu", progress=False)[0].packing  # this CPU's verdict
    assert kinds[None] == ({PackedLinear} if packs and packs.pack else {torch.nn.Linear})
    assert (packs is not None) == torch.backends.mkldnn.is_available()
    with pytest.raises(ValueError, match="float32 weights on a CPU"):
        enginelib.load_model(tmp_path / "ckpt", device="cpu", dtype=torch.bfloat16, progress=False, pack=True)


def test_a_missing_path_names_what_can_be_loaded(tmp_path):
    with pytest.raises(FileNotFoundError, match="pass a .gguf file"):
        resolve(tmp_path / "nothing-here.gguf")


def test_a_file_that_is_neither_gguf_nor_safetensors_is_refused(tmp_path):
    (tmp_path / "notes.bin").write_bytes(b"hello, not a model")
    with pytest.raises(ValueError, match="neither a GGUF file"):
        read_checkpoint(tmp_path / "notes.bin")


def test_unsupported_architectures_are_named(tmp_path, original):
    write_gguf(tmp_path / "gpt2.gguf", original, arch="gpt2")
    with pytest.raises(ValueError, match="unsupported architecture 'gpt2'"):
        read_checkpoint(tmp_path / "gpt2.gguf")
    write_safetensors(tmp_path / "ckpt", original)
    config = json.loads((tmp_path / "ckpt" / "config.json").read_text())
    (tmp_path / "ckpt" / "config.json").write_text(json.dumps({**config, "model_type": "mamba"}))
    with pytest.raises(ValueError, match="unsupported architecture 'mamba'"):
        read_checkpoint(tmp_path / "ckpt")


def test_rope_scaling_is_refused_rather_than_silently_ignored(tmp_path, original):
    write_safetensors(tmp_path / "ckpt", original)
    config = json.loads((tmp_path / "ckpt" / "config.json").read_text())
    (tmp_path / "ckpt" / "config.json").write_text(json.dumps({**config, "rope_scaling": {"type": "llama3"}}))
    with pytest.raises(ValueError, match="rope_scaling"):
        read_checkpoint(tmp_path / "ckpt")


def test_unknown_model_name_lists_the_known_ones():
    with pytest.raises(ValueError, match="smollm2-135m"):
        enginelib.fetch("gpt-17")


def test_the_default_dtype_is_float32_unless_the_environment_says_otherwise(tmp_path, original, monkeypatch):
    from enginelib.model.device import default_dtype

    monkeypatch.delenv("ENGINELIB_DTYPE", raising=False)
    assert default_dtype(torch.device("cpu")) == default_dtype(torch.device("cuda")) == torch.float32
    write_safetensors(tmp_path / "ckpt", original)
    monkeypatch.setenv("ENGINELIB_DTYPE", "float16")
    assert default_dtype() == torch.float16
    model, _ = enginelib.load_model(tmp_path / "ckpt", device="cpu", progress=False)
    assert model.dtype == torch.float16 and {p.dtype for p in model.parameters()} == {torch.float16}
    monkeypatch.setenv("ENGINELIB_DTYPE", "fp8")
    with pytest.raises(ValueError, match="ENGINELIB_DTYPE='fp8'.*float32, float16, bfloat16"):
        default_dtype()


def test_loading_builds_on_meta_and_keeps_one_copy_of_each_tensor(original):
    """from_state_dict assigns the given tensors (no random init, no second copy); casting happens per tensor."""
    weights = hf_weights(original)
    norm = weights["model.norm.weight"].data_ptr()
    qkv = torch.cat([weights[f"model.layers.0.self_attn.{n}_proj.weight"] for n in "qkv"])
    model = Transformer.from_state_dict(original.cfg, weights, consume=True)
    assert not weights, "consume pops every tensor it uses"
    assert model.norm.weight.data_ptr() == norm, "the tensor itself, not a copy"
    assert torch.equal(model.layers[0].self_attn.qkv_proj.weight, qkv)
    assert model.lm_head.weight is model.embed_tokens.weight, "tied embeddings stay tied"
    assert not any(p.is_meta for p in model.parameters())
    check_same_model(model, original)
    half = Transformer.from_state_dict(original.cfg, hf_weights(original), dtype=torch.float16)
    assert {p.dtype for p in half.parameters()} == {torch.float16}
    assert half.lm_head.weight is half.embed_tokens.weight
    ids = torch.randint(0, original.cfg.vocab_size, (1, 5))
    torch.testing.assert_close(half(ids).float(), original(ids), atol=0.1, rtol=0.02)


def test_a_safetensors_checkpoint_loads_straight_into_float16(tmp_path, original):
    write_safetensors(tmp_path / "ckpt", original)
    _, weights, _ = read_checkpoint(tmp_path / "ckpt", dtype=torch.float16)
    assert {t.dtype for t in weights.values()} == {torch.float16}
    model, _ = enginelib.load_model(tmp_path / "ckpt", device="cpu", dtype=torch.float16, progress=False)
    reference = Transformer.from_state_dict(original.cfg, hf_weights(original)).half()
    ids = torch.randint(0, original.cfg.vocab_size, (2, 7))
    assert torch.equal(model(ids), reference(ids))
