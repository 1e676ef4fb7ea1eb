"""How much work `specdraft demo` does on this machine: a pure function of the measured base speed, the dtype and
the time budget (the probe that measures the speed is cli/demo_probe.py).

The demo's costs all scale with how fast the CPU runs the base: the hidden-state cache build (the base once over
every training token; the largest part), training the head (every epoch over the same tokens), the held-out table
and the MT-bench decoding with both baselines. An AVX2-only CPU runs the base in fp32 ~3x slower than a CPU with
AVX512-BF16 runs it in bf16, so one fixed size cannot keep `make demo` within its promise on both (measured in
docs/lab/benchmarks.md, "The demo").

The plan is the first shape of `SHAPES` (best first) whose estimate fits the budget. What the head needs decides
the order: it drafts x_{t+2} in the base's answers to first questions (MT-bench), and the first answers' tokens
are at the start of each conversation, so every shape cuts the conversations at 128 tokens and a faster machine
gets more conversations, not longer ones (measured: docs/lab/benchmarks.md, "The demo: which data cut"). The
AVX512-BF16 EPYC affords ~4,000 conversations x 128 tokens x 3 epochs x 8 prompts in bf16; larger shapes are for
CPUs whose bulk forwards run faster still (AMX).

Decoding is priced from its own measurement, the base's one-token step in the dtype the demo decodes in
(cli/demo_probe.py: decode_speed), not from the bulk probe: on an AMX Xeon bulk forwards run several times faster
than on the EPYC while a one-token step does not, so a plan scaled by the bulk probe alone would overrun its
decoding there.

Plans are deterministic per speed class: both measured speeds are quantized (`speed_class`, ~19% steps, with
hysteresis against the class a previous run on the same machine used), so a rerun picks the same shape and reuses
its hidden-state cache, whose key depends on the rows (data.max_records, data.max_length).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

# The keys a plan sets, as `specdraft demo` override names; eval.num_prompts goes to configs/eval/demo.yaml.
PLAN_KEYS = ("data.max_records", "data.max_length", "train.epochs", "train.max_minutes", "eval.num_prompts")

# Minutes `specdraft demo` may take: the README promises `make demo` in under 15 min on a 2-core CPU with its
# set-up (`make setup`, ~2 min from a fresh clone), and should use at least 80 % of them (12 min) where the machine
# affords more work. Planned totals have landed within ~0.7 min of the timed runs (docs/quickstart.md), so 12 min
# planned is ~12-13 min run, ~14-15 from a fresh clone.
BUDGET_MINUTES = 12.0

# ShareGPT as the demo reads it (the first 2,000 conversations of the packaged file, SmolLM2's chat template,
# >= 8 assistant tokens within max_length): max_length -> (share of conversations kept, mean tokens of a kept
# row). Longer max_length keeps more rows (a long first prompt leaves its answer beyond a short cut).
SHAREGPT_ROWS = {128: (0.734, 127), 192: (0.804, 189), 256: (0.826, 249), 320: (0.840, 309), 384: (0.856, 366),
                 448: (0.870, 421), 512: (0.880, 474), 640: (0.891, 577), 768: (0.900, 673), 1024: (0.918, 851)}
VAL_FRACTION = 0.05  # configs/demo.yaml keeps the default data.val_fraction
HELDOUT_ROWS = 24  # train.val_batches (6) x micro_batch_size (4): the held-out table's base forwards
PROBE_LENGTH = 256  # the probe's row length (cli/demo_probe.py)

# Per dtype, measured on the 2-core AMD EPYCs (bench/demo_plan_costs.py; docs/lab/benchmarks.md, "The demo"):
#  - attn_len: a token's forward cost grows with the row length through attention, as (1 + mean position /
#    attn_len): 512-token rows cost ~15% more a token than the probe's 256-token ones (0-18% in fp32, 15-22% in
#    bf16 over four one-thread runs); the larger value is used for both;
#  - train_ratio: training tokens/s of the one-head Hydra per probe token/s. Trained on hard labels, fp32: the
#    AVX2-only box trained 3.6k tok/s where its cache ran 470 tok/s on 512-token rows (= ~570 probe tok/s),
#    DeepSpeed included, i.e. 6.0; bf16: that scaled by the one-thread ratio of head training to forward (4.6 in
#    bf16 against 4.7-5.7 in fp32), 5.0. The soft loss to the base (configs/demo.yaml: loss.teacher_weight 1.0)
#    computes the base's logits over the draft vocabulary at every target too: SOFT_LOSS_SPEED of the hard-label
#    speed;
#  - decode_steps: seconds per MT-bench token of the three decoders together (speculative, own AR, HF generate),
#    in one-token steps of the base as cli/demo_probe.py: decode_speed measures them (the decode-dtype probe's step
#    at a 128-token prefix, ~10 % slower than the eval's own AR step), in the dtype the demo decodes in (`fast` may
#    decode fp32 beside bf16 bulk phases). fp32: fitted to a timed demo on the AVX512-BF16 EPYC (2026-11-29: the
#    tree sweep, 8 MT-bench prompts and the exact check took 210 s where 4.2 steps a token priced 257 s) -> 3.5.
#    bf16: not timed with this measurement; the timed demos' tok/s (EPYC 37.7 / 31.5 / 23.5 = 3.2 own-AR steps a
#    token, AMX 26.6 / 22.9 / 18.7 = 3.1, against fp32's 4.0 from 39.7 / 32.4 / 15.1: transformers' generate is
#    slow in fp32) scaled like fp32's -> 2.9;
#  - decode_s, ref: the same seconds a token at the probe speed `ref`, used only where no decode speed was measured
#    (a plan made from the bulk probe alone): decoding scaled like the bulk forward, which holds on the EPYCs but
#    not on AMX, whose bulk forwards run several times faster while one-token decoding does not;
#  - fixed_s: base conversion, tokenizing, DeepSpeed start, draft vocabulary, export, loading the base for eval
#    and the tie tolerance (in bf16 also the short fp32 exact check);
#  - cache_eff: the cache build's tokens/s against the probe's (scaled to the row length): padding, the shards'
#    writes and the batches' collation. Timed demos: bf16 0.84 and 0.80 (AVX512-BF16 EPYC), 0.84 (AMX Xeon); fp32
#    0.86 and 0.87 (the EPYC forced to fp32).
# bf16 on a CPU with AMX ("bf16-amx", `cost_kind`): AMX tiles run the base's large bf16 matmuls (the probe, the
# cache build) far faster than AVX512-BF16, but not the rest of a training step (AdamW, the fused loss's chunk loop,
# DeepSpeed's bookkeeping), so the head trains at a smaller multiple of the probe: the timed AMX demo trained 2,220
# steps (2.23M tokens) in 4.5 min against a 3,158 tok/s probe class, 2.62x with the soft loss (3.1 hard), where the
# EPYC's bf16 demos trained at 4.84-4.97x (5.7 hard). One thread, CPU time (bench/demo_plan_costs.py --lengths 256
# --dtypes bf16): head training / forward 1.81 on the AMX Xeon against ~2.9 on the EPYC: the same ratio (0.62).
# Its fixed_s adds the rest of that run's overrun: set-up and decoding took 3.8 min against 3.0 priced (which of the
# two is not known from that run; the demo's closing table now times them apart).
COSTS = {
    "fp32": {"attn_len": 700.0, "train_ratio": 6.0, "decode_steps": 3.5, "decode_s": 0.149, "ref": 570.0,
             "fixed_s": 75.0, "cache_eff": 0.87},
    "bf16": {"attn_len": 700.0, "train_ratio": 5.7, "decode_steps": 2.9, "decode_s": 0.117, "ref": 1200.0,
             "fixed_s": 90.0, "cache_eff": 0.84},
}
COSTS["bf16-amx"] = {**COSTS["bf16"], "train_ratio": 3.1, "fixed_s": 138.0}
MAX_NEW_TOKENS = 96  # configs/eval/demo.yaml
# Head training with the soft loss (loss.teacher_weight > 0) against hard labels, tokens/s. The head's step alone is
# 0.65x in both dtypes (2,052 / 3,188 and 1,915 / 2,895 in bf16, 1,178 / 1,808 twice in fp32; one thread, CPU time,
# [4, 256] cached rows, bench/demo_plan_costs.py --teacher-weight 1), but in the demo's DeepSpeed loop on two
# threads the rest of the step hides part of it: the AVX512-BF16 EPYC trained 6.7k tok/s in bf16 (5.0x its probe,
# what hard labels were priced at) and 3.5k in fp32 (4.9x). 0.85 keeps the estimate on the safe side of both.
SOFT_LOSS_SPEED = 0.85


@dataclass(frozen=True)
class Shape:
    max_records: int
    max_length: int
    epochs: float
    num_prompts: int


# Best first. Every step is cheaper than the one before it (test_demo_plan.py checks that). Measured
# (recipes/demo_data_cuts.sh; docs/lab/benchmarks.md, "The demo: which data cut"), MT-bench acceptance of the
# 3-epoch head with the demo's tree: at equal cached tokens a 128-token cut decodes as well as a 256-token one
# (1.40 / 1.41 at ~150k tokens, 1.44 / 1.43 at ~300k), whole 512-token conversations worse (1.33 at ~150k, 1.39 at
# ~310k): the head learns from the first answers, so every shape cuts at 128 tokens (the cheapest rows) and spends
# what the machine affords on conversations, then on epochs and eval prompts. The largest shapes are for machines
# whose bulk forwards outrun the AVX512-BF16 EPYC's (~4,000 conversations in bf16), e.g. AMX.
SHAPES = (
    *(Shape(records, 128, 3, 8) for records in (12000, 10000, 8400, 7000, 6000, 5200, 4600, 4000, 3600, 3200, 2800,
                                                2500, 2200, 1900, 1600, 1300, 1000, 800, 600, 400)),
    Shape(400, 128, 2, 8), Shape(400, 128, 2, 6), Shape(300, 128, 2, 4),
)


def speed_class(tok_s: float, previous: int | None = None) -> int:
    """The class of a measured speed: floor(4 log2 tok/s), so classes are 2^(1/4) (~19%) apart. A speed within half
    a class of `previous` (the class the last run on this machine used) keeps it: a rerun whose probe lands just
    across a boundary still gets the same plan and the same cache."""
    if tok_s <= 0:
        raise ValueError(f"measured speed must be positive, got {tok_s}")
    x = 4 * math.log2(tok_s)
    if previous is not None and previous - 0.5 <= x < previous + 1.5:
        return previous
    return math.floor(x)


def class_speed(k: int) -> float:
    """The speed a class stands for: the geometric middle of its interval."""
    return 2 ** ((k + 0.5) / 4)


def _interp(table: dict[int, tuple[float, float]], length: int) -> tuple[float, float]:
    """(kept share, tokens a kept row) at `length`: linear between the measured lengths, clamped at the ends."""
    keys = sorted(table)
    if length <= keys[0]:
        return table[keys[0]][0], min(table[keys[0]][1], length)
    for lo, hi in zip(keys, keys[1:]):
        if length <= hi:
            w = (length - lo) / (hi - lo)
            return tuple(a + w * (b - a) for a, b in zip(table[lo], table[hi]))
    lo, hi = keys[-2], keys[-1]  # beyond the table: the last segment's slope, kept share capped at 1
    slope = (table[hi][1] - table[lo][1]) / (hi - lo)
    return min(1.0, table[hi][0]), table[hi][1] + slope * (length - hi)


def train_rows_and_tokens(max_records: int, max_length: int) -> tuple[int, int]:
    """Estimated (train conversations, train tokens) of the demo's split: the rows the cache holds."""
    kept_share, tokens_per_row = _interp(SHAREGPT_ROWS, max_length)
    kept = round(max_records * kept_share)
    train = kept - max(1, math.ceil(VAL_FRACTION * kept))
    return max(train, 1), round(max(train, 1) * tokens_per_row)


