"""llama.cpp serves DFlash drafts (--spec-type draft-dflash): what we hand llama.cpp's converter (config keys,
tensor names and shapes as conversion/qwen.py DFlashModel / DSparkModel read them), the refusals, the server
arguments (fast, no llama.cpp build needed), and the GGUF export + `serve-check --engine llamacpp` end to end on
the real SmolLM2 with the real llama-server (marker `llamacpp`: `make test-llamacpp`; skipped without the build).
"""

import copy
import json
import types
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from test_llamacpp import _built

from cli.main import main
from eval.serving.llamacpp_gguf import draft_gguf, serve_args, spec_draft_n_max
from models.draft import BaseView
from models.families.dflash.export_speculators import MASK_EMBEDDING_FILE
from models.families.dflash.gguf import converter_input as dflash_converter_input
from models.families.dflash.model import DFlashDraft, DFlashLossOptions
from models.registry import FAMILIES, llamacpp_families
from models.tiny import tiny_llama_config

# What conversion/qwen.py DFlashModel.filter_tensors + gguf-py's tensor map turn each name into (after the
# converter's "model." prefix): fc -> fc, hidden_norm -> enc.output_norm, norm -> output_norm, lm_head -> output,
# layers.{i}.X -> blk.{i}.Y. A name outside this table fails the conversion ("Can not map tensor").
TOP = {"fc.weight": "fc.weight", "hidden_norm.weight": "enc.output_norm.weight", "norm.weight": "output_norm.weight",
       "lm_head.weight": "output.weight"}
LAYER = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "self_attn.q_proj": "attn_q",
         "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
         "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm", "mlp.gate_proj": "ffn_gate",
         "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}
D2T = torch.tensor([7, 3, 100, 250, 64, 9, 11, 12, 13, 200, 201, 5])  # hand-made, not sorted


def _tiny_dflash(d2t=None, learned_mask=True, **config_kw):
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    config = tiny_llama_config(num_layers=4)
    config.architectures = ["LlamaForCausalLM"]  # what a saved HF base carries; llama.cpp's check reads it
    for key, value in config_kw.items():
        setattr(config, key, value)
    base = LlamaForCausalLM(config).eval()
    v = BaseView.from_model(base)
    return DFlashDraft(BaseView(v.lm_head_weight, v.embed_weight, v.hidden_size, v.vocab_size, base, d2t),
                       num_layers=2, block_size=4, learned_mask=learned_mask).eval()


def _converter_input(draft, tmp_path):
    out = dflash_converter_input(draft, {"family": "dflash", "base_model": "tiny"}, tmp_path / "base",
                                 tmp_path / "in")
    return json.loads((out / "config.json").read_text()), load_file(out / "model.safetensors"), out


def test_dflash_is_served_by_draft_dflash_with_its_whole_block():
    assert set(llamacpp_families()) == {"eagle3", "dflash"}
    facts = FAMILIES["dflash"]
    assert "gguf" in facts.export_formats and facts.llamacpp_spec_type == "draft-dflash"
    draft = _tiny_dflash()
    # llama.cpp's block is [id_last, mask x n_max]: n_max = block_size - 1 is the block our chain runs
    assert spec_draft_n_max(draft, "dflash") == spec_draft_n_max(draft, "dflash", chain=2) == 3  # never shorter
    # EAGLE-3 drafts autoregressively: the chain our row ran (a chain of 4 from a 3-step draft), else its ttt_steps
    eagle3 = types.SimpleNamespace(ttt_steps=3)
    assert spec_draft_n_max(eagle3, "eagle3", chain=4) == 4 and spec_draft_n_max(eagle3, "eagle3") == 3
    assert serve_args("b.gguf", "d.gguf", "dflash", 3) == [
        "-m", "b.gguf", "-md", "d.gguf", "--spec-type", "draft-dflash", "--spec-draft-n-max", "3"]
    assert serve_args("b.gguf", None, "dflash", 3) == ["-m", "b.gguf"]


