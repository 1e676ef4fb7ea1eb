"""The CUDA paths, run for real (marked `cuda`; skipped without a GPU; run by `launch/gpu_check.sh OUT tests`
on the GPU machine, docs/howto/gpu_kit.md):

- the `fast` backend's static mode with torch.compile + CUDA graphs ("reduce-overhead") against from-scratch
  transformers forwards (logits parity), and that the compiled graphs are really what runs;
- decoder losslessness on CUDA for every family's drafter on the tiny base: fp32 exact; bf16 identical or
  diverging only at a near tie of the base (checked in fp32 at the first difference);
- one-GPU DeepSpeed training with NCCL and bf16 for every family, ZeRO 0 and 2, resume included;
- the hidden-state cache built on CUDA equals the one built on the CPU.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from conftest import SMOKE_RECIPE
from helpers.compiled import assert_ran_compiled
from helpers.drafts import perturb
from helpers.trees import deepest_path, full_forward, random_tree, root_path

from eval.engine.backends.fast import FastBackend
from eval.engine.backends.hf import HFBackend
from eval.engine.decoder import autoregressive_generate, speculative_generate
from eval.engine.drafters.registry import build_drafter
from eval.harness.config import EvalConfig
from models.draft import BaseView
from models.families.ctc.model import CTCOptions
from models.families.eagle3.model import Eagle3Options
from models.families.hydra.model import HydraOptions
from models.families.ngram.drafter import NgramDrafter
from models.families.ngram.model import build_bigram_table
from models.registry import DRAFT_MODELS
from models.tiny import diverse_tiny_llama, tiny_llama
from train.config import DraftSection, family_recipes

# SPECDRAFT_CUDA_TESTS_ON_CPU=1 runs this module's logic on the CPU (no compile, gloo instead of NCCL): a check
# of the tests themselves where no GPU is available. It proves nothing about CUDA.
ON_CUDA = torch.cuda.is_available()
_ON_CPU = os.environ.get("SPECDRAFT_CUDA_TESTS_ON_CPU") == "1" and not ON_CUDA
pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not (ON_CUDA or _ON_CPU),
                                                   reason="needs a CUDA GPU (run on the GPU machine)")]

CUDA = torch.device("cuda" if ON_CUDA else "cpu")
VOCAB = 320
NEW = 32
ATOL = 1e-4  # fp32 on CUDA: cuBLAS/SDPA reduction order differs from a from-scratch forward


@pytest.fixture(scope="module")
def fp32_model():
    return diverse_tiny_llama(0).to(CUDA)


def _compiled_backend(model, max_len: int = 256) -> FastBackend:
    backend = FastBackend(model, max_len=max_len, compile=ON_CUDA, static=True)
    assert backend.static and backend.compile == ON_CUDA
    return backend


def assert_compiled(backend: FastBackend) -> None:
    """The case ran compiled, as its name says: tree steps ran through graphs dynamo compiled for this backend and
    none ran eagerly (tests/helpers/compiled.py; on the CPU rehearsal nothing compiles, so only the padding logic
    is checked). The backend raises dynamo's recompile limit for its own graphs (fast_compile.py: RECOMPILE_LIMIT)."""
    assert backend.compile == ON_CUDA and backend.static
    if ON_CUDA:
        assert_ran_compiled(backend)


@pytest.fixture
def compiled(fp32_model):
    """A compiled fast backend of the case's own (no case can change another's mode); each tree bucket it meets
    compiles once and is replayed as a CUDA graph afterwards."""
    return _compiled_backend(fp32_model)