def _cost_per_token(max_length: int, attn_len: float) -> float:
    """A token's forward cost at `max_length` relative to the probe's rows (mean position ~ half the row)."""
    return (1 + max_length / 2 / attn_len) / (1 + PROBE_LENGTH / 2 / attn_len)


@dataclass(frozen=True)
class Plan:
    dtype: str
    tok_s: float  # the speed class's speed (probe tokens/s)
    shape: Shape
    train_rows: int
    train_tokens: int
    cache_s: float
    train_s: float
    max_minutes: float  # the training cap: the estimate plus slack, so a busier machine still ends in time
    eval_s: float
    fixed_s: float
    budget_minutes: float
    user_keys: tuple[str, ...] = field(default=())  # plan keys the user set (kept as given)
    base_total_s: float | None = None  # with user keys: the total of the plan without them
    tree_sweep: bool = True  # eval_s includes the demo's tree sweep (cli/demo_tune.py)
    decode_tok_s: float | None = None  # one-token AR decoding (a speed class's speed); None: priced from tok_s
    decode_dtype: str | None = None  # the dtype the demo decodes in, when not the bulk dtype
    tune_s: float = 0.0  # the tree sweep's part of eval_s

    @property
    def total_s(self) -> float:
        return self.fixed_s + self.cache_s + self.train_s + self.eval_s

    def phases(self) -> dict[str, float]:
        """Planned seconds per phase, as the demo times them at its end (PHASES)."""
        return {"set-up": self.fixed_s, "cache": self.cache_s, "training": self.train_s, "tree sweep": self.tune_s,
                "decoding": self.eval_s - self.tune_s}

    @property
    def fits(self) -> bool:
        return self.total_s <= 60 * self.budget_minutes

    def overrides(self) -> dict[str, str]:
        """The plan as `specdraft demo` overrides (PLAN_KEYS), including the keys the user set."""
        s = self.shape
        return {"data.max_records": str(s.max_records), "data.max_length": str(s.max_length),
                "train.epochs": f"{s.epochs:g}", "train.max_minutes": f"{self.max_minutes:g}",
                "eval.num_prompts": str(s.num_prompts)}

    def line(self) -> str:
        """The one line the demo prints before it starts."""
        s = self.shape
        epochs = f"{s.epochs:g} epoch{'' if s.epochs == 1 else 's'}"
        in_dtype = f" in {self.decode_dtype}" if self.decode_dtype else ""
        decoding = f", decoding ~{self.decode_tok_s:.0f} tok/s{in_dtype}" if self.decode_tok_s else ""
        kind = self.dtype.replace("bf16-amx", "bf16 (AMX)")
        text = (f"this CPU: {kind}, ~{self.tok_s:.0f} tok/s{decoding} -> {s.max_records} conversations cut at "
                f"{s.max_length} tokens, ~{self.train_tokens / 1000:.0f}k tokens cached in ~{self.cache_s / 60:.1f} "
                f"min, {epochs} in ~{self.train_s / 60:.1f} min (cap {self.max_minutes:g}), "
                f"{'the tree sweep and ' if self.tree_sweep else ''}{s.num_prompts} MT-bench prompts in "
                f"~{self.eval_s / 60:.1f} min: ~{self.total_s / 60:.1f} min in all (budget {self.budget_minutes:g})")
        if self.user_keys:
            delta = (self.total_s - self.base_total_s) / 60 if self.base_total_s is not None else 0.0
            text += (f"; your {', '.join(self.user_keys)} cost{'s' if len(self.user_keys) == 1 else ''} "
                     f"{delta:+.1f} min against this CPU's plan")
        if not self.fits:
            text += f"; over the budget by ~{self.total_s / 60 - self.budget_minutes:.1f} min"
        return text


