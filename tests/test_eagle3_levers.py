"""EAGLE-3's training levers (docs/families/eagle3.md#training-levers): the distillation divergence of each TTT step
(losses/distill.py: the chunked fused path against its full-logits autograd twin, each term by its formula), the
noise on the aux hidden states (training only), the Muon optimizer (train/optimizer.py: the combined optimizer
against torch's two, a smoke run that trains and resumes), and the one-line config errors of all of them."""

from __future__ import annotations

import copy
import json
import math

import pytest
import torch
from conftest import assert_chunked_matches_reference
from helpers.drafts import four_layer_tiny_llama, random_batch_with_aux
from torch.utils._python_dispatch import TorchDispatchMode

from core.config_loader import ConfigError
from losses import fused_linear_cross_entropy
from losses.distill import TERMS, fused_linear_distill, linear_distill_reference, parse_divergence
from models.draft import BaseView
from models.export.specdraft import read_tensors
from models.families.eagle3.model import Eagle3Draft, Eagle3LossOptions
from train.config import LossSection, load_train_config
from train.optimizer import MuonWithAdamW, build_optimizer, split_for_muon

pytestmark = pytest.mark.usefixtures("one_thread")

N, D, V, D_TEACHER = 37, 16, 50, 12  # N is prime: no chunk size > 1 divides it
MIXES = [{"ce": 0.1, "tv": 0.9}, {"kl": 0.3, "rkl": 0.5, "lk_alpha": 0.2, "lk_lambda": 1.0}]