def test_compiled_static_step_matches_from_scratch_forwards(fp32_model, compiled):
    from torch._dynamo.utils import counters

    gen = torch.Generator().manual_seed(0)
    compiled.reset(256)
    seq = torch.randint(3, VOCAB, (9,), generator=gen).tolist()
    logits, hidden = compiled.prefill(torch.tensor(seq))
    ref_logits, ref_hidden = full_forward(fp32_model, seq, device=CUDA)
    torch.testing.assert_close(logits, ref_logits, atol=ATOL, rtol=0)
    for n in (7, 5, 1, 6, 8, 1):  # buckets 8, 8, 1, 8, 8, 1: after the first of each, replays only
        if n == 6:
            graphs_before = counters["stats"]["unique_graphs"]
        tokens = torch.randint(3, VOCAB, (n,), generator=gen)
        parents, depths, mask = random_tree(n, gen)
        logits, hidden = compiled.forward_tree(tokens, depths, mask)
        assert logits.device.type == CUDA.type and logits.dtype == torch.float32 and logits.shape == (n, VOCAB)
        for i in range(n):
            path = seq + tokens[root_path(parents, i)].tolist()
            want_logits, want_hidden = full_forward(fp32_model, path, device=CUDA)
            torch.testing.assert_close(logits[i], want_logits[-1], atol=ATOL, rtol=0, msg=f"n={n} node {i}")
            torch.testing.assert_close(hidden[i], want_hidden[-1], atol=ATOL, rtol=0, msg=f"n={n} node {i}")
        keep = deepest_path(parents)  # usually not the first nodes: commit gathers
        compiled.commit(torch.tensor(keep))
        seq += tokens[keep].tolist()
    # Buckets already compiled were replayed, not recompiled (the CUDA-graph path is what ran).
    if ON_CUDA:
        assert graphs_before > 0 and counters["stats"]["unique_graphs"] == graphs_before
        # Inductor falls back to plain compiled kernels (correct, slower) when it cannot capture a graph, e.g.
        # for a mutated input it does not treat as static; the KV cache buffers must not cause that.
        assert not counters["inductor"]["cudagraph_skips"], dict(counters["inductor"])
    assert_compiled(compiled)


def test_compiled_matches_hf_backend_in_bf16(fp32_model, compiled):
    """bf16 (the GPU decode setting): compiled fast vs the hf backend on the same bf16 weights."""
    model = diverse_tiny_llama(0).to(CUDA, torch.bfloat16)
    fast, hf = _compiled_backend(model, max_len=64), HFBackend(model)
    gen = torch.Generator().manual_seed(1)
    prompt = torch.randint(3, VOCAB, (7,), generator=gen)
    for b in (fast, hf):
        b.reset(64)
    outs = [b.prefill(prompt) for b in (fast, hf)]
    for n in (4, 1, 3):
        tokens = torch.randint(3, VOCAB, (n,), generator=gen)
        parents, depths, mask = random_tree(n, gen)
        outs += [b.forward_tree(tokens, depths, mask) for b in (fast, hf)]
        for b in (fast, hf):
            b.commit(torch.tensor(root_path(parents, n - 1)))
    for (fl, _), (hl, _) in zip(outs[::2], outs[1::2]):
        # bf16 rounding of logits with std ~3: a few 1e-2; a wrong mask/position/slot is O(1).
        torch.testing.assert_close(fl, hl.float(), atol=0.15, rtol=0.02)
    assert_compiled(fast)


def test_compiled_ar_equals_hf_generate(fp32_model, compiled):
    gen = torch.Generator().manual_seed(2)
    for n in (5, 12):
        prompt = torch.randint(3, VOCAB, (n,), generator=gen)
        ours = autoregressive_generate(compiled, prompt, max_new_tokens=NEW, eos_ids=None).tokens
        with torch.no_grad():
            ref = fp32_model.generate(prompt[None].to(CUDA), max_new_tokens=NEW, do_sample=False, eos_token_id=None,
                                      pad_token_id=0, attention_mask=torch.ones(1, n, dtype=torch.long, device=CUDA))
        assert ours == ref[0, n:].tolist()
    assert_compiled(compiled)


# ---- losslessness of every family's drafter on CUDA -------------------------------------------------

FAMILIES = {  # name -> (registry family, DraftSection overrides, eval extra)
    "medusa": ("medusa", {"num_heads": 4}, {}),
    "hydra": ("hydra", {"num_heads": 4, "num_layers": 1}, {}),
    "hydra_pp": ("hydra", {"num_heads": 4, "num_layers": 4, "hydra": HydraOptions(prefix_layer=True)}, {}),
    "redrafter": ("redrafter", {"num_heads": 4}, {"beam_width": 4, "beam_length": 4}),
    "ctc": ("ctc", {"num_heads": 3, "ctc": CTCOptions(num_frames=6)}, {"ctc_num_paths": 8, "ctc_topk": 2}),
    "eagle3": ("eagle3", {"num_heads": 3, "eagle3": Eagle3Options(ttt_steps=3)}, {}),
}


def _random_drafter(name: str, model, tree: str = "auto"):
    """A family's drafter with random weights (big enough perturbations that proposals vary), on CUDA."""
    family, overrides, extra = FAMILIES[name]
    view = BaseView.from_model(model)
    torch.manual_seed(0)
    draft = perturb(DRAFT_MODELS[family].from_config(DraftSection(family=family, **overrides), view), 0.1)
    draft = draft.to(CUDA, next(model.parameters()).dtype).eval()
    drafter, _ = build_drafter(draft, {"family": family, **draft.export_config()}, EvalConfig(tree=tree, extra=extra))
    return drafter