def cost_dtype(dtype: str) -> str:
    """The COSTS entry a run's dtype is priced with: fp16 like bf16 (both half-width matmuls), else fp32."""
    return "bf16" if dtype in ("bf16", "fp16") else "fp32"


def cost_kind(dtype: str, device_type: str = "cpu", cpuinfo: str | None = None) -> str:
    """The COSTS entry of the demo's bulk phases: cost_dtype, and "bf16-amx" for bf16 on a CPU with AMX-BF16 (its
    head trains at a smaller multiple of the probe, see COSTS)."""
    kind = cost_dtype(dtype)
    if kind != "bf16" or device_type != "cpu":
        return kind
    if cpuinfo is None:
        from core.hardware import cpuinfo_text

        cpuinfo = cpuinfo_text()
    return "bf16-amx" if "amx_bf16" in cpuinfo.split() else kind

def decode_token_seconds(tok_s: float, dtype: str, decode_tok_s: float | None,
                         decode_dtype: str | None = None) -> float:
    """Seconds per MT-bench token of the demo's three decoders: from the measured one-token decode speed in
    `decode_dtype` (default: the bulk dtype) where there is one, else scaled from the bulk probe (COSTS: decode_steps,
    decode_s)."""
    if decode_tok_s:
        return COSTS[decode_dtype or dtype]["decode_steps"] / decode_tok_s
    c = COSTS[dtype]
    return c["decode_s"] * c["ref"] / tok_s


