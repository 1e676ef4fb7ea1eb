"""data.chat_template: named templates and Jinja files for bases without one (masks stay render-derived)."""

from __future__ import annotations

import json
import logging

import pytest
from helpers.chat import masked_runs

from core.config_loader import ConfigError
from data.template import (
    NAMED_CHAT_TEMPLATES,
    ChatTemplateError,
    render_with_assistant_mask,
    resolve_chat_template,
    set_chat_template,
)
from models.base import load_base
from models.tiny import tiny_llama, tiny_tokenizer
from train.config import load_train_config

CHAT = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Name a fruit."},
    {"role": "assistant", "content": "An apple."},
    {"role": "user", "content": "Another?"},
    {"role": "assistant", "content": "A pear,\nripe."},
]
# What each named template writes after an assistant message's content, inside the assistant's turn.
TURN_END = {"chatml": "<|im_end|>\n", "llama3": "<|eot_id|>", "gemma": "<end_of_turn>\n"}


def bare_tokenizer(extra_specials=()):
    tok = tiny_tokenizer()
    tok.chat_template = None
    if extra_specials:
        tok.add_special_tokens({"additional_special_tokens": list(extra_specials)})
    return tok


@pytest.mark.parametrize("name", sorted(NAMED_CHAT_TEMPLATES))
def test_named_templates_give_exact_assistant_masks(name):
    # Markers as real special tokens (as in a base of that family) and spelled out as bytes: both exact.
    for specials in (NAMED_CHAT_TEMPLATES[name]["markers"], ()):
        tok = bare_tokenizer(specials)
        set_chat_template(tok, name)
        ids, mask = render_with_assistant_mask(tok, CHAT)
        assert masked_runs(tok, ids, mask) == [m["content"] + TURN_END[name] for m in CHAT
                                               if m["role"] == "assistant"], (name, specials)
        unmasked = tok.decode([i for i, m in zip(ids, mask) if not m])
        assert "Be brief." in unmasked and "Another?" in unmasked and "apple" not in unmasked


def test_gemma_template_folds_system_into_first_user_turn():
    tok = bare_tokenizer(NAMED_CHAT_TEMPLATES["gemma"]["markers"])
    set_chat_template(tok, "gemma")
    text = tok.apply_chat_template(CHAT[:2], tokenize=False, add_generation_prompt=True)
    assert text.endswith("<start_of_turn>user\nBe brief.\n\nName a fruit.<end_of_turn>\n<start_of_turn>model\n")
    assert "system" not in text


def test_missing_markers_warn(caplog):
    tok = bare_tokenizer()
    with caplog.at_level(logging.WARNING, logger="data.template"):
        set_chat_template(tok, "gemma")
    assert "not single tokens" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="data.template"):
        set_chat_template(bare_tokenizer(NAMED_CHAT_TEMPLATES["gemma"]["markers"]), "gemma")
    assert caplog.text == ""


def test_jinja_file_and_bad_values(tmp_path):
    f = tmp_path / "t.jinja"
    f.write_text("{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}[assistant] {% endif %}")
    tok = bare_tokenizer()
    assert set_chat_template(tok, str(f)) == f.read_text()
    ids, mask = render_with_assistant_mask(tok, CHAT)
    assert masked_runs(tok, ids, mask) == ["An apple.\n", "A pear,\nripe.\n"]
    with pytest.raises(ValueError, match="data.chat_template='nope'.*chatml"):
        resolve_chat_template("nope")
    (tmp_path / "x.txt").write_text("hello")
    with pytest.raises(ValueError, match="not a chat template"):
        resolve_chat_template(str(tmp_path / "x.txt"))
    with pytest.raises(ConfigError, match="data.chat_template"):
        load_train_config(None, ["data.chat_template=no-such-template"])
    assert load_train_config(None, ["data.chat_template=gemma"]).data.chat_template == "gemma"


def test_no_template_errors_name_the_option(tmp_path):
    with pytest.raises(ChatTemplateError, match="data.chat_template"):
        render_with_assistant_mask(bare_tokenizer(), CHAT)
    d = tmp_path / "base"
    tiny_llama(seed=0).save_pretrained(d)
    bare_tokenizer().save_pretrained(d)
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    assert not cfg.get("chat_template") and not (d / "chat_template.jinja").exists()
    with pytest.raises(ValueError, match="data.chat_template=chatml"):
        load_base(str(d))
    base = load_base(str(d), chat_template="chatml")  # supplies the missing template
    assert base.tokenizer.chat_template == NAMED_CHAT_TEMPLATES["chatml"]["template"]
    # ... and overrides an existing one (tiny ships ChatML; ask for llama3)
    assert "<|eot_id|>" in load_base("tiny", chat_template="llama3").tokenizer.chat_template