def _inputs(dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(N, D, generator=g).to(dtype)
    weight = (torch.randn(V, D, generator=g) / D**0.5).to(dtype)
    labels = torch.randint(0, V, (N,), generator=g)
    labels[::5] = -100
    teacher_hidden = torch.randn(N, D_TEACHER, generator=g).to(dtype)
    teacher_weight = (torch.randn(V, D_TEACHER, generator=g) / D_TEACHER**0.5).to(dtype)
    return hidden, weight, labels, teacher_hidden, teacher_weight


def _loss_and_grads(fn, hidden, weight, labels, th, tw, **kw):
    hidden, weight = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    loss, stats = fn(hidden, weight, labels, th, tw, **kw)
    loss.backward()
    return loss.detach(), tuple(int(s) for s in stats), hidden.grad, weight.grad


# -- the divergences --------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("weights", [{t: 1.0} for t in TERMS] + MIXES, ids=lambda w: "+".join(w))
@pytest.mark.parametrize("chunk_size", [1, 6, 64])
def test_fused_divergence_matches_the_full_logits_twin(weights, chunk_size):
    """Loss, the gradients w.r.t. hidden and the head, and the counters: fp32, the chunked closed-form gradients
    against plain autograd over all [N, V] logits."""
    inputs = _inputs()
    ref = _loss_and_grads(linear_distill_reference, *inputs, weights=weights, chunk_size=chunk_size)
    fast = _loss_and_grads(fused_linear_distill, *inputs, weights=weights, chunk_size=chunk_size)
    torch.testing.assert_close(fast[0], ref[0], rtol=1e-5, atol=1e-5 * N)  # a sum over N rows
    assert fast[1] == ref[1]  # count, top1, topk
    torch.testing.assert_close(fast[2], ref[2], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(fast[3], ref[3], rtol=1e-5, atol=1e-6)


def test_bf16_inputs_match_the_twin_loosely_and_grads_stay_bf16():
    """What a bf16 run feeds it: bf16 matmuls, fp32 softmax and gradients of the logits, bf16 gradients back."""
    inputs = _inputs(torch.bfloat16)
    weights = {"ce": 0.1, "rkl": 0.3, "tv": 0.9, "lk_alpha": 0.2, "lk_lambda": 0.5}
    ref = _loss_and_grads(linear_distill_reference, *inputs, weights=weights, chunk_size=6)
    fast = _loss_and_grads(fused_linear_distill, *inputs, weights=weights, chunk_size=6)
    assert fast[0].dtype == torch.float32 and fast[2].dtype == fast[3].dtype == torch.bfloat16
    torch.testing.assert_close(fast[0], ref[0], rtol=2e-2, atol=2e-2 * N)
    torch.testing.assert_close(fast[2], ref[2], rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(fast[3], ref[3], rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("term", [t for t in TERMS if t != "lk_lambda"])
def test_closed_form_gradients_pass_gradcheck(term):
    """Numerical differentiation of the loss value against the closed forms, fp64. Not lk_lambda: its λ is a
    stop-gradient by definition, which a finite difference of the value cannot see (its twin above checks it)."""
    g = torch.Generator().manual_seed(4)
    hidden = torch.randn(7, 4, dtype=torch.float64, generator=g, requires_grad=True)
    weight = torch.randn(9, 4, dtype=torch.float64, generator=g, requires_grad=True)
    labels = torch.tensor([0, 3, -100, 8, 1, 1, -100])
    th, tw = torch.randn(7, 3, dtype=torch.float64, generator=g), torch.randn(9, 3, dtype=torch.float64, generator=g)
    assert torch.autograd.gradcheck(lambda h, w: fused_linear_distill(h, w, labels, th, tw, weights={term: 0.7},
                                                                      chunk_size=3)[0], (hidden, weight))


def test_each_term_is_its_formula_row_by_row():
    """One valid row, p and q by hand: tv = 1 − Σ min(p, q), lk_alpha = −log(1 − tv), lk_lambda blends kl and tv by
    exp(−η α); rkl and tv vanish where the draft equals the teacher."""
    hidden, weight, _, th, tw = _inputs(torch.float64)
    labels = torch.full((N,), -100)
    labels[3] = 7
    q = torch.softmax(hidden[3] @ weight.T, -1)
    p = torch.softmax(th[3] @ tw.T, -1)
    loss = {t: float(fused_linear_distill(hidden, weight, labels, th, tw, weights={t: 1.0})[0]) for t in TERMS}
    alpha = float(torch.minimum(p, q).sum())
    assert loss["ce"] == pytest.approx(-math.log(q[7]))
    assert loss["kl"] == pytest.approx(float(-(p * q.log()).sum()))
    assert loss["rkl"] == pytest.approx(float((q * (q / p).log()).sum()))
    assert loss["tv"] == pytest.approx(1 - alpha) and loss["lk_alpha"] == pytest.approx(-math.log(alpha))
    lam = math.exp(-3.0 * alpha)
    assert loss["lk_lambda"] == pytest.approx(lam * loss["kl"] + (1 - lam) * loss["tv"])
    same = fused_linear_distill(th @ tw.T, torch.eye(V, dtype=torch.float64), labels, th, tw,  # q = p exactly
                                weights={"rkl": 1.0, "tv": 1.0})[0]
    assert abs(float(same)) < 1e-12


def test_lk_lambda_spans_kl_and_tv_with_eta():
    """η = 0 gives λ = 1 (the KL term alone); a large η gives λ ≈ 0 (TV alone); gradients follow."""
    inputs = _inputs()
    for eta, twin in ((0.0, "kl"), (200.0, "tv")):
        a = _loss_and_grads(fused_linear_distill, *inputs, weights={"lk_lambda": 1.0}, lk_eta=eta)
        b = _loss_and_grads(fused_linear_distill, *inputs, weights={twin: 1.0})
        for x, y in zip(a[2:], b[2:]):
            torch.testing.assert_close(x, y, rtol=1e-4, atol=1e-6)


def test_kl_through_the_divergence_path_equals_the_fused_soft_ce():
    """The two fast paths agree where they overlap: (1-α)·hard CE + α·soft CE, α = 0.3."""
    hidden, weight, labels, th, tw = _inputs()
    a = _loss_and_grads(fused_linear_distill, hidden, weight, labels, th, tw, weights={"ce": 0.7, "kl": 0.3})

    def soft_ce(h, w, y, t_h, t_w):
        return fused_linear_cross_entropy(h, w, y, teacher_hidden=t_h, teacher_weight=t_w, soft_weight=0.3)

    b = _loss_and_grads(soft_ce, hidden, weight, labels, th, tw)
    torch.testing.assert_close(a[0], b[0], rtol=1e-5, atol=1e-5 * N)
    assert a[1] == b[1]
    for x, y in zip(a[2:], b[2:]):
        torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-6)


class _LargestTensor(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.max_numel = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(t, torch.Tensor):
                self.max_numel = max(self.max_numel, t.numel())
        return out


def test_fused_divergence_never_holds_all_the_logits():
    hidden, weight, labels, th, tw = _inputs()
    weight.requires_grad_()
    kw = dict(weights={t: 1.0 for t in TERMS}, chunk_size=4)
    with _LargestTensor() as fast:
        fused_linear_distill(hidden.requires_grad_(), weight, labels, th, tw, **kw)[0].backward()
    with _LargestTensor() as ref:
        linear_distill_reference(hidden, weight, labels, th, tw, **kw)[0].backward()
    assert ref.max_numel >= N * V  # the check can fail: the twin does hold [N, V]
    assert fast.max_numel <= max(4 * V, V * D)  # one chunk of logits, or the [V, d] head gradient


@pytest.mark.parametrize("spec,want", [("kl", {"kl": 1.0}), ("tv", {"tv": 1.0}),
                                       ("0.1*ce + 0.9*tv", {"ce": 0.1, "tv": 0.9}),
                                       ("lk_lambda+2*rkl", {"lk_lambda": 1.0, "rkl": 2.0})])
def test_divergence_specs(spec, want):
    assert parse_divergence(spec) == want


@pytest.mark.parametrize("spec,why", [("js", "unknown term 'js'"), ("-0.1*tv", "finite and > 0"),
                                      ("0*kl+tv", "finite and > 0"), ("0.1*ce+", "unknown term ''"),
                                      ("x*tv", "no number"), ("tv+tv", "twice"), ("nan*tv", "finite"), ("", "give")])
def test_bad_divergence_specs_say_why(spec, why):
    with pytest.raises(ValueError, match=why):
        parse_divergence(spec)


# -- EAGLE-3's loss with them -----------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def base():
    return four_layer_tiny_llama()


@pytest.fixture(scope="module")
def view(base):
    return BaseView.from_model(base)


def _draft(view, **kw):
    torch.manual_seed(1)
    draft = Eagle3Draft(view, ttt_steps=3, **kw)
    with torch.no_grad():  # off the init (o_proj / down_proj zero) so every weight gets a gradient
        for p in draft.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return draft


@pytest.mark.parametrize("divergence", ["rkl", "tv", "lk_alpha", "lk_lambda", "0.1*ce+0.9*tv"])
@pytest.mark.parametrize("alpha", [1.0, 0.4])
def test_eagle3_chunked_loss_matches_reference_for_each_divergence(base, view, divergence, alpha):
    draft = _draft(view)
    fast, ref = assert_chunked_matches_reference(draft, random_batch_with_aux(base, draft), view, chunk_size=7,
                                                 teacher_weight=alpha,
                                                 eagle3=Eagle3LossOptions(divergence=divergence))
    assert [s.top1 for s in fast] == [s.top1 for s in ref]


def test_kl_is_todays_fused_soft_ce_and_the_depth_stats_stay(base, view, monkeypatch):
    """divergence=kl (the default) runs the fused soft CE exactly as before the option: the divergence path is never
    called; another divergence changes the loss but not the per-depth counts and top-1 hits (same logits)."""
    draft = _draft(view)
    batch = random_batch_with_aux(base, draft)
    default = draft.loss(batch, view, LossSection(teacher_weight=1.0))
    import models.families.eagle3.model as eagle3

    def refuse(*a, **k):
        raise AssertionError("divergence=kl must not take the divergence path")

    monkeypatch.setattr(eagle3, "fused_linear_distill", refuse)
    again = draft.loss(batch, view, LossSection(teacher_weight=1.0, eagle3=Eagle3LossOptions(divergence="kl")))
    assert torch.equal(default.loss, again.loss)
    monkeypatch.undo()
    tv = draft.loss(batch, view, LossSection(teacher_weight=1.0, eagle3=Eagle3LossOptions(divergence="tv")))
    assert float(tv.loss.detach()) != float(default.loss.detach())
    assert [(s.count, s.top1, s.topk) for s in tv.per_depth] == [(s.count, s.top1, s.topk) for s in default.per_depth]


# -- noise on the aux hidden states -----------------------------------------------------------------------------------

def test_aux_noise_is_added_in_training_only_on_fcs_input(base, view, monkeypatch):
    draft = _draft(view, aux_noise_std=0.05)
    clean = _draft(view)
    batch = random_batch_with_aux(base, draft, b=2, t=64)
    seen = []
    unroll = Eagle3Draft.ttt_unroll
    monkeypatch.setattr(Eagle3Draft, "ttt_unroll", lambda self, aux, *a, **k: seen.append(aux) or unroll(self, aux, *a,
                                                                                                          **k))
    cfg = LossSection(teacher_weight=1.0)
    draft.eval()
    state = torch.get_rng_state()
    assert torch.equal(draft.loss(batch, view, cfg).loss, clean.eval().loss(batch, view, cfg).loss)
    assert torch.equal(torch.get_rng_state(), state)  # eval mode draws nothing
    assert seen[0] is batch.aux_hidden
    draft.train()
    torch.manual_seed(7)
    first = draft.loss(batch, view, cfg).loss
    noise = seen[-1] - batch.aux_hidden  # [B, T, k·d]
    assert abs(float(noise.std()) - 0.05) < 0.005 and abs(float(noise.mean())) < 0.005
    torch.manual_seed(7)
    assert torch.equal(draft.loss(batch, view, cfg).loss, first)  # seeded by torch's RNG
    assert not torch.equal(first, clean.train().loss(batch, view, cfg).loss)


# -- Muon -------------------------------------------------------------------------------------------------------------

def test_muon_gets_the_hidden_matrices_and_adamw_the_rest(view):
    draft = Eagle3Draft(view, ttt_steps=3)
    muon, adamw = split_for_muon(draft, {view.vocab_size})
    assert sorted(n for n, _ in muon) == sorted(
        ["fc.weight"] + [f"layers.0.self_attn.{p}_proj.weight" for p in "qkvo"] +
        [f"layers.0.mlp.{p}_proj.weight" for p in ("gate", "up", "down")])
    assert {n for n, _ in adamw} == {"lm_head.weight", "norm.weight", "layers.0.input_layernorm.weight",
                                     "layers.0.hidden_norm.weight", "layers.0.post_attention_layernorm.weight"}
    medusa_head = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 50))  # [N, d] output layer by shape
    assert [n for n, _ in split_for_muon(medusa_head, {50})[0]] == ["0.weight"]


def _two_layer_net(seed):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.LayerNorm(5), torch.nn.Linear(5, 4, bias=False))


def test_combined_optimizer_steps_like_torchs_muon_and_adamw_and_round_trips_its_state():
    """The fast path (one optimizer, what DeepSpeed holds) against its twin (torch.optim.Muon and AdamW side by
    side), 3 steps on the same gradients; then a state_dict saved mid-run and loaded into a fresh optimizer continues
    exactly like the original (Muon's momentum and AdamW's moments come back)."""
    kw = dict(lr=1e-2, betas=(0.9, 0.99), weight_decay=0.1)
    net, twin = _two_layer_net(0), _two_layer_net(0)
    opt = MuonWithAdamW([net[0].weight, net[2].weight], [net[0].bias, *net[1].parameters()], muon_lr=2e-2, **kw)
    muon = torch.optim.Muon([twin[0].weight, twin[2].weight], lr=2e-2, weight_decay=0.1, momentum=0.95,
                            nesterov=True, ns_steps=5, adjust_lr_fn="match_rms_adamw")
    adamw = torch.optim.AdamW([twin[0].bias, *twin[1].parameters()], **kw)
    x = torch.randn(16, 6, generator=torch.Generator().manual_seed(3))

    def step(model, optimizers):
        for o in optimizers:
            o.zero_grad()
        model(x).square().mean().backward()
        for o in optimizers:
            o.step()

    for _ in range(3):
        step(net, [opt])
        step(twin, [muon, adamw])
    for a, b in zip(net.parameters(), twin.parameters()):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-7)
    saved = copy.deepcopy(opt.state_dict())  # as a checkpoint holds it: no tensor shared with `opt`
    resumed = _two_layer_net(9)
    resumed.load_state_dict(net.state_dict())
    opt2 = MuonWithAdamW([resumed[0].weight, resumed[2].weight], [resumed[0].bias, *resumed[1].parameters()],
                         muon_lr=2e-2, **kw)
    opt2.load_state_dict(saved)
    step(net, [opt])
    step(resumed, [opt2])
    for a, b in zip(net.parameters(), resumed.parameters()):
        assert torch.equal(a, b)