def estimate(shape: Shape, tok_s: float, dtype: str, budget_minutes: float, max_minutes: float | None = None, *,
             soft_loss: bool = True, tree_sweep: bool = True, decode_tok_s: float | None = None,
             decode_dtype: str | None = None) -> Plan:
    """The time estimate of one shape at a speed (probe tokens/s) in a dtype. soft_loss: the head trains with
    the soft loss to the base (loss.teacher_weight > 0; slower a token); tree_sweep: the demo sweeps its trees
    before decoding (not when the user sets the tree); decode_tok_s: the base's one-token decode speed in the
    dtype the demo decodes in, decode_dtype ("fp32" | "bf16"; None: `dtype`), None: decoding priced from tok_s."""
    if decode_dtype is not None and decode_dtype not in COSTS:
        raise ValueError(f"no demo cost model for decode dtype {decode_dtype!r}; known: {', '.join(COSTS)}")
    if dtype not in COSTS:
        raise ValueError(f"no demo cost model for dtype {dtype!r}; known: {', '.join(COSTS)}")
    c = COSTS[dtype]
    rows, tokens = train_rows_and_tokens(shape.max_records, shape.max_length)
    forward_tok_s = tok_s / _cost_per_token(shape.max_length, c["attn_len"])
    cache_s = tokens / (forward_tok_s * c["cache_eff"])
    heldout_s = HELDOUT_ROWS * tokens / rows / forward_tok_s
    train_tok_s = tok_s * c["train_ratio"] * (SOFT_LOSS_SPEED if soft_loss else 1.0)
    train_s = shape.epochs * tokens / train_tok_s + heldout_s
    eval_s = shape.num_prompts * MAX_NEW_TOKENS * decode_token_seconds(tok_s, dtype, decode_tok_s, decode_dtype)
    tune_s = tune_seconds(tok_s, dtype, decode_tok_s, decode_dtype) if tree_sweep else 0.0
    eval_s += tune_s
    if max_minutes is None:
        # A cap, not a target: the estimate plus a quarter and half a minute, plus half of the budget the plan
        # leaves unused, so a machine slower than its probe loses epochs only when the budget is really at stake.
        spare = max(0.0, budget_minutes - (c["fixed_s"] + cache_s + train_s + eval_s) / 60)
        max_minutes = math.ceil(2 * (1.25 * train_s / 60 + 0.5 + spare / 2)) / 2
    return Plan(dtype, tok_s, shape, rows, tokens, cache_s, train_s, max_minutes, eval_s, c["fixed_s"],
                budget_minutes, tree_sweep=tree_sweep, decode_tok_s=decode_tok_s,
                decode_dtype=decode_dtype if decode_dtype != cost_dtype(dtype) else None, tune_s=tune_s)


