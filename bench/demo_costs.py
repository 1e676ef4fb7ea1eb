"""The cost side of the demo's speedup on the real base, measured side by side (round robin, one process):
time per decode step of own AR (1 node), verification of chains / trees of N nodes, and the drafting time
of Hydra / Hydra++ drafts (random weights: drafting cost does not depend on training) and Medusa heads.

    python bench/demo_costs.py --threads 1 --steps 40
    python bench/demo_costs.py --threads 2

From these, the acceptance length a draft shape needs: break-even = (verify + draft) / AR step, and for
the demo's target 1.15x own AR: 1.15 x that. Prints a table (and `uptime`, since the box is shared).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without install

from bench.harness import Stopwatch, Timing  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", type=int, default=0, help="torch threads (0 = default)")
    p.add_argument("--steps", type=int, default=40, help="timed steps per shape and round")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"])
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    from eval.engine.backends.fast import FastBackend
    from eval.engine.drafters.drafter import DecodeState
    from eval.engine.tree import STATIC_TREES, StaticTree, chain_tree
    from models.base import load_base
    from models.draft import BaseView
    from models.families.hydra.drafter import HydraDrafter
    from models.families.hydra.model import HydraDraft
    from models.families.medusa.drafter import MedusaDrafter
    from models.families.medusa.model import MedusaDraft

    base = load_base("smollm2", dtype=args.dtype)
    dtype = next(base.model.parameters()).dtype
    backend = FastBackend(base.model)
    view = BaseView.from_model(base.model)
    prompt = torch.tensor(base.tokenizer("Explain how a bicycle stays upright, step by step.")["input_ids"])
    shapes = {"AR (1 node)": chain_tree(1), "chain 2": chain_tree(1, [2]), "chain 3": chain_tree(1, [2, 3]),
              "chain 4": chain_tree(1, [2, 3, 4]), "chain 5": chain_tree(1, [2, 3, 4, 5])}
    t16 = StaticTree(STATIC_TREES["tree16"])
    shapes["tree16"] = t16.fill(1, torch.arange(2, 12).repeat(t16.depth, 1))  # [depth, 10] top-k tokens

    torch.manual_seed(0)
    drafters = {}
    for heads, layers, prefix, share in [(1, 1, False, True), (2, 2, True, True), (1, 2, True, True)]:
        d = HydraDraft(heads, layers, view, share_lm_head=share, prefix_layer=prefix).to(dtype=dtype).eval()
        name = f"Hydra{'++' if prefix else ''} {heads}h x{layers}"
        drafters[f"{name}, chain {heads + 1}"] = HydraDrafter(d, StaticTree([(0,) * k for k in range(1, heads + 1)]))
    m = MedusaDraft(1, 1, view, share_lm_head=True).to(dtype=dtype).eval()
    drafters["Medusa 1h, chain 2"] = MedusaDrafter(m, StaticTree([(0,)]))

    def time_verify(tree, n):
        backend.reset(prompt.numel() + n * tree.num_nodes + 8)
        backend.prefill(prompt)
        watch = Stopwatch()
        for _ in range(n):
            backend.forward_tree(tree.tokens, tree.depths, tree.mask)
            backend.commit(torch.zeros(1, dtype=torch.long))
        return watch.wall() / n

    def time_draft(drafter, n):
        backend.reset(prompt.numel() + 8)
        _, hidden = backend.prefill(prompt)
        drafter.reset()
        state = DecodeState(ids=prompt, root=1, new_hidden=hidden, new_ids=prompt)
        drafter.propose(state)  # the prefix layer's cache takes the prompt once
        one = DecodeState(ids=prompt, root=1, new_hidden=hidden[-1:], new_ids=prompt[-1:])
        watch = Stopwatch()
        for _ in range(n):
            drafter.propose(one)
        return watch.wall() / n

    rows = {k: [] for k in [*shapes, *drafters]}
    for t in shapes.values():  # warm-up
        time_verify(t, 3)
    for d in drafters.values():
        time_draft(d, 3)
    for _ in range(args.rounds):  # round robin: load from other processes hits every shape alike
        for k, t in shapes.items():
            rows[k].append(time_verify(t, args.steps))
        for k, d in drafters.items():
            rows[k].append(time_draft(d, args.steps))
    med = {k: Timing(v).median for k, v in rows.items()}
    ar = med["AR (1 node)"]
    print(f"uptime: {os.popen('uptime').read().strip()}")
    print(f"{args.dtype}, {torch.get_num_threads()} threads, median of {args.rounds} rounds x {args.steps} steps")
    print("| what | ms per step | x AR step |\n|---|---|---|")
    for k, v in med.items():
        print(f"| {k} | {1e3 * v:.1f} | {v / ar:.2f} |")


if __name__ == "__main__":
    main()
