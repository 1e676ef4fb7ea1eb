"""Tiny random bases (LLaMA, Qwen2, Qwen3, Mistral, Gemma-3) and a byte-level tokenizer, built in code.

Tests and the smoke recipes use these so that every stage runs in seconds on a CPU. The tokenizer
speaks the same ChatML template as SmolLM2 (`<|im_start|>role\\n ... <|im_end|>\\n`), so the chat
templating and assistant-mask code paths are the real ones.

`tiny_model(arch)` builds one of TINY_ARCHS, each keeping what makes its family different from LLaMA
(the parts a backend or a draft could get wrong): Qwen2 q/k/v biases; Qwen3 per-head q/k RMSNorm and
an explicit head_dim; Mistral a sliding window on every layer; Gemma-3 sliding and global layers mixed
(with their own RoPE bases), sqrt(d) embedding scale, (1 + w) RMSNorms around both sublayers, q/k
norms, GELU-tanh, query_pre_attn_scalar and final logit soft-capping. Windows are tiny (16 tokens)
so that test sequences cross them: a window longer than every sequence would leave its logic unused.
"""

from __future__ import annotations

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

# Special tokens first so their ids are stable: 0 = <|endoftext|>, 1 = <|im_start|>, 2 = <|im_end|>.
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
TINY_VOCAB_SIZE = 320  # 3 specials + 256 byte tokens, padded up to a multiple of 64

# SmolLM2's template minus its default system prompt (keeps tiny sequences short).
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def tiny_tokenizer() -> PreTrainedTokenizerFast:
    """Byte-level tokenizer: every byte is one token, plus the three ChatML specials."""
    byte_to_unicode = pre_tokenizers.ByteLevel.alphabet()  # the 256 printable stand-ins for bytes
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    for ch in sorted(byte_to_unicode):
        vocab[ch] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(SPECIAL_TOKENS)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<|im_start|>",
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        unk_token=None,
    )
    fast.chat_template = CHATML_TEMPLATE
    return fast


def tiny_llama_config(vocab_size: int = TINY_VOCAB_SIZE, hidden_size: int = 64, num_layers: int = 2,
                      num_heads: int = 4, num_kv_heads: int = 2, max_positions: int = 512) -> LlamaConfig:
    """SmolLM2-shaped (GQA, tied embeddings, RoPE) but tiny."""
    return LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=hidden_size * 2,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        max_position_embeddings=max_positions,
        tie_word_embeddings=True,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )


TINY_ARCHS = ("llama", "qwen2", "qwen3", "mistral", "gemma3")
TINY_WINDOW = 16  # sliding window of tiny Mistral / Gemma-3 layers


def tiny_config(arch: str = "llama", sliding_window: int = TINY_WINDOW, **overrides):
    """Config of a tiny `arch` (one of TINY_ARCHS): d=64, 4 query / 2 KV heads, vocab 320, tied
    embeddings, like tiny_llama_config; `overrides` go to the config class."""
    common = dict(vocab_size=TINY_VOCAB_SIZE, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=512, tie_word_embeddings=True,
                  rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    if arch == "llama":
        return tiny_llama_config(**overrides)
    if arch == "qwen2":  # q/k/v projections carry biases (always, in Qwen2)
        from transformers import Qwen2Config

        # sliding_window applies only with use_sliding_window=True (layers >= max_window_layers slide)
        return Qwen2Config(**{**common, "num_hidden_layers": 2, "sliding_window": sliding_window, **overrides})
    if arch == "qwen3":  # q/k RMSNorm per head; head_dim is its own field (not d / heads)
        from transformers import Qwen3Config

        return Qwen3Config(**{**common, "num_hidden_layers": 2, "head_dim": 32, "sliding_window": sliding_window,
                              **overrides})
    if arch == "mistral":  # every layer attends over the last `sliding_window` positions only
        from transformers import MistralConfig

        return MistralConfig(**{**common, "num_hidden_layers": 2, "sliding_window": sliding_window, **overrides})
    if arch == "gemma3":
        from transformers import Gemma3TextConfig

        layer_types = ["sliding_attention", "full_attention", "sliding_attention"]
        return Gemma3TextConfig(**{
            **common, "num_hidden_layers": 3, "head_dim": 16, "layer_types": layer_types,
            "sliding_window": sliding_window, "query_pre_attn_scalar": 16, "final_logit_softcapping": 30.0,
            "rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                "sliding_attention": {"rope_type": "default", "rope_theta": 1000.0}},
            **overrides})
    raise ValueError(f"unknown tiny architecture {arch!r}; use one of {', '.join(TINY_ARCHS)}")


def tiny_model(arch: str = "llama", seed: int = 0, diverse: bool = False, std: float = 0.2,
               **config_overrides):
    """A randomly initialised tiny `arch` causal LM in fp32, eval mode, deterministic for a seed.
    diverse=True redraws every matrix at `std` (see diverse_tiny_llama)."""
    from transformers import AutoModelForCausalLM

    config = tiny_config(arch, **config_overrides)
    config._attn_implementation = "sdpa"
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    if diverse:
        gen = torch.Generator().manual_seed(seed + 1)
        emb = model.get_input_embeddings().weight
        # Gemma multiplies the embedding by sqrt(d): draw it that much smaller so the residual stream
        # starts at the same scale (else the tied lm_head saturates the soft-cap: one token forever).
        emb_std = std / config.hidden_size ** 0.5 if config.model_type.startswith("gemma") else std
        with torch.no_grad():
            for p in model.parameters():
                if p.ndim == 2:
                    p.copy_(torch.randn(p.shape, generator=gen) * (emb_std if p is emb else std))
    return model.eval()


def tiny_llama(seed: int = 0, **overrides) -> LlamaForCausalLM:
    """A randomly initialised tiny LLaMA in fp32, eval mode, deterministic for a given seed."""
    config = tiny_llama_config(**overrides)
    config._attn_implementation = "sdpa"
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
    return model.eval()


def diverse_tiny_llama(seed: int = 0, std: float = 0.2) -> LlamaForCausalLM:
    """tiny_llama with every matrix redrawn at `std`: the default init's greedy output repeats one token
    forever (tied embeddings echo the input), which would make losslessness checks trivial; these
    weights give varied continuations with clear top-k gaps."""
    model = tiny_llama(seed)
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for p in model.parameters():
            if p.ndim == 2:
                p.copy_(torch.randn(p.shape, generator=gen) * std)
    return model