def test_converter_input_is_what_llamacpps_dflash_conversion_reads(tmp_path):
    draft = _tiny_dflash()
    cfg, t, out = _converter_input(draft, tmp_path)
    # conversion/__init__.py routes DFlashDraftModel to conversion/qwen.py DFlashModel (a Qwen3Model)
    assert cfg["architectures"] == ["DFlashDraftModel"] and cfg["model_type"] == "qwen3"
    d = draft.hidden_size
    assert (cfg["hidden_size"], cfg["num_hidden_layers"], cfg["num_attention_heads"], cfg["num_key_value_heads"],
            cfg["head_dim"], cfg["intermediate_size"], cfg["vocab_size"]) == (d, 2, 4, 2, 16, 2 * d, 320)
    assert cfg["rms_norm_eps"] == pytest.approx(1e-5) and cfg["max_position_embeddings"] == 512
    assert (cfg.get("rope_parameters") or {}).get("rope_theta", cfg.get("rope_theta")) == 10000.0
    assert cfg["tie_word_embeddings"] is False and not cfg.get("use_sliding_window")
    assert "is_causal" not in cfg and "draft_vocab_size" not in cfg  # full vocabulary: DFlashModel keeps our head
    assert cfg["dflash_config"] == {
        "mask_token_id": draft.mask_token_id,
        "target_layer_ids": [a - 1 for a in draft.aux_layers],  # llama.cpp adds 1 and reads those layers' INPUT
        "block_size": 4, "causal": False, "input_embedding_scale": 1.0}
    assert draft.aux_layers == [1, 2] and cfg["dflash_config"]["target_layer_ids"] == [0, 1]
    assert cfg["block_size"] == 4
    names = {f"layers.{i}.{n}.weight" for i in range(2) for n in LAYER} | set(TOP)
    assert set(t) == names
    assert t["fc.weight"].shape == (d, 2 * d) and t["lm_head.weight"].shape == (320, d)
    assert t["layers.1.self_attn.k_norm.weight"].shape == (16,) and t["layers.0.self_attn.k_proj.weight"].shape == (
        32, d)
    assert all(x.dtype == torch.float32 for x in t.values())  # --outtype casts
    torch.testing.assert_close(t["lm_head.weight"], draft.lm_head.weight)
    # DFlashModel.generate_extra_tensors checks the id against dflash_config, the shape against hidden_size,
    # and writes the draft a token_embd: the target's rows with this one replaced
    mask = torch.load(out / MASK_EMBEDDING_FILE, weights_only=True)
    assert mask["mask_token_id"] == cfg["dflash_config"]["mask_token_id"] and mask["embedding"].shape == (d,)
    torch.testing.assert_close(mask["embedding"], draft.mask_embedding.detach())


def test_frozen_mask_sends_no_mask_file(tmp_path):
    _, _, out = _converter_input(_tiny_dflash(learned_mask=False), tmp_path)
    assert not (out / MASK_EMBEDDING_FILE).exists()  # llama.cpp then embeds with the target's own rows


def test_draft_vocabulary_goes_through_the_converter_that_writes_d2t(tmp_path):
    draft = _tiny_dflash(D2T)
    cfg, t, _ = _converter_input(draft, tmp_path)
    # DFlashModel maps no d2t; its subclass DSparkModel (same `dflash` GGUF architecture) drops t2d, keeps the
    # head when draft_vocab_size < V and writes d2t + arange as absolute target ids
    assert cfg["architectures"] == ["DSparkDraftModel"]
    assert cfg["draft_vocab_size"] == 12 and cfg["vocab_size"] == 320 and cfg["sample_from_anchor"] is False
    assert cfg["dflash_config"]["target_layer_ids"] == [0, 1]
    assert set(t) == {f"layers.{i}.{n}.weight" for i in range(2) for n in LAYER} | set(TOP) | {"d2t", "t2d"}
    ids = torch.sort(D2T).values
    assert torch.equal(t["d2t"] + torch.arange(12), ids)
    torch.testing.assert_close(t["lm_head.weight"], draft.lm_head.weight[torch.argsort(D2T)])


@pytest.mark.parametrize("change,match", [
    ({"architectures": ["Qwen2ForCausalLM"]}, "does not record"),
    ({"rope_parameters": {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0}}, "RoPE type 'llama3'"),
])
def test_refuses_what_llamacpps_dflash_would_run_differently(tmp_path, change, match):
    draft = _tiny_dflash()
    draft.layer_config = copy.deepcopy(draft.layer_config)
    for key, value in change.items():
        setattr(draft.layer_config, key, value)
    with pytest.raises(ValueError, match=match) as exc:
        draft_gguf(draft, {"family": "dflash"}, tmp_path, tmp_path / "d.gguf", "f32")
    assert "--format vllm" in str(exc.value)  # the fix: the engine that serves it
    assert not (tmp_path / "d.gguf").exists()


