"""The demo sizes its work to the machine (cli/demo_plan.py, cli/demo_probe.py): a measured speed gives a plan within
the budget, the same speed class gives the same plan, and a user's override is kept and its cost reported."""

import pytest

from cli import demo_plan
from cli.demo_plan import (
    BUDGET_MINUTES,
    SHAPES,
    class_speed,
    estimate,
    make_plan,
    speed_class,
    train_rows_and_tokens,
)

# Probe speeds (tokens/s of the base's cache forward, [4, 256] rows) of the two kinds of 2-core CPU the demo
# was measured on (docs/lab/benchmarks.md, "The demo"): the AVX2-only box built the cache at 470 tok/s over
# 512-token rows, ~570 on the probe's rows; the AVX512-BF16 box's probe measured 1,241-1,383 tok/s in bf16 (two
# threads) in its fresh-clone runs.
AVX2_FP32 = 570.0
AVX512_BF16 = 1241.0
# One-token decoding (tok/s, own AR in the demo's dtype, 2 threads, idle): the AVX512-BF16 EPYC 31.5 in bf16; the
# AMX Xeon 22.9 in bf16, whose bulk forwards trained the head at ~9,300 tok/s (a probe of ~1,850 tok/s at the
# EPYC's training ratio).
AVX512_DECODE = 31.5
AMX_BF16, AMX_DECODE = 1850.0, 22.9
FULL = SHAPES[0]  # the largest shape
MEASURED = demo_plan.Shape(800, 512, 3, 8)  # the fixed recipe timed end to end on the AVX2-only box (21.5 min)


def _plan(tok_s, dtype, **kw):
    return make_plan(class_speed(speed_class(tok_s)), dtype, **kw)


@pytest.mark.parametrize("tok_s, dtype", [(AVX2_FP32, "fp32"), (AVX512_BF16, "bf16")])
def test_plan_fits_the_budget_on_both_kinds_of_cpu(tok_s, dtype):
    plan = _plan(tok_s, dtype)
    assert plan.fits and plan.total_s <= 60 * BUDGET_MINUTES
    assert plan.train_s / 60 < plan.max_minutes  # the training cap is slack, not what ends training
    assert plan.dtype in plan.line() and f"~{plan.total_s / 60:.1f} min in all" in plan.line()


def test_a_fast_cpu_gets_more_conversations_than_a_slow_one():
    fast = _plan(AVX512_BF16, "bf16", decode_tok_s=AVX512_DECODE).shape
    slow = _plan(AVX2_FP32, "fp32").shape
    # the head learns from the first answers: the same 128-token cut, epochs and prompts, fewer conversations
    assert slow.max_records < fast.max_records and slow.max_length == fast.max_length == 128
    assert slow.epochs == fast.epochs and slow.num_prompts == fast.num_prompts
    assert fast.max_records >= 3400  # what the EPYC was timed with (docs/quickstart.md)


def test_decoding_is_priced_from_its_own_speed():
    """AMX: bulk forwards faster than the EPYC's, one-token decoding slower. A plan sized by the bulk probe alone
    prices decoding as if it were as fast as the bulk forward; at the measured decode speed it overruns, while the
    plan made with that speed fits and still spends what the faster bulk forward affords on conversations."""
    bulk = class_speed(speed_class(AMX_BF16))
    decode = class_speed(speed_class(AMX_DECODE))
    blind = make_plan(bulk, "bf16")
    priced = make_plan(bulk, "bf16", decode_tok_s=decode)
    assert priced.fits and priced.eval_s > 1.4 * blind.eval_s  # decoding at 23 tok/s, not at the bulk's pace
    assert not estimate(blind.shape, bulk, "bf16", BUDGET_MINUTES, decode_tok_s=decode).fits
    assert priced.shape.max_records > _plan(AVX512_BF16, "bf16", decode_tok_s=AVX512_DECODE).shape.max_records
    assert f"decoding ~{decode:.0f} tok/s" in priced.line() and "decoding ~" not in blind.line()
    # `fast` may decode in fp32 where the bulk phases run in bf16 (the EPYC): decoding priced at fp32's cost
    fp32_decode = make_plan(bulk, "bf16", decode_tok_s=decode, decode_dtype="fp32")
    assert fp32_decode.eval_s > priced.eval_s and "tok/s in fp32" in fp32_decode.line()


