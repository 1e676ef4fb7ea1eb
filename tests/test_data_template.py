"""Assistant-only loss masks from prefix-by-prefix chat template renders (tiny ChatML tokenizer)."""

import pytest
from helpers.chat import masked_runs
from tokenizers import processors

from data.template import ChatTemplateError, render_with_assistant_mask
from models.tiny import tiny_tokenizer

END = "<|im_end|>\n"  # what the tiny ChatML template writes after each turn's content


@pytest.fixture(scope="module")
def tok():
    return tiny_tokenizer()


CHAT = [
    {"role": "system", "content": "You answer briefly."},
    {"role": "user", "content": "Name a fruit."},
    {"role": "assistant", "content": "An apple."},
    {"role": "user", "content": "Another, in Japanese?"},
    {"role": "assistant", "content": "Ringo: りんご\nis apple too."},
]


def test_mask_is_exactly_the_assistant_turns(tok):
    ids, mask = render_with_assistant_mask(tok, CHAT)
    # input_ids are exactly the template's own tokenization of the conversation.
    assert ids == tok.apply_chat_template(CHAT, tokenize=True, return_dict=False)
    assert len(mask) == len(ids) and set(mask) <= {0, 1}
    expected = [m["content"] + END for m in CHAT if m["role"] == "assistant"]
    assert masked_runs(tok, ids, mask) == expected
    # Nothing else is supervised: the unmasked text is system + user turns and the assistant headers.
    unmasked = tok.decode([i for i, m in zip(ids, mask) if not m])
    assert unmasked.count("<|im_start|>assistant\n") == 2
    assert "You answer briefly." in unmasked and "Another, in Japanese?" in unmasked
    assert "An apple." not in unmasked


def test_single_turn_without_system(tok):
    chat = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    ids, mask = render_with_assistant_mask(tok, chat)
    assert masked_runs(tok, ids, mask) == ["hello" + END]
    # The first supervised token directly follows the header's last token.
    header = tok.apply_chat_template(chat[:1], tokenize=True, add_generation_prompt=True, return_dict=False)
    assert mask.index(1) == len(header)


def trimmed_offsets_tokenizer():
    # GPT-2 style ByteLevel post-processing with trim_offsets reports whitespace tokens as empty spans.
    tok = tiny_tokenizer()
    tok.backend_tokenizer.post_processor = processors.ByteLevel(trim_offsets=True)
    return tok


@pytest.mark.parametrize("make_tok", [tiny_tokenizer, trimmed_offsets_tokenizer])
def test_truncation_keeps_the_start_and_cuts_the_mask(make_tok):
    # With max_length the render is tokenized in pieces that stop early; it must equal the full result.
    tok = make_tok()
    full_ids, full_mask = render_with_assistant_mask(tok, CHAT)
    for max_length in (1, 10, 60, 75, 90, len(full_ids) - 3, len(full_ids), len(full_ids) + 5):
        ids, mask = render_with_assistant_mask(tok, CHAT, max_length=max_length)
        assert ids == full_ids[:max_length] and mask == full_mask[:max_length], max_length
    ids, mask = render_with_assistant_mask(tok, CHAT, max_length=10)
    assert sum(mask) == 0  # inside the system turn: nothing supervised


def test_trimmed_offsets_do_not_lose_whitespace_tokens():
    tok = trimmed_offsets_tokenizer()
    chat = [{"role": "user", "content": "Indent this"}, {"role": "assistant", "content": "  a\n\n b  c"}]
    ids, mask = render_with_assistant_mask(tok, chat)
    assert masked_runs(tok, ids, mask) == ["  a\n\n b  c" + END]


def test_consecutive_assistant_turns_exclude_the_second_header(tok):
    chat = [{"role": "user", "content": "Go"}, {"role": "assistant", "content": "one"},
            {"role": "assistant", "content": "two"}]
    ids, mask = render_with_assistant_mask(tok, chat)
    assert masked_runs(tok, ids, mask) == ["one" + END, "two" + END]


def test_control_token_in_content_is_rejected(tok):
    chat = [{"role": "user", "content": "Say <|im_end|> please"}, {"role": "assistant", "content": "no"}]
    with pytest.raises(ChatTemplateError, match="control token") as err:
        render_with_assistant_mask(tok, chat)
    assert err.value.reason == "control_token"


def test_template_that_rewrites_history_is_rejected():
    # A template that renders only the last user turn before the assistant is not prefix-stable.
    tok = tiny_tokenizer()
    tok.chat_template = (
        "{% for m in messages %}{% if loop.last or m['role'] == 'assistant' %}"
        "{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}{% endif %}{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
    )
    chat = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"},
            {"role": "user", "content": "c"}, {"role": "assistant", "content": "d"}]
    with pytest.raises(ChatTemplateError, match="prefix") as err:
        render_with_assistant_mask(tok, chat)
    assert err.value.reason == "not_prefix_stable"


def test_leading_assistant_and_missing_template_are_rejected(tok):
    with pytest.raises(ChatTemplateError, match="starts with an assistant"):
        render_with_assistant_mask(tok, [{"role": "assistant", "content": "x"},
                                         {"role": "user", "content": "y"}])
    bare = tiny_tokenizer()
    bare.chat_template = None
    with pytest.raises(ChatTemplateError, match="no chat_template"):
        render_with_assistant_mask(bare, CHAT)


@pytest.mark.slow
def test_smollm2_masks_on_real_sharegpt():
    """Real tokenizer (BPE, default system prompt in the template) on real conversations."""
    from data.sharegpt import read_sharegpt
    from models.base import load_base

    tok = load_base("smollm2").tokenizer
    conversations, _ = read_sharegpt("sharegpt", max_records=200)
    exact = checked = 0
    for messages in conversations:
        try:
            ids, mask = render_with_assistant_mask(tok, messages, max_length=4096)
        except ChatTemplateError as err:
            assert err.reason == "control_token", err  # the SmolLM2 template is prefix-stable
            continue
        assert ids == tok.apply_chat_template(messages, tokenize=True, return_dict=False)[:4096]
        runs = masked_runs(tok, ids, mask)
        replies = [m["content"] + END for m in messages if m["role"] == "assistant"]
        assert len(runs) <= len(replies)
        for run, reply in zip(runs[:-1], replies):  # the last run may be cut by max_length
            checked += 1
            # A BPE merge across the header/content edge may drop the reply's first token, never more.
            assert reply.endswith(run) and len(reply) - len(run) <= 16, (run[:60], reply[:60])
            exact += run == reply
    assert checked > 100 and exact >= 0.95 * checked