def test_build_optimizer_follows_train_optimizer(view):
    draft = Eagle3Draft(view, ttt_steps=3)
    cfg = load_train_config(["configs/eagle3.yaml"], ["train.optimizer=muon", "train.lr=1e-3", "train.muon_lr=0.02"])
    opt = build_optimizer(cfg.train, draft, {view.vocab_size})
    assert isinstance(opt, MuonWithAdamW)
    assert [(g["use_muon"], g["lr"], len(g["params"])) for g in opt.param_groups] == [(True, 0.02, 8),
                                                                                       (False, 1e-3, 5)]
    assert type(build_optimizer(load_train_config(["configs/eagle3.yaml"]).train, draft, set())) is torch.optim.AdamW


def _metrics(run_dir):
    return [json.loads(ln) for ln in (run_dir / "metrics.jsonl").read_text().splitlines() if ln.strip()]


def test_muon_smoke_run_trains_and_resumes_like_an_uninterrupted_run(tmp_path, capfd):
    """configs/eagle3.yaml + configs/smoke.yaml with train.optimizer=muon (constant LR, so a schedule over fewer steps
    is the same schedule): the loss drops over 6 steps; a run stopped at step 4 and resumed to 6 from its checkpoint
    ends with the uninterrupted run's weights, which needs the optimizer state back (Muon's momentum buffers, AdamW's
    moments)."""
    from train.loop import train

    common = ["configs/eagle3.yaml", "configs/smoke.yaml"]
    over = ["train.optimizer=muon", "train.lr=5e-3", "train.min_lr_ratio=1.0", "train.val_batches=0",
            "train.log_every=1", "train.save_every=2"]
    full, parts = tmp_path / "full", tmp_path / "parts"
    train(load_train_config(common, [*over, f"run_dir={full}", "train.max_steps=6"]))
    losses = [r["loss"] for r in _metrics(full) if "loss" in r]
    assert len(losses) == 6 and losses[-1] < losses[0]
    train(load_train_config(common, [*over, f"run_dir={parts}", "train.max_steps=4"]))
    capfd.readouterr()
    train(load_train_config(common, [*over, f"run_dir={parts}", "train.max_steps=6", "resume=auto"]))
    assert "at step 4" in capfd.readouterr().err  # the loop's log: resumed, not trained again from step 0
    a, b = read_tensors(full / "export" / "model.safetensors"), read_tensors(parts / "export" / "model.safetensors")
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=1e-5, atol=1e-6)
    # bf16: DeepSpeed wraps it in FP16_UnfusedOptimizer, whose fp32 master copies keep each matrix's shape
    bf16 = tmp_path / "bf16"
    train(load_train_config(common, [*over, f"run_dir={bf16}", "train.max_steps=4", "train.precision=bf16"]))
    losses = [r["loss"] for r in _metrics(bf16) if "loss" in r]
    assert len(losses) == 4 and all(map(math.isfinite, losses)) and losses[-1] < losses[0]
    # The checkpoints hold Muon's state: resuming them with AdamW is refused, naming the key
    with pytest.raises(ValueError, match="train.optimizer: 'muon' -> 'adamw'"):
        train(load_train_config(common, [*over[1:], f"run_dir={parts}", "train.max_steps=8", "resume=auto"]))