def test_the_plan_uses_most_of_the_budget_where_the_machine_affords_it():
    """>= 80 % of the 15 minutes (12) with the set-up (~0.5-2 min) on the measured kinds: the next bigger shape
    would not fit, and the planned total is at least 11 minutes."""
    for tok_s, dtype, decode in ((AVX512_BF16, "bf16", AVX512_DECODE), (AMX_BF16, "bf16", AMX_DECODE)):
        plan = _plan(tok_s, dtype, decode_tok_s=class_speed(speed_class(decode)))
        index = SHAPES.index(plan.shape)
        assert plan.fits and index > 0  # not the largest shape: the list reaches past what these machines afford
        assert not estimate(SHAPES[index - 1], plan.tok_s, dtype, BUDGET_MINUTES, decode_tok_s=plan.decode_tok_s).fits
        assert plan.total_s / 60 >= 11.0


def test_the_full_recipe_would_not_fit_the_avx2_cpu():
    """Why the plan exists: the fixed recipe took 21.5 min on an AVX2-only CPU (cache alone 11 min)."""
    # that run trained on hard labels and had no tree sweep
    full = estimate(MEASURED, class_speed(speed_class(AVX2_FP32)), "fp32", BUDGET_MINUTES, soft_loss=False,
                    tree_sweep=False)
    assert not full.fits and 9 < full.cache_s / 60 < 13
    # the cost model against that run: 21.5 min less 1.8 min of pip set-up
    assert abs(full.total_s / 60 - 19.7) < 2.0


def test_shapes_get_cheaper_down_the_list():
    for dtype, tok_s in (("fp32", AVX2_FP32), ("bf16", AVX512_BF16)):
        totals = [estimate(s, tok_s, dtype, BUDGET_MINUTES).total_s for s in SHAPES]
        assert totals == sorted(totals, reverse=True) and len(set(totals)) == len(totals)


def test_a_slower_machine_never_gets_a_bigger_plan():
    index = [SHAPES.index(_plan(s, "fp32").shape) for s in (2000, 1000, 700, 470, 350, 250, 150)]
    assert index == sorted(index)


def test_too_slow_a_machine_gets_the_cheapest_shape_and_is_told():
    plan = _plan(60, "fp32")
    assert plan.shape == SHAPES[-1] and not plan.fits and "over the budget by" in plan.line()


def test_same_speed_class_same_plan():
    k = speed_class(AVX2_FP32)
    lo, hi = 2 ** (k / 4), 2 ** ((k + 1) / 4)
    inside = [lo * 1.001, (lo * hi) ** 0.5, hi * 0.999]
    assert {speed_class(s) for s in inside} == {k}
    assert len({_plan(s, "fp32") for s in inside}) == 1
    assert speed_class(hi * 1.001) == k + 1  # the next class up


def test_rerun_near_a_class_boundary_keeps_the_previous_class():
    k = speed_class(AVX2_FP32)
    just_above = 2 ** ((k + 1) / 4) * 1.02  # in class k+1 by 2%: a noisy rerun of a machine measured in class k
    just_below = 2 ** (k / 4) * 0.98
    assert speed_class(just_above) == k + 1 and speed_class(just_above, previous=k) == k
    assert speed_class(just_below, previous=k) == k
    assert speed_class(2 ** ((k + 2) / 4), previous=k) == k + 2  # a real change of speed still moves the class
    with pytest.raises(ValueError, match="positive"):
        speed_class(0)


def test_override_is_kept_and_its_cost_reported():
    plain = _plan(AVX2_FP32, "fp32")
    plan = _plan(AVX2_FP32, "fp32", user={"data.max_records": "5500"})
    assert plan.shape.max_records == 5500 and plan.overrides()["data.max_records"] == "5500"
    # everything it does not name stays as planned
    assert (plan.shape.max_length, plan.shape.epochs, plan.shape.num_prompts) == (
        plain.shape.max_length, plain.shape.epochs, plain.shape.num_prompts)
    extra = (plan.total_s - plain.total_s) / 60
    assert extra > 5  # 2.5x the conversations: the cache alone takes minutes more
    line = plan.line()
    assert f"your data.max_records costs +{extra:.1f} min against this CPU's plan" in line
    assert "over the budget by" in line and not plan.fits


def test_override_of_epochs_moves_the_training_cap_unless_the_cap_is_given():
    plain = _plan(AVX2_FP32, "fp32")
    more = _plan(AVX2_FP32, "fp32", user={"train.epochs": "6"})
    assert more.shape.epochs == 6 and more.max_minutes > plain.max_minutes and more.train_s / 60 < more.max_minutes
    capped = _plan(AVX2_FP32, "fp32", user={"train.epochs": "6", "train.max_minutes": "2"})
    assert capped.max_minutes == 2 and capped.overrides()["train.max_minutes"] == "2"
    assert capped.user_keys == ("train.epochs", "train.max_minutes")