def test_refuses_biased_layers_and_a_draft_vocabulary_of_every_token(tmp_path):
    with pytest.raises(ValueError, match="no biases.*self_attn.q_proj.bias"):
        draft_gguf(_tiny_dflash(attention_bias=True), {"family": "dflash"}, tmp_path, tmp_path / "d.gguf", "f32")
    with pytest.raises(ValueError, match="all 320 base tokens.*retrain without draft.vocab_size"):
        draft_gguf(_tiny_dflash(torch.randperm(320)), {"family": "dflash"}, tmp_path, tmp_path / "d.gguf", "f32")


# -- end to end with the real llama-server (make test-llamacpp) ---------------------------------------------------

SERVE = ["num_prompts=2", "max_new_tokens=32", "num_threads=1"]  # 1 thread: far faster on a busy CPU


def _memorised_dflash(base, prompts, steps: int = 80) -> DFlashDraft:
    """A 1-layer DFlash draft (block 4) over a draft vocabulary of the answers' tokens that half memorised the
    base's own greedy answers to `prompts` (80 Adam steps at lr 1e-3 on one thread, ~15 s; 200 steps memorise
    them fully): teacher-forced top-1 by slot 0.86 / 0.72 / 0.64 when written, so the engines must agree on
    which drafts the base rejects as well as on the many it accepts."""
    from conftest import fit_draft

    from models.base import last_hidden_and_aux
    from models.draft import DraftBatch
    from train.config import LossSection

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # many small ops: one thread is far faster on a busy CPU
    try:
        with torch.inference_mode():
            seqs = [base.model.generate(torch.tensor([p.input_ids]), max_new_tokens=40, do_sample=False)[0]
                    for p in prompts]
        ids = torch.zeros(len(seqs), max(s.numel() for s in seqs), dtype=torch.long)
        mask = torch.zeros_like(ids)
        for b, (s, p) in enumerate(zip(seqs, prompts)):
            ids[b, : s.numel()], mask[b, len(p.input_ids): s.numel()] = s, 1  # supervise the answers
        v = BaseView.from_model(base.model)
        view = BaseView(v.lm_head_weight, v.embed_weight, v.hidden_size, v.vocab_size, base.model,
                        torch.unique(ids[mask.bool()]))
        torch.manual_seed(0)
        draft = DFlashDraft(view, num_layers=1, block_size=4, num_anchors=64)
        h, aux = last_hidden_and_aux(base.model, ids, None, draft.aux_layers)
        loss_cfg = LossSection(dflash=DFlashLossOptions(position_weights="decay"))
        fit_draft(draft, [DraftBatch(h, ids, mask, aux)], view, loss_cfg, steps=steps, lr=1e-3)
    finally:
        torch.set_num_threads(threads)
    return draft.eval()


def _full_vocabulary(draft: DFlashDraft, base) -> DFlashDraft:
    """The same draft with its head over all V base tokens: the draft rows at their base ids, every other row
    small noise (below the memorised logits, and no exact ties for the engines to break differently)."""
    full = DFlashDraft(BaseView.from_model(base.model), draft.aux_layers, draft.num_layers, draft.block_size,
                       draft.mask_token_id, learned_mask=True, init_weights=False)
    state = {k: v for k, v in draft.state_dict().items() if k not in ("d2t", "lm_head.weight")}
    gen = torch.Generator().manual_seed(0)
    head = torch.randn(full.lm_head.weight.shape, generator=gen) * 1e-3
    head[draft.d2t] = draft.lm_head.weight.detach()
    missing, unexpected = full.load_state_dict({**state, "lm_head.weight": head}, strict=False)
    assert not missing and not unexpected
    return full.eval()


def _llamacpp_counts_from_ours(samples_file: Path, max_new_tokens: int, n_max: int) -> tuple[int, int]:
    """(drafted, accepted) tokens llama.cpp reports when it drafts and accepts exactly what our decoder did step by
    step (samples.jsonl accept_lengths), except that the server cuts each draft to the tokens the request has left
    minus one (server-context.cpp get_n_draft_max: n_remaining - 1) and counts only those; ours always counts the
    whole chain."""
    drafted = accepted = 0
    for line in samples_file.read_text().splitlines():
        made = 1  # the prefill's token
        for length in json.loads(line)["accept_lengths"]:
            n = min(n_max, max_new_tokens - made - 1)
            drafted, accepted = drafted + n, accepted + min(length - 1, n)
            made += length
    return drafted, accepted


def _serve_check(run: Path, name: str, capsys) -> dict:
    threads = torch.get_num_threads()
    try:
        rc = main(["serve-check", "--engine", "llamacpp", "--draft", str(run / "export"), "--timeout", "600",
                   *SERVE, "warmup_tokens=4", f"name={name}"])
    finally:
        torch.set_num_threads(threads)  # num_threads=1 sets it for the process
    out = capsys.readouterr()
    assert rc == 0, out.err[-3000:]
    return json.loads((run / "serve_check" / name / "report.json").read_text())


