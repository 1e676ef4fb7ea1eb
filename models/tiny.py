"""A tiny random LLaMA and a byte-level tokenizer, both built in code (no download).

Tests and the smoke recipes use these so that every stage runs in seconds on a CPU. The tokenizer
speaks the same ChatML template as SmolLM2 (`<|im_start|>role\\n ... <|im_end|>\\n`), so the chat
templating and assistant-mask code paths are the real ones.
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
