"""Tiny Hugging Face models and tokenizers built offline, for tests that need real HF checkpoints."""

from __future__ import annotations

from pathlib import Path

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def tiny_hf_model(out_dir: str | Path, arch: str = "qwen2", tied: bool = False, bias: bool = False,
                  seed: int = 0, vocab: int = 96, hidden: int = 32, layers: int = 2, heads: int = 4,
                  kv_heads: int = 2, head_dim: int | None = None, intermediate: int = 48, dtype: str = "float32",
                  **extra) -> Path:
    """A random Qwen2 / Qwen3 / Llama ForCausalLM saved as safetensors; returns the directory.

    Qwen2 always has q/k/v biases; `bias` sets Llama's attention_bias (q/k/v *and* o_proj biases).
    """
    import torch
    import transformers

    common = dict(vocab_size=vocab, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
                  num_key_value_heads=kv_heads, intermediate_size=intermediate, tie_word_embeddings=tied,
                  max_position_embeddings=256, rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=[2, 3],
                  pad_token_id=0, **extra)
    if head_dim is not None:
        common["head_dim"] = head_dim
    if arch == "qwen2":
        config, cls = transformers.Qwen2Config(rope_theta=10000.0, **common), transformers.Qwen2ForCausalLM
    elif arch == "qwen3":
        config, cls = transformers.Qwen3Config(rope_theta=1e6, **common), transformers.Qwen3ForCausalLM
    elif arch == "llama":
        config = transformers.LlamaConfig(attention_bias=bias, **{"rope_theta": 500000.0, **common})
        cls = transformers.LlamaForCausalLM
    else:
        raise ValueError(arch)
    torch.manual_seed(seed)
    model = cls(config).eval()
    with torch.no_grad():  # biases and norms start at 0 / 1; randomise them so the mapping is really exercised
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
    model = model.to(getattr(torch, dtype))
    out_dir = Path(out_dir)
    model.save_pretrained(out_dir, safe_serialization=True)
    return out_dir


def torch_logits(model_dir: str | Path, tokens, mask=None):
    """Logits [B, T, V] (numpy fp32) from transformers' PyTorch model; positions = cumsum(mask) - 1."""
    import numpy as np
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    tokens_t = torch.as_tensor(np.asarray(tokens), dtype=torch.long)
    kw = {}
    if mask is not None:
        mask_t = torch.as_tensor(np.asarray(mask), dtype=torch.long)
        kw = dict(attention_mask=mask_t, position_ids=(mask_t.cumsum(-1) - 1).clamp(min=0))
    with torch.no_grad():
        return model(tokens_t, **kw).logits.float().numpy()


def tiny_tokenizer(out_dir: str | Path) -> Path:
    """A byte-level BPE tokenizer with Qwen-like special tokens and chat template, loadable by AutoTokenizer."""
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    corpus = ["Please reason step by step, and put your final answer within \\boxed{}.",
              "What is 1 + 1? The answer is 2.", "system user assistant hello world"] * 4
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()  # byte-level BPE round-trips any text, like Qwen's tokenizer
    trainer = trainers.BpeTrainer(vocab_size=320, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(corpus, trainer)
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
        additional_special_tokens=["<|im_start|>", "<|im_end|>"])
    fast.chat_template = CHAT_TEMPLATE
    out_dir = Path(out_dir)
    fast.save_pretrained(out_dir)
    return out_dir


def byte_level_bpe(corpus: list[str], vocab_size: int, specials: list[str]):
    """A byte-level BPE tokenizers.Tokenizer trained on `corpus` (specials get ids 0, 1, ... in order)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    raw = Tokenizer(models.BPE())
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    raw.decoder = decoders.ByteLevel()
    raw.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=specials,
                                                        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return raw