def _prompts() -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(5)
    base = torch.randint(3, VOCAB, (6,), generator=gen)
    return [torch.randint(3, VOCAB, (7,), generator=gen), torch.cat([base, base, base[:3]])]


@pytest.mark.parametrize("name", list(FAMILIES))
def test_fp32_lossless_every_family_compiled_and_eager(fp32_model, compiled, name):
    hf = HFBackend(fp32_model)
    eager = FastBackend(fp32_model, max_len=256, compile=False)
    drafter = _random_drafter(name, fp32_model)
    for prompt in _prompts():
        want = autoregressive_generate(hf, prompt, max_new_tokens=NEW, eos_ids=None).tokens
        for backend in (compiled, eager):
            got = speculative_generate(backend, drafter, prompt, max_new_tokens=NEW, eos_ids=None)
            assert got.tokens == want, (name, backend.static)
            assert got.tree_nodes > got.base_steps  # trees were verified, not only roots
    assert_compiled(compiled)  # EAGLE-3's aux capture included: it keeps the compiled graph


@pytest.mark.parametrize("tree", ["tree16", "medusa63"])
def test_fp32_lossless_with_accepting_drafts(fp32_model, compiled, tree):
    """Noisy oracles (tests/test_eval_decoder.py) accept paths of every length: the KV gather on commit
    runs on CUDA graph memory; the 63-node tree uses the 64 bucket."""
    from test_eval_decoder import StaticNoisyOracle

    from eval.engine.tree import STATIC_TREES, StaticTree

    for prompt in _prompts():
        with torch.no_grad():
            ref = fp32_model.generate(prompt[None].to(CUDA), max_new_tokens=NEW + 8, do_sample=False,
                                      eos_token_id=None, pad_token_id=0)[0].tolist()
        drafter = StaticNoisyOracle(StaticTree(STATIC_TREES[tree]), ref, hit=0.7, seed=3)
        got = speculative_generate(compiled, drafter, prompt, max_new_tokens=NEW, eos_ids=None)
        assert got.tokens == ref[prompt.numel(): prompt.numel() + NEW]
        assert got.acceptance_length > 1.5
    assert_compiled(compiled)


@pytest.mark.parametrize("strategy", ["context", "mixed"])
def test_fp32_lossless_ngram(fp32_model, compiled, strategy):
    table = build_bigram_table(fp32_model, 6, progress=False)
    drafter = NgramDrafter(k=6, w=4, strategy=strategy, bigram_table=table)
    for prompt in _prompts():
        want = autoregressive_generate(HFBackend(fp32_model), prompt, max_new_tokens=NEW, eos_ids=None).tokens
        assert speculative_generate(compiled, drafter, prompt, max_new_tokens=NEW, eos_ids=None).tokens == want
    assert_compiled(compiled)


