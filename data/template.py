"""Render a chat with the tokenizer's own chat template and mark exactly the assistant tokens.

Why prefix by prefix: chat templates differ (ChatML, Llama, Gemma, default system prompts...), so
hard-coding separator strings breaks on the next base. Instead, for an assistant message i:

    start_i = render(messages[:i], add_generation_prompt=True)   # ends with the assistant header
    end_i   = render(messages[:i+1])                              # ends after the assistant turn

Both must be prefixes of the full render; the characters [len(start_i), len(end_i)) are the assistant's
turn: its content plus whatever the template writes after it inside that turn (e.g. `<|im_end|>\\n`),
but not the header `<|im_start|>assistant\\n`. The full render is tokenized with offsets (in pieces
that end at message boundaries, so a long chat stops once max_length tokens exist), and a token is
supervised (loss_mask 1) when its character span lies inside one of those assistant spans.
"""

from __future__ import annotations

import re

import numpy as np
from jinja2 import TemplateError


class ChatTemplateError(ValueError):
    """The conversation cannot be rendered with an exact assistant mask (skip it, do not crash).

    `reason` is a short category for skip counts: control_token, not_prefix_stable, template_rejected,
    leading_assistant, empty_turn_render, no_chat_template, empty_conversation.
    """

    def __init__(self, message: str, reason: str):
        super().__init__(message)
        self.reason = reason


def render_with_assistant_mask(tokenizer, messages: list[dict], max_length: int | None = None
                               ) -> tuple[list[int], list[int]]:
    """Return (input_ids, loss_mask), both of length min(T, max_length).

    loss_mask[t] = 1 iff token t belongs to an assistant turn (content + end-of-turn marker), else 0.
    Truncation keeps the start of the conversation (right truncation).
    Raises ChatTemplateError when the template has no chat_template, renders a prefix that is not a
    prefix of the full conversation, or a message contains one of the tokenizer's control tokens
    (it would be encoded as that control token, e.g. a fake `<|im_end|>` in the middle of a reply).
    """
    if not messages:
        raise ChatTemplateError("render_with_assistant_mask: empty conversation; pass at least one message",
                                reason="empty_conversation")
    if getattr(tokenizer, "chat_template", None) is None:
        raise ChatTemplateError(f"tokenizer {tokenizer.name_or_path!r} has no chat_template; use an "
                                "instruct/chat tokenizer or set data.chat_template (chatml, llama3, gemma "
                                "or a .jinja file)",
                                reason="no_chat_template")
    if max_length is not None and max_length < 1:
        raise ValueError(f"render_with_assistant_mask: max_length={max_length}; use None or a positive "
                         "length")
    _check_no_control_tokens(tokenizer, messages)

    full = _render(tokenizer, messages)
    # Added tokens that may start a piece (see _Pieces); lstrip/single_word ones look at the text
    # before them, so a piece must not end there.
    added = tuple(t.content for t in tokenizer.added_tokens_decoder.values()
                  if t.content and not t.lstrip and not t.single_word)
    pieces = _Pieces(tokenizer, full)
    spans = []  # (start_char, end_char) of each assistant turn inside `full`, in order
    for i, message in enumerate(messages):
        if message["role"] == "assistant":
            spans.append(_assistant_span(tokenizer, messages, i, full))
        if max_length is None or i == len(messages) - 1:
            continue  # nothing to cut short: the whole render is tokenized after the loop
        # Tokenize up to the end of message i when the next message starts with an added token; stop
        # once max_length tokens exist (later turns would be truncated away anyway).
        is_assistant = message["role"] == "assistant"
        end = spans[-1][1] if is_assistant else _prefix_end(tokenizer, messages[: i + 1], full)
        if end is not None and full.startswith(added, end):
            pieces.tokenize_until(end)
            if len(pieces.ids) >= max_length:
                break
    else:
        pieces.tokenize_until(len(full))

    input_ids, offsets = pieces.ids, pieces.offsets
    if max_length is not None:
        input_ids, offsets = input_ids[:max_length], offsets[:max_length]
    return input_ids, _mask_from_spans(offsets, spans)