def test_override_of_all_records_and_a_bad_value():
    plan = _plan(AVX2_FP32, "fp32", user={"data.max_records": "null"})  # all of the packaged ShareGPT
    assert plan.shape.max_records == demo_plan.SHAREGPT_RECORDS and "over the budget by" in plan.line()
    with pytest.raises(ValueError, match="eval.num_prompts='many'"):
        _plan(AVX2_FP32, "fp32", user={"eval.num_prompts": "many"})


def test_override_that_is_not_a_plan_key_is_ignored():
    assert _plan(AVX2_FP32, "fp32", user={"train.lr": "1e-3"}) == _plan(AVX2_FP32, "fp32")


def test_token_estimate_matches_the_measured_cache():
    """The fixed recipe's cache held 312k tokens of ~660 conversations (docs/lab/benchmarks.md, "The demo")."""
    rows, tokens = train_rows_and_tokens(800, 512)
    assert 640 <= rows <= 690 and 290_000 <= tokens <= 330_000
    assert train_rows_and_tokens(800, 256)[1] < tokens / 1.8  # half the length: about half the tokens
    assert train_rows_and_tokens(800, 2048)[1] > train_rows_and_tokens(800, 1024)[1]  # beyond the table


def test_unknown_dtype_is_a_clear_error():
    with pytest.raises(ValueError, match="fp16"):
        estimate(FULL, 500, "fp16", BUDGET_MINUTES)


def test_probe_measures_a_positive_speed_on_a_tiny_base():
    from cli.demo_probe import probe_forward_speed
    from models.base import load_base

    base = load_base("tiny")
    assert probe_forward_speed(base.model, rows=2, length=16, min_seconds=0.0, min_runs=2) > 0


def test_decode_speed_times_one_token_steps_where_no_probe_ran(tmp_path, monkeypatch):
    import torch

    from cli.demo_probe import decode_speed

    monkeypatch.setenv("SPECDRAFT_CACHE", str(tmp_path))
    tok_s, dtype, source = decode_speed("tiny", ["dtype=fp32"], torch.device("cpu"))  # explicit: no dtype probe
    assert tok_s > 0 and dtype == "fp32" and source == "timed one-token steps"


def test_speed_class_is_remembered_per_machine(tmp_path, monkeypatch):
    from cli.demo_probe import remember_class, remembered_class

    monkeypatch.setenv("SPECDRAFT_CACHE", str(tmp_path))
    assert remembered_class("cpu a fp32") is None
    remember_class("cpu a fp32", 35)
    remember_class("cpu a bf16", 42)
    assert remembered_class("cpu a fp32") == 35 and remembered_class("cpu a bf16") == 42
    (tmp_path / "demo" / "speed_classes.json").write_text("not json")
    assert remembered_class("cpu a fp32") is None  # unreadable: measured afresh, no crash


def test_demo_splits_plan_keys_from_other_overrides():
    from cli.demo import _user_plan_keys

    keys = _user_plan_keys(["data.max_records=2000", "train.lr=1e-3", "eval.num_prompts=4", "run_name=x"])
    assert keys == {"data.max_records": "2000", "eval.num_prompts": "4"}
    assert set(keys) <= set(demo_plan.PLAN_KEYS)


def test_the_soft_loss_and_the_tree_sweep_are_priced():
    """Training with the soft loss to the base costs more a token and the tree sweep adds decoding: each makes the
    same shape dearer, and the plan without them (a user's loss.teacher_weight=0 or eval.tree_choices) is cheaper."""
    tok_s = class_speed(speed_class(AVX2_FP32))
    both = estimate(FULL, tok_s, "fp32", BUDGET_MINUTES)
    hard = estimate(FULL, tok_s, "fp32", BUDGET_MINUTES, soft_loss=False)
    fixed = estimate(FULL, tok_s, "fp32", BUDGET_MINUTES, tree_sweep=False)
    assert hard.train_s < both.train_s and hard.eval_s == both.eval_s
    assert fixed.eval_s < both.eval_s and fixed.train_s == both.train_s
    assert SHAPES.index(make_plan(tok_s, "fp32", soft_loss=False, tree_sweep=False).shape) <= \
        SHAPES.index(make_plan(tok_s, "fp32").shape)