# The demo's phases as it times them (cli/demo.py: phase_table): set-up = probes, loading, tokenizing, DeepSpeed's
# start and the export (fixed_s); cache = the hidden-state cache build; training = the loop and the held-out table;
# tree sweep = cli/demo_tune.py; decoding = the MT-bench decoding with both baselines and the fp32 check.
PHASES = ("set-up", "cache", "training", "tree sweep", "decoding")


# The tree sweep before the MT-bench decoding (cli/demo_tune.py): its decoded tokens are AR and speculative passes,
# ~0.3 of decode_s a token (which also pays for HF generate, the slowest of the three), plus loading the export,
# warm-ups and the prompts' prefills.
TUNE_SHARE_OF_DECODE = 0.3
TUNE_FIXED_S = 15.0


def tune_seconds(tok_s: float, dtype: str, decode_tok_s: float | None = None, decode_dtype: str | None = None) -> float:
    """Seconds of the demo's tree sweep at a probe speed (and decode speed and dtype, when measured)."""
    from cli.demo_tune import TUNE_DECODED_TOKENS

    per_token = decode_token_seconds(tok_s, dtype, decode_tok_s, decode_dtype)
    return TUNE_FIXED_S + TUNE_DECODED_TOKENS * TUNE_SHARE_OF_DECODE * per_token


