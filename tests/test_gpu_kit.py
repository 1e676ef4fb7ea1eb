"""The GPU kit's CPU-checkable parts: random-init bases (models/random_base.py) that load like any base and
keep the pack's tokenizer, and the kit's shell scripts parse. The kit itself runs end to end on CPU with
`GPU_CHECK_DRY=1 launch/gpu_check.sh OUT ...` (docs/howto/gpu_kit.md)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import torch

from data.packed import tokenizer_fingerprint
from models.base import load_base
from models.random_base import LLAMA_8B, random_llama, write_random_base
from models.tiny import tiny_llama_config, tiny_tokenizer

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def meta(tmp_path_factory):
    """A meta folder as launch/pack_data.py writes it: a base's config.json + tokenizer files, no weights."""
    d = tmp_path_factory.mktemp("meta")
    tiny_llama_config().to_json_file(d / "config.json")
    tiny_tokenizer().save_pretrained(d)
    return d


def test_written_random_base_loads_with_the_meta_tokenizer_and_overrides(meta, tmp_path):
    out = write_random_base(meta, tmp_path / "base", overrides={"num_hidden_layers": 3}, seed=1)
    base = load_base(str(out))
    assert base.model.config.num_hidden_layers == 3 and base.model.config.hidden_size == 64
    assert tokenizer_fingerprint(base.tokenizer) == tokenizer_fingerprint(tiny_tokenizer())  # packs stay valid
    again = load_base(str(write_random_base(meta, tmp_path / "again", overrides={"num_hidden_layers": 3}, seed=1)))
    other = load_base(str(write_random_base(meta, tmp_path / "other", overrides={"num_hidden_layers": 3}, seed=2)))
    assert base.fingerprint == again.fingerprint != other.fingerprint  # seeded weights
    with pytest.raises(FileNotFoundError, match="pack_data.py"):
        write_random_base(tmp_path / "nowhere", tmp_path / "x")


def test_random_llama_builds_in_the_requested_dtype_and_shape():
    small = {**LLAMA_8B, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 1,
             "num_attention_heads": 4, "num_key_value_heads": 1, "vocab_size": 512}
    model = random_llama(small, dtype=torch.bfloat16)
    assert next(model.parameters()).dtype == torch.bfloat16 and torch.get_default_dtype() == torch.float32
    assert not any(p.requires_grad for p in model.parameters())
    assert not model.config.tie_word_embeddings and model.config.num_key_value_heads == 1
    assert float(model.lm_head.weight.float().std()) > 0  # really initialised, not empty memory
    out = model(torch.tensor([[5, 6, 7]])).logits
    assert out.shape == (1, 3, 512) and torch.isfinite(out).all()


@pytest.mark.parametrize("script", ["launch/gpu_check.sh", "launch/gpu_bundle.sh"])
def test_kit_scripts_parse(script):
    proc = subprocess.run(["bash", "-n", str(REPO / script)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


def test_llama8b_shape_is_8b():
    cfg = LLAMA_8B
    d, f, layers, v = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"], cfg["vocab_size"]
    kv = d * cfg["num_key_value_heads"] // cfg["num_attention_heads"]
    per_layer = d * d * 2 + d * kv * 2 + 3 * d * f
    total = layers * per_layer + 2 * v * d
    assert 7.9e9 < total < 8.1e9, json.dumps({"params": total})


def test_regeneration_prompts_give_the_same_plans_as_their_source(tmp_path):
    """The GPU machine regenerates from .gpudata/prompts (the payoff's `prompts` stage) instead of the ShareGPT
    package: conversation i must give regeneration the same system turns and first 8 user turns as the source."""
    import importlib.util
    import lzma

    from data.self_distill import _plan
    from data.sharegpt import read_sharegpt

    spec = importlib.util.spec_from_file_location("pack_data", Path("launch/pack_data.py"))
    pack_data = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(pack_data)
    fixture = "tests/fixtures/sharegpt_tiny.json"
    made = pack_data.write_prompts(fixture, tmp_path, None)
    plain = tmp_path / "prompts.jsonl"
    plain.write_bytes(lzma.decompress(Path(made["path"]).read_bytes()))
    source, _ = read_sharegpt(fixture)
    compact, _ = read_sharegpt(str(plain))
    assert made["conversations"] == len(source) == len(compact)
    assert [_plan(c, 8) for c in compact] == [_plan(c, 8) for c in source]
