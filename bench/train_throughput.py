"""One Medusa training step on the real SmolLM2: chunked (fused) loss vs the plain loss, side by side.

    python bench/train_throughput.py                 # K=4 heads, 1 x 1024 tokens, fp32, CPU
    python bench/train_throughput.py --batch 2 --seq 1024 --dtype bf16

Each variant runs in its own fresh subprocess so that its peak memory (the kernel's VmHWM high-water
mark) is its own. A step = frozen base forward + draft loss forward/backward + AdamW step. Peak step
memory = VmHWM during the first step minus resident memory just before it (so model weights and
optimizer state that exist before the step are not counted, logits and their gradients are), reported
for base forward + loss forward/backward (what chunking changes) and for the whole step including the
AdamW update (whose temporaries are the same for both). Tokens/s
is the mean over the timed steps after that first one. Printed as ratios chunked / plain.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without install

from bench.harness import Results, peak_memory, rss_kib, time_fn, time_once  # noqa: E402


def _mem_kib(field: str) -> int:
    kib = rss_kib(field)
    if kib is None:
        raise RuntimeError(f"{field} not in /proc/self/status (this benchmark needs Linux)")
    return kib


def run_variant(args) -> dict:
    import torch

    from models.base import last_hidden_and_logits, load_base
    from models.draft import BaseView, DraftBatch
    from models.families.medusa.model import MedusaDraft
    from train.config import LossSection

    torch.manual_seed(0)
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[args.dtype]
    base = load_base(args.base, dtype=args.dtype)
    view = BaseView.from_model(base.model)
    draft = MedusaDraft(args.heads, 1, view, share_lm_head=args.share_lm_head).to(dtype)
    opt = torch.optim.AdamW(draft.parameters(), lr=1e-4)
    loss_cfg = LossSection(chunked=args.variant == "chunked", chunk_size=args.chunk)
    ids = torch.randint(0, view.vocab_size, (args.batch, args.seq))
    mask = torch.ones_like(ids)
    attn = torch.ones_like(ids)
    # Optimizer state exists before the measured step, as in a real run after step 1.
    for p in draft.parameters():
        opt.state[p] = {"step": torch.tensor(0.0), "exp_avg": torch.zeros_like(p), "exp_avg_sq": torch.zeros_like(p)}

    def step(marks: list | None = None):
        h, _ = last_hidden_and_logits(base.model, ids, attn)
        out = draft.loss(DraftBatch(h, ids, mask), view, loss_cfg)
        out.loss.backward()
        if marks is not None:
            marks.append(_mem_kib("VmHWM"))  # peak of base forward + loss forward/backward
        opt.step()
        opt.zero_grad(set_to_none=True)
        return out

    marks: list[int] = []
    with peak_memory("cpu") as pk:
        _, first = time_once(lambda: step(marks))
    rss0 = pk.start_bytes // 1024
    peak = pk.delta_bytes / 1024
    peak_loss = marks[0] - rss0
    step_s = time_fn(step, warmup=0, repeats=args.steps).mean  # the first step above was the warm-up
    tokens = args.batch * args.seq
    return {"variant": args.variant, "peak_step_mib": peak / 1024, "peak_loss_mib": peak_loss / 1024,
            "first_step_s": first,
            "step_s": step_s, "tokens_per_s": tokens / step_s,
            "threads": torch.get_num_threads()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base", default="smollm2")
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--chunk", type=int, default=1024)
    p.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"])
    p.add_argument("--share-lm-head", action="store_true")
    p.add_argument("--steps", type=int, default=3, help="timed steps after the first (memory) step")
    p.add_argument("--threads", type=int, default=0)
    p.add_argument("--out", default="", help="also write the results as JSON here (after each variant)")
    p.add_argument("--variant", choices=["chunked", "plain"], help=argparse.SUPPRESS)  # child mode
    args = p.parse_args()
    if args.variant:
        print(json.dumps(run_variant(args)))
        return
    saved = Results(args.out or None, {"settings": {k: v for k, v in vars(args).items() if k != "variant"}})
    results = saved.data.setdefault("variants", {})
    for variant in ("chunked", "plain"):
        cmd = [sys.executable, __file__, *sys.argv[1:], "--variant", variant]
        # glibc unmaps freed blocks >= 64 KiB at once, so RSS follows live tensors and VmHWM is their peak.
        env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"}
        out = subprocess.run(cmd, capture_output=True, text=True, check=True, env=env).stdout
        results[variant] = json.loads(out.strip().splitlines()[-1])
        saved.save()
    c, pl = results["chunked"], results["plain"]
    print(f"Medusa K={args.heads} on {args.base}, batch {args.batch} x {args.seq} tokens, {args.dtype}, "
          f"share_lm_head={args.share_lm_head}, {c['threads']} threads")
    print(f"{'variant':>8} {'peak fwd+bwd MiB':>17} {'peak step MiB':>14} {'step s':>8} {'tokens/s':>9}")
    for r in (c, pl):
        print(f"{r['variant']:>8} {r['peak_loss_mib']:>17.0f} {r['peak_step_mib']:>14.0f} {r['step_s']:>8.2f} "
              f"{r['tokens_per_s']:>9.1f}")
    print(f"ratio chunked/plain: peak memory of base forward + loss forward/backward "
          f"{c['peak_loss_mib'] / pl['peak_loss_mib']:.2f}x (target <= 0.5), of the whole step incl. AdamW "
          f"{c['peak_step_mib'] / pl['peak_step_mib']:.2f}x; speed {c['tokens_per_s'] / pl['tokens_per_s']:.2f}x "
          f"(target >= 0.9)")


if __name__ == "__main__":
    main()