SHAREGPT_RECORDS = 17_671  # complete conversations in the packaged ShareGPT: what data.max_records=null reads


def _apply(shape: Shape, user: dict[str, str]) -> Shape:
    """`shape` with the plan keys the user set."""
    fields = {"data.max_records": ("max_records", int), "data.max_length": ("max_length", int),
              "train.epochs": ("epochs", float), "eval.num_prompts": ("num_prompts", int)}
    values = {}
    for key, (name, cast) in fields.items():
        if key not in user:
            continue
        if key == "data.max_records" and user[key].lower() in ("null", "none", "~"):
            values[name] = SHAREGPT_RECORDS
            continue
        try:
            values[name] = cast(user[key])
        except ValueError:
            raise ValueError(f"{key}={user[key]!r}: the demo plans with a number here (e.g. {key}="
                             f"{getattr(shape, name):g})") from None
    return replace(shape, **values)


def make_plan(tok_s: float, dtype: str, budget_minutes: float = BUDGET_MINUTES,
              user: dict[str, str] | None = None, *, soft_loss: bool = True, tree_sweep: bool = True,
              decode_tok_s: float | None = None, decode_dtype: str | None = None) -> Plan:
    """The demo's plan at `tok_s` (a speed class's speed) in `dtype` ("fp32" | "bf16"): the first of SHAPES that
    fits `budget_minutes`, else the cheapest one. `user` = plan keys the user set (`PLAN_KEYS` -> value): they
    replace the planned values as given (the rest of the plan stays, so an override changes only what it names;
    without train.max_minutes the training cap follows the new estimate), and the plan says what they cost
    against the plan without them. soft_loss / tree_sweep / decode_tok_s / decode_dtype: see `estimate`."""
    user = {k: v for k, v in (user or {}).items() if k in PLAN_KEYS}
    kinds = {"soft_loss": soft_loss, "tree_sweep": tree_sweep, "decode_tok_s": decode_tok_s,
             "decode_dtype": decode_dtype}
    plans = [estimate(s, tok_s, dtype, budget_minutes, **kinds) for s in SHAPES]
    plain = next((p for p in plans if p.fits), plans[-1])
    if not user:
        return plain
    plan = estimate(_apply(plain.shape, user), tok_s, dtype, budget_minutes, _float(user.get("train.max_minutes")),
                    **kinds)
    return replace(plan, user_keys=tuple(k for k in PLAN_KEYS if k in user), base_total_s=plain.total_s)


def _float(value: str | None) -> float | None:
    return None if value is None else float(value)