def _tie_aware_equal(model_fp32, prompt: torch.Tensor, got: list[int], want: list[int]) -> str:
    """'identical', or 'tie at i' if the first difference is between two tokens whose fp32 base logits differ
    by < tol after the common prefix (bf16 rounding can flip a near tie); raises on a real divergence."""
    if got == want:
        return "identical"
    i = next((j for j, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
    assert i < min(len(got), len(want)), f"one output is a prefix of the other: {len(got)} vs {len(want)} tokens"
    logits, _ = full_forward(model_fp32, prompt.tolist() + want[:i], device=CUDA)
    gap = abs(float(logits[-1, got[i]] - logits[-1, want[i]]))
    top = float(logits[-1].max())
    tol = 0.05 + abs(top) / 256
    assert gap < tol and top - max(float(logits[-1, got[i]]), float(logits[-1, want[i]])) < tol, (
        f"bf16 outputs diverge at token {i} without a tie: fp32 logits of the two tokens differ by {gap:.4f}")
    return f"tie at {i}"


@pytest.fixture
def bf16_compiled():
    """(bf16 model, a compiled fast backend of the case's own)."""
    model = diverse_tiny_llama(0).to(CUDA, torch.bfloat16)
    return model, _compiled_backend(model)


@pytest.mark.parametrize("name", list(FAMILIES))
def test_bf16_lossless_or_documented_tie(fp32_model, bf16_compiled, name):
    """bf16 on CUDA: speculative == own AR on the same compiled bf16 engine, or the first difference is a
    near tie of the fp32 base (a verify over N nodes and a 1-node step round differently). The tolerance is
    bf16's: 2^-8 of the top logit, plus 0.05."""
    model, backend = bf16_compiled
    drafter = _random_drafter(name, model)
    verdicts = []
    for prompt in _prompts():
        want = autoregressive_generate(backend, prompt, max_new_tokens=NEW, eos_ids=None).tokens
        got = speculative_generate(backend, drafter, prompt, max_new_tokens=NEW, eos_ids=None).tokens
        verdicts.append(_tie_aware_equal(fp32_model, prompt, got, want))
    print(name, verdicts)
    assert_compiled(backend)


# ---- DeepSpeed on one GPU: NCCL, bf16, ZeRO 0/2, resume ---------------------------------------------

RECIPES = family_recipes()  # every configs/*.yaml that names a draft family
# Constant LR (no warmup, no decay): a run of 2 steps resumed to 4 must equal an uninterrupted 4-step run.
_CONST = ["train.warmup_ratio=0.0", "train.min_lr_ratio=1.0", "train.precision=bf16", "train.log_every=1",
          "train.val_batches=1", "wandb.enabled=false", "train.global_batch_size=4", "train.micro_batch_size=2"]


def _train(recipe: str, run_dir: Path, *extra: str) -> Path:
    from train.config import load_train_config
    from train.loop import train

    cfg = load_train_config([recipe, SMOKE_RECIPE[1]], [f"run_dir={run_dir}", *_CONST, *extra])
    return train(cfg)


def _metrics(run_dir: Path) -> list[dict]:
    return [json.loads(ln) for ln in (run_dir / "metrics.jsonl").read_text().splitlines() if "loss" in ln]


@pytest.mark.parametrize("zero", [0, 2])
@pytest.mark.parametrize("name", list(RECIPES))
def test_deepspeed_bf16_nccl_step_and_resume(tmp_path, name, zero):
    import torch.distributed as dist

    from models.export.specdraft import read_tensors

    extra = [f"deepspeed.zero_stage={zero}"]
    if name in ("hydra_pp", "eagle3"):  # their recipes train from the hidden-state cache: build it on CUDA here
        extra += ["data.hidden_cache=auto", f"data.cache_dir={tmp_path / 'cache'}"]
    full = _train(RECIPES[name], tmp_path / "full", "train.max_steps=4", *extra)
    assert dist.get_backend() == ("nccl" if ON_CUDA else "gloo")
    export_cfg = json.loads((full / "export" / "config.json").read_text())
    assert export_cfg["train_dtype"] == "bfloat16"
    rows = _metrics(full)
    assert [r["step"] for r in rows] == [1, 2, 3, 4] and all(r["loss"] == r["loss"] for r in rows)  # no NaN
    if name in ("hydra_pp", "eagle3"):
        assert export_cfg["hidden_cache"] and any((tmp_path / "cache" / "hidden").rglob("manifest.json"))

    part = _train(RECIPES[name], tmp_path / "part", "train.max_steps=2", *extra)
    _train(RECIPES[name], part, "train.max_steps=4", "resume=auto", *extra)
    resumed = _metrics(part)
    assert [r["step"] for r in resumed] == [1, 2, 3, 4]
    # Same data order, RNG and optimizer state: the same losses and weights, up to the order of CUDA atomics
    # in backward (fp32 master weights; bf16 compute).
    for a, b in zip(rows, resumed):
        assert a["loss"] == pytest.approx(b["loss"], rel=5e-3, abs=1e-3), (a["step"], a["loss"], b["loss"])
    want, got = read_tensors(full / "export" / "model.safetensors"), read_tensors(part / "export" / "model.safetensors")
    assert set(want) == set(got)
    for k in want:
        torch.testing.assert_close(got[k].float(), want[k].float(), atol=1e-2, rtol=1e-2, msg=k)


# ---- hidden-state cache on CUDA ------------------------------------------------------------------------

def test_hidden_cache_built_on_cuda_matches_cpu(tmp_path):
    from data.dataset import collate
    from data.hidden_cache import HiddenCache, build_hidden_cache
    from models.base import HiddenStates

    gen = torch.Generator().manual_seed(7)
    rows = [{"input_ids": torch.randint(3, VOCAB, (n,), generator=gen).tolist(), "loss_mask": [0] * 3 + [1] * (n - 3)}
            for n in (17, 5, 40, 23, 9, 31)]
    caches = {}
    for name, dev in (("cpu", "cpu"), ("gpu", CUDA.type)):
        model = tiny_llama(0).to(dev)
        directory = build_hidden_cache(HiddenStates(model), rows, tmp_path / name, pad_id=0, device=torch.device(dev),
                                       micro_batch_size=4, shard_rows=4, cache_dtype="fp32")
        caches[name] = HiddenCache(directory)
    assert len(caches["gpu"]) == len(rows)
    for i, r in enumerate(rows):
        a, b = caches["cpu"][i], caches["gpu"][i]
        assert a["input_ids"].tolist() == r["input_ids"] == b["input_ids"].tolist()
        assert b["loss_mask"].tolist() == r["loss_mask"]
        torch.testing.assert_close(b["hidden"], a["hidden"], atol=ATOL, rtol=0, msg=f"row {i}")
    # And it is the right h: the last hidden state of an unpadded forward.
    batch = collate(rows[:1], 0)
    with torch.no_grad():
        h = tiny_llama(0).model(batch["input_ids"]).last_hidden_state[0]
    torch.testing.assert_close(caches["gpu"][0]["hidden"], h, atol=ATOL, rtol=0)


# ---- the bf16 verdict on the compiled paths at SmolLM2's real shape -----------------------------------------


@pytest.fixture(scope="module")
def smollm2_shaped():
    """Random-init SmolLM2-135M shape (30 layers, d 576, GQA 9/3, vocab 49152) in bf16 and fp32 on the GPU, each
    with one compiled fast backend (every bucket compiles once for the module): the widths, kernels and rounding
    of the real base, without its weights."""
    from models.random_base import random_llama
    from models.smollm2_gguf import SMOLLM2_EXPECTED

    config = {**SMOLLM2_EXPECTED, "max_position_embeddings": 2048, "rms_norm_eps": 1e-5, "rope_theta": 100000.0,
              "hidden_act": "silu", "initializer_range": 0.2}  # wide init: varied greedy text, gaps from 0 up
    out = {}
    for dtype in (torch.bfloat16, torch.float32):
        model = random_llama(config, dtype=dtype, device=CUDA, seed=1)
        out[dtype] = (model, _compiled_backend(model))  # no family drafter here: sharing cannot switch modes
    return out


def _chain_drafter(n: int, vocab: int):
    """Drafts n tokens that are mostly wrong (accepted paths of many lengths, so every verify width and commit
    shape runs)."""
    from eval.engine.drafters.drafter import Drafter
    from eval.engine.tree import chain_tree

    class Chain(Drafter):
        name, max_nodes = "chain", n + 1

        def propose(self, state):
            return chain_tree(state.root, [(state.root * 7 + k) % vocab for k in range(1, n + 1)])

    return Chain()


@pytest.mark.parametrize("chain", [3, 7])
def test_bf16_verdict_on_the_compiled_paths_at_smollm2_shape(smollm2_shaped, chain):
    """The eval's tie tolerance, measured at the verify widths the decoder uses (buckets 2, 4 and 8 here), is what
    the compiled width-1 step and the compiled verifies differ by, and every divergence of the compiled
    speculative run from the compiled AR run is a tie within it (no 'real mismatch'); in fp32 the same run is
    exact."""
    from eval.harness.lossless import MISMATCH, classify, measure_tolerance, verify_widths

    prompts = [torch.randint(0, 49152, (n,), generator=torch.Generator().manual_seed(n)) for n in (17, 40)]
    for dtype, (model, backend) in smollm2_shaped.items():
        drafter = _chain_drafter(chain, model.config.vocab_size)
        m = measure_tolerance(backend, prompts, new_tokens=16, widths=verify_widths(drafter.max_nodes))
        print(dtype, f"chain {chain}: tolerance", m["tolerance"], m["by_width"])
        for prompt in prompts:
            a = autoregressive_generate(backend, prompt, max_new_tokens=32, eos_ids=None, record_top2=True)
            s = speculative_generate(backend, drafter, prompt, max_new_tokens=32, eos_ids=None)
            d = classify(s.tokens, a.tokens, a.top2_gaps, a.runner_up, m["tolerance"], a.near_ties)
            if dtype == torch.float32:
                assert s.tokens == a.tokens, f"fp32 compiled speculative != AR at {d.position}"
            else:
                assert d.kind != MISMATCH, f"bf16: {d.to_dict()} with tolerance {m['tolerance']} ({m['by_width']})"
        assert_compiled(backend)