@pytest.mark.llamacpp
@pytest.mark.skipif(not _built(), reason="llama.cpp not built (make llamacpp)")
def test_dflash_gguf_export_and_serve_check_end_to_end(tmp_path, capsys):
    """DFlash drafts on the real SmolLM2, exported to GGUF and served by llama-server (--spec-type draft-dflash,
    the whole block) beside our fp32 decoder. A random DFlash draft proposes nothing the base accepts, so the draft
    first half memorises the base's own greedy answers to the serve-check prompts (_memorised_dflash, ~15 s): the
    base then accepts about 60 % of its drafts. llama.cpp's mean acceptance must equal ours, and its counts ours
    step by step; once through the DSparkDraftModel converter with the draft vocabulary (d2t), once with the head
    expanded to the full vocabulary (DFlashDraftModel), both with the learned mask row in the draft's token_embd.
    ~3 min on the busy 2-core CPU."""
    from eval.harness.config import load_eval_config
    from eval.harness.prompts import config_prompts
    from eval.serving.llamacpp_gguf import read_gguf_arch, read_gguf_tensors
    from models.base import load_base
    from models.export.specdraft import export_specdraft

    base = load_base("smollm2", dtype="fp32")
    prompts = config_prompts(load_eval_config(["configs/eval/mtbench.yaml"], SERVE), base.tokenizer)
    reduced = _memorised_dflash(base, prompts)
    d, n, vocab = base.model.config.hidden_size, reduced.lm_head.out_features, base.model.config.vocab_size
    for label, draft in (("reduced", reduced), ("full", _full_vocabulary(reduced, base))):
        run = tmp_path / label
        export_specdraft(draft, run / "export", "smollm2", base.fingerprint)
        report = _serve_check(run, "e2e", capsys)
        gguf = run / "serve_check" / "e2e" / "llamacpp" / "draft.gguf"  # what serve-check converted and served
        if label == "reduced":  # `specdraft export --format gguf` writes the same draft and the serving arguments
            assert main(["export", "--run", str(run), "--format", "gguf", "--out", str(run / "gguf")]) == 0
            info = json.loads((run / "gguf" / "gguf.json").read_text())
            assert info["num_speculative_tokens"] == 3 and info["llama_server_args"][-4:] == [
                "--spec-type", "draft-dflash", "--spec-draft-n-max", "3"]
            gguf = run / "gguf" / "draft.gguf"
        assert read_gguf_arch(gguf) == "dflash"
        tensors = read_gguf_tensors(gguf)
        assert tensors["fc.weight"][0] == [3 * d, d] and tensors["enc.output_norm.weight"][0] == [d]
        assert tensors["blk.0.attn_q_norm.weight"][0] == [64] and "blk.1.attn_q.weight" not in tensors
        assert tensors["token_embd.weight"][0] == [d, vocab]  # the learned mask row patched into the target's rows
        if label == "reduced":
            assert tensors["output.weight"][0] == [d, n] and tensors["d2t"] == ([n], "I64")
        else:
            assert tensors["output.weight"][0] == [d, vocab] and "d2t" not in tensors

        e, lc = report["engines"], report["llamacpp"]
        assert lc["prompt_tokens_as_sent"] and lc["identical"]["ok"] and lc["check"]["ok"], lc
        assert report["compared"] == "dflash chain of 3"
        assert e["llamacpp_draft"]["mean_accept_rate"] > 0.3  # memorised answers: many drafts are accepted
        # The check's means differ slightly (0.600 vs 0.594 when written: 39/65 and 41/69): llama.cpp cuts a
        # request's last draft to the tokens left; with that cut its counts are ours step by step, exactly.
        assert (e["llamacpp_draft"]["num_draft_tokens"], e["llamacpp_draft"]["num_accepted_tokens"]) == \
            _llamacpp_counts_from_ours(run / "serve_check" / "e2e" / "ours" / "samples.jsonl", 32, 3)
        # f32 GGUFs and our fp32 decoder: the same greedy tokens
        assert lc["ours_agreement"]["identical_prompts"] == 1.0
        assert e["llamacpp_draft"]["agreement_with_engine_ar"]["identical_prompts"] == 1.0
        with capsys.disabled():  # the measured agreement, in the test log
            print(f"\n[{label}] mean acceptance llama.cpp {e['llamacpp_draft']['mean_accept_rate']:.4f} ours "
                  f"{e['ours_draft']['mean_accept_rate']:.4f}")
