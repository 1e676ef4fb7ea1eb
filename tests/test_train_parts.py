"""Pieces of the training loop that need no engine: data order, LR schedule, launch script names."""

from pathlib import Path

import pytest

from train.data_order import DataOrder
from train.schedule import warmup_cosine


def test_data_order_covers_each_row_once_per_epoch_and_splits_ranks():
    n, g, m = 23, 8, 2
    one = DataOrder(n, g, m, rank=0, world_size=1, seed=3)
    assert one.steps_per_epoch == 2
    seen = [i for s in range(one.steps_per_epoch) for mb in one.micro_batches(s) for i in mb]
    assert len(seen) == len(set(seen)) == 16  # no repeats within an epoch, ragged tail dropped
    # Two ranks together read exactly the rows one rank reads with the same global batch.
    two = [DataOrder(n, g, m, rank=r, world_size=2, seed=3) for r in (0, 1)]
    for step in range(5):
        rows_1 = [i for mb in one.micro_batches(step) for i in mb]
        rows_2 = [i for o in two for mb in o.micro_batches(step) for i in mb]
        assert rows_1 == rows_2
    # A new epoch reshuffles, and the order is a pure function of (seed, step).
    assert one.micro_batches(0) != one.micro_batches(2)
    assert DataOrder(n, g, m, 0, 1, seed=3).micro_batches(7) == one.micro_batches(7)


def test_data_order_rejects_too_little_data():
    with pytest.raises(ValueError, match="global_batch_size"):
        DataOrder(3, 8, 2, 0, 1, 0)


def test_warmup_cosine_shape():
    total, warm, floor = 100, 10, 0.1
    mult = [warmup_cosine(s, total, warm, floor) for s in range(total + 1)]
    assert mult[0] == pytest.approx(0.1) and mult[9] == pytest.approx(1.0)  # linear warmup to peak
    assert all(a >= b - 1e-12 for a, b in zip(mult[10:], mult[11:]))  # then monotone decay
    assert mult[55] == pytest.approx(floor + (1 - floor) * 0.5)  # cosine midpoint
    assert mult[100] == pytest.approx(floor)


def test_no_launch_script_shadows_a_package():
    packages = {"train", "models", "data", "losses", "eval"}
    scripts = {p.stem for p in Path("launch").glob("*.py")}
    assert scripts and not scripts & packages, f"launch/ scripts shadow packages: {scripts & packages}"


def test_time_budgeted_schedule_anneals_by_the_deadline():
    from train.schedule import TimeBudgetedSchedule

    plain = TimeBudgetedSchedule(100, 10, 0.1)  # no budget: exactly warmup_cosine
    assert [plain(s) for s in range(101)] == [warmup_cosine(s, 100, 10, 0.1) for s in range(101)]
    budgeted = TimeBudgetedSchedule(100, 10, 0.1, budget_s=60.0)
    budgeted.start(now=1000.0)
    # Few steps done but half the time used: the LR is where step 50 of 100 would put it.
    assert budgeted(5, now=1030.0) == pytest.approx(warmup_cosine(50, 100, 10, 0.1))
    # Past the deadline: the floor, not a high LR.
    assert budgeted(7, now=1100.0) == pytest.approx(0.1)
    # Faster than the clock: steps lead.
    assert budgeted(80, now=1001.0) == pytest.approx(warmup_cosine(80, 100, 10, 0.1))


def test_latest_checkpoint_falls_back_to_newest_finished_step(tmp_path):
    from train.checkpoint import latest_checkpoint

    assert latest_checkpoint(tmp_path) is None
    (tmp_path / "step00000002").mkdir()
    (tmp_path / "step00000004").mkdir()
    (tmp_path / ".partial" / "step00000006").mkdir(parents=True)  # half-written: never chosen
    assert latest_checkpoint(tmp_path).name == "step00000004"
    (tmp_path / "latest").write_text("step00000002")
    assert latest_checkpoint(tmp_path).name == "step00000002"  # the pointer wins while its target exists
    (tmp_path / "latest").write_text("step00000009")  # dangling pointer (killed mid re-save)
    assert latest_checkpoint(tmp_path).name == "step00000004"


def test_schedule_configure_replaces_restored_fields():
    from train.schedule import TimeBudgetedSchedule

    sched = TimeBudgetedSchedule(100, 5, 0.1, budget_s=540)
    sched.__dict__.update({"total": 50, "warmup": 1, "budget_s": 10})  # what LambdaLR.load_state_dict does
    sched.configure(200, 10, 0.1, 0.0)
    assert sched(150) == pytest.approx(warmup_cosine(150, 200, 10, 0.1))


def test_estimated_acceptance_length_independent_and_prefix_modes():
    from models.draft import estimated_acceptance_length

    # Independent depths: 1 + a1 + a1*a2 + a1*a2*a3.
    assert estimated_acceptance_length([0.5, 0.4, 0.5]) == pytest.approx(1 + 0.5 + 0.2 + 0.1)
    # Prefix accuracies (CTC): already "all depths up to k right", so they add.
    assert estimated_acceptance_length([0.5, 0.2, 0.1], prefix=True) == pytest.approx(1.8)