class _Pieces:
    """Tokenize `full` piece by piece, each piece ending right before an added (special) token.

    Added tokens are split out of the text before pre-tokenization, so tokenizing the text between two
    of them alone gives exactly the tokens (and, shifted, the offsets) of tokenizing the whole render.
    This lets a long conversation stop being tokenized once max_length tokens exist: ShareGPT has
    chats of 20k+ tokens that train on their first 1-2k.
    """

    def __init__(self, tokenizer, full: str):
        self.tokenizer, self.full = tokenizer, full
        self.ids: list[int] = []
        self.offsets: list[tuple[int, int]] = []
        self.done = 0  # characters of `full` tokenized so far

    def tokenize_until(self, end: int) -> None:
        if end <= self.done:
            return
        # verbose=False: a long chat exceeds model_max_length before truncation; that warning is noise.
        enc = self.tokenizer(self.full[self.done:end], add_special_tokens=False, return_offsets_mapping=True,
                             verbose=False)
        shift = self.done
        self.ids.extend(enc["input_ids"])
        self.offsets.extend((a + shift, b + shift) for a, b in enc["offset_mapping"])
        self.done = end


def _assistant_span(tokenizer, messages: list[dict], i: int, full: str) -> tuple[int, int]:
    """[start, end) characters of assistant message i's turn in `full`, header excluded."""
    if i == 0:
        raise ChatTemplateError("the conversation starts with an assistant message: there is no prompt "
                                "for it and no header to exclude; drop leading assistant turns "
                                "(read_sharegpt does)", reason="leading_assistant")
    start = _render(tokenizer, messages[:i], add_generation_prompt=True)
    _check_prefix(start, full, i, "the prefix before it with add_generation_prompt=True")
    end = _render(tokenizer, messages[: i + 1])
    _check_prefix(end, full, i, "the conversation through it")
    if len(end) <= len(start):
        raise ChatTemplateError(f"assistant message {i}: the template renders nothing for it after the "
                                "generation prompt; cannot locate its tokens", reason="empty_turn_render")
    return len(start), len(end)


def _prefix_end(tokenizer, messages: list[dict], full: str) -> int | None:
    """Length of the render of `messages` if it is a prefix of `full` (a clean cut point), else None."""
    prefix = _render(tokenizer, messages)
    return len(prefix) if full.startswith(prefix) else None


def _render(tokenizer, messages: list[dict], add_generation_prompt: bool = False) -> str:
    try:
        return tokenizer.apply_chat_template(messages, tokenize=False,
                                             add_generation_prompt=add_generation_prompt)
    except TemplateError as err:  # the template's own raise_exception, e.g. "roles must alternate"
        raise ChatTemplateError(f"chat template rejected the conversation ({len(messages)} messages, roles "
                                f"{[m['role'] for m in messages][:8]}...): {err}",
                                reason="template_rejected") from err


def _check_prefix(prefix: str, full: str, i: int, what: str) -> None:
    if not full.startswith(prefix):
        at = next((j for j, (a, b) in enumerate(zip(prefix, full)) if a != b), min(len(prefix), len(full)))
        raise ChatTemplateError(
            f"chat template is not prefix-stable at assistant message {i}: rendering {what} is not a prefix "
            f"of the full conversation (first difference at char {at}: {prefix[at:at + 40]!r} vs "
            f"{full[at:at + 40]!r}). Templates that rewrite earlier turns (e.g. strip past reasoning) need "
            "a per-turn render; skip this conversation or use a prefix-stable template",
            reason="not_prefix_stable")


def _mask_from_spans(offsets: list[tuple[int, int]], spans: list[tuple[int, int]]) -> list[int]:
    """1 for tokens whose characters lie inside one assistant span [a, b), else 0.

    A token's start is taken as min(its start offset, the previous token's end): byte-level tokenizers
    with `trim_offsets` report whitespace tokens as empty spans at their end (e.g. (23, 23) for the
    space at char 22), but their tokens cover the text contiguously, so the previous end is the true
    start. Tokens straddling a span edge (a BPE merge of the header's last char with the content's
    first) stay 0: better to miss one target than to train on the header.
    """
    if not offsets or not spans:
        return [0] * len(offsets)
    tok = np.asarray(offsets, dtype=np.int64).reshape(-1, 2)  # [T, 2] (start, end) characters
    span = np.asarray(spans, dtype=np.int64)  # [S, 2], sorted and disjoint
    prev_end = np.concatenate([[0], np.maximum.accumulate(tok[:, 1])[:-1]])  # [T] end of tokens before t
    start = np.minimum(tok[:, 0], prev_end)
    k = np.searchsorted(span[:, 0], start, side="right") - 1  # [T] last span starting at or before start
    span_end = span[np.maximum(k, 0), 1]
    inside = (k >= 0) & (tok[:, 1] <= span_end) & (start < span_end)
    return inside.astype(np.int64).tolist()


def _check_no_control_tokens(tokenizer, messages: list[dict]) -> None:
    pattern = _control_token_pattern(tokenizer)
    if pattern is None:
        return
    for i, message in enumerate(messages):
        found = pattern.search(message["content"])
        if found:
            raise ChatTemplateError(f"message {i} ({message['role']}) contains the control token "
                                    f"{found.group()!r}, which would be encoded as that special token; "
                                    "skip this conversation", reason="control_token")