# -- config errors ----------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("overrides,key,hint", [
    (["loss.eagle3.divergence=js"], "loss.eagle3.divergence", "use ce, kl, rkl, tv, lk_alpha, lk_lambda"),
    (["loss.eagle3.divergence=-0.1*tv"], "loss.eagle3.divergence", "finite and > 0"),
    (["loss.eagle3.divergence=0.1*ce+0*tv"], "loss.eagle3.divergence", "finite and > 0"),
    (["loss.eagle3.divergence=tv", "loss.teacher_weight=0"], "loss.eagle3.divergence", "teacher_weight > 0"),
    (["loss.eagle3.divergence=lk_lambda", "loss.eagle3.lk_eta=-1"], "loss.eagle3.lk_eta", "0 (lk_lambda = KL)"),
    (["loss.eagle3.lk_eta=2"], "loss.eagle3.lk_eta", "only lk_lambda reads eta"),
    (["draft.eagle3.aux_noise_std=-0.05"], "draft.eagle3.aux_noise_std", "0 (none) or more"),
    (["train.optimizer=sgd"], "train.optimizer", "adamw, muon"),
    (["train.optimizer=muon", "deepspeed.zero_stage=2"], "train.optimizer", "deepspeed.zero_stage=0"),
    (["train.muon_lr=0.02"], "train.muon_lr", "only with train.optimizer=muon"),
])
def test_bad_lever_values_fail_at_load_in_one_line(overrides, key, hint):
    with pytest.raises(ConfigError) as err:
        load_train_config(["configs/eagle3.yaml"], overrides)
    msg = str(err.value)
    assert "\n" not in msg and key in msg and hint in msg, msg


def test_muon_without_torch_muon_fails_naming_the_version_and_adamw(monkeypatch):
    monkeypatch.delattr(torch.optim, "Muon")
    with pytest.raises(ConfigError) as err:
        load_train_config(["configs/eagle3.yaml"], ["train.optimizer=muon"])
    msg = str(err.value)
    assert "\n" not in msg and "train.optimizer" in msg and torch.__version__ in msg and "adamw" in msg, msg


def test_the_levers_load_together():
    cfg = load_train_config(["configs/eagle3.yaml"], ["loss.eagle3.divergence=0.1*ce+0.9*tv", "train.optimizer=muon",
                                                      "draft.eagle3.aux_noise_std=0.05", "loss.eagle3.lk_eta=2",
                                                      "loss.eagle3.divergence=lk_lambda+0.5*kl"])
    assert (cfg.loss.eagle3.divergence, cfg.loss.eagle3.lk_eta) == ("lk_lambda+0.5*kl", 2.0)
    assert (cfg.train.optimizer, cfg.draft.eagle3.aux_noise_std) == ("muon", 0.05)