def _control_token_pattern(tokenizer) -> re.Pattern | None:
    # Special added tokens are split out of any text before the model sees it, so one inside a message
    # becomes a real control token (ShareGPT has replies quoting "<|endoftext|>"). A few tokens: cheap
    # to rebuild per call, and `re` caches the compiled pattern.
    tokens = sorted({t.content for t in tokenizer.added_tokens_decoder.values() if t.special and t.content},
                    key=len, reverse=True)
    return re.compile("|".join(re.escape(t) for t in tokens)) if tokens else None


# ---- data.chat_template: a named template or a Jinja file, for bases that ship none -------------

# Generic templates for base (non-instruct) checkpoints. Each writes the whole turn from the message
# list alone (no default system prompt, no date), so every prefix of a chat renders to a prefix of the
# full render and the assistant masks above stay exact. `markers` are the control strings that should
# be single tokens of the tokenizer; if they are not, the template still works (they are spelled out
# as text) but a warning says so.
NAMED_CHAT_TEMPLATES: dict[str, dict] = {
    "chatml": {
        "markers": ("<|im_start|>", "<|im_end|>"),
        "template": (
            "{% for message in messages %}"
            "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
            "{% endfor %}"
            "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
        ),
    },
    "llama3": {
        "markers": ("<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"),
        "template": (
            "{{ bos_token if bos_token else '' }}"
            "{% for message in messages %}"
            "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + message['content']"
            " + '<|eot_id|>' }}"
            "{% endfor %}"
            "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}"
            "{% endif %}"
        ),
    },
    # Gemma has no system role: a system message is prepended to the first user turn (as Gemma's own
    # template does); the assistant role is called "model".
    "gemma": {
        "markers": ("<start_of_turn>", "<end_of_turn>"),
        "template": (
            "{{ bos_token if bos_token else '' }}"
            "{% set ns = namespace(system='') %}"
            "{% for message in messages %}"
            "{% if message['role'] == 'system' %}{% set ns.system = message['content'] + '\\n\\n' %}"
            "{% else %}"
            "{% set role = 'model' if message['role'] == 'assistant' else message['role'] %}"
            "{{ '<start_of_turn>' + role + '\\n' + ns.system + message['content'] + '<end_of_turn>\\n' }}"
            "{% set ns.system = '' %}"
            "{% endif %}"
            "{% endfor %}"
            "{% if add_generation_prompt %}{{ '<start_of_turn>model\\n' }}{% endif %}"
        ),
    },
}


def resolve_chat_template(spec: str) -> str:
    """`data.chat_template` value -> Jinja source: a name in NAMED_CHAT_TEMPLATES, a template file, or
    Jinja source itself (what an export records, so eval renders prompts exactly as training did)."""
    from pathlib import Path

    if spec in NAMED_CHAT_TEMPLATES:
        return NAMED_CHAT_TEMPLATES[spec]["template"]
    if "{%" in spec or "{{" in spec:
        return spec
    path = Path(spec).expanduser()
    if not path.is_file():
        raise ValueError(f"data.chat_template={spec!r} is neither a named template "
                         f"({', '.join(NAMED_CHAT_TEMPLATES)}) nor an existing Jinja file; give one of the "
                         "names or the path of a .jinja file")
    text = path.read_text()
    if "messages" not in text:
        raise ValueError(f"data.chat_template={spec!r}: {path} does not mention `messages`, so it is not a "
                         "chat template (a Jinja file looping over `messages`, like the HF chat_template.jinja)")
    return text


def set_chat_template(tokenizer, spec: str | None) -> str | None:
    """Install `spec` (name or path; None/"" = keep the tokenizer's own) on `tokenizer`.

    Returns the installed Jinja source, or None when nothing changed. Warns (does not fail) when a
    named template's control markers are not single tokens of this tokenizer.
    """
    if not spec:
        return None
    text = resolve_chat_template(spec)
    markers = NAMED_CHAT_TEMPLATES.get(spec, {}).get("markers", ())
    missing = [m for m in markers if len(tokenizer(m, add_special_tokens=False)["input_ids"]) != 1]
    if missing:
        import logging

        logging.getLogger(__name__).warning(
            "chat template %r: markers %s are not single tokens of this tokenizer; they will be spelled out "
            "as text (works, but costs tokens and the model never saw them); a template using the "
            "tokenizer's own control tokens fits better", spec, missing)
    tokenizer.chat_template = text
    return text
