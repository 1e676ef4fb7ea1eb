"""Where a CTC drafter's chain loses its tokens, measured on the base's stored answers (the field benchmark's).

For every answer position t of the chosen prompts (teacher forced: the base's hidden states from the field cache),
the drafter's greedy frames (each frame's top-1 class, the blank included), their CTC collapse (merge adjacent
repeats, drop blanks: the path the chain decoder puts up, `extra.ctc_num_paths=1`) and that path against the
stored answer after the root (the base's own greedy tokens x_{t+2}, x_{t+3}, ...). Reports, over every position:

- the blank rate of each frame, and the share of adjacent frame pairs merged as repeats;
- the collapsed path's length (mean, and the share of paths of each length 0..M);
- depth-k accuracy: the share of positions whose path's first k tokens are all right (what greedy verification
  accepts, teacher forced), and the same among the positions whose path is at least k long;
- frame-k accuracy: frame k's top-1 *real-token* class (the blank excluded) against x_{t+1+k} (the alignment the
  token-level anchor term trains, `loss.ctc.token_weight`), i.e. what the path would accept with no blank.

    .venv/bin/python recipes/ctc_diagnostics.py --draft runs/ff-ctc/export --num-prompts 10 \
        --out docs/lab/field_families/ff-ctc/ctc_diagnostics.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--draft", required=True, help="a CTC export directory")
    ap.add_argument("--refs", default="datasets/smollm2-field-refs")
    ap.add_argument("--num-prompts", type=int, default=10, help="each set's first N (0: every stored answer)")
    ap.add_argument("--out", default=None, help="a JSON report (default: print only)")
    ap.add_argument("--threads", type=int, default=1)
    a = ap.parse_args(argv)

    import torch

    torch.set_num_threads(a.threads)
    from core.paths import repo_relative
    from eval.engine.backends.choice import choose_backend
    from eval.field.refs import read_refs
    from eval.field.simulation import ensure_cache, first_per_set, load_cached
    from models.export.load import load_export
    from models.families.ctc.drafter import PAD, ctc_collapse

    loaded = load_export(a.draft, dtype="fp32")
    draft = loaded.draft.eval()
    if not hasattr(draft, "num_frames"):
        raise SystemExit(f"{a.draft} is a {loaded.family} draft, not a CTC drafter")
    card, refs = read_refs(a.refs, loaded.base.fingerprint, None, dtype="float32")
    if a.num_prompts:
        refs = first_per_set(refs, a.num_prompts)
    backend_name, _ = choose_backend("auto", loaded.base.model)
    directory = ensure_cache(refs, loaded.base, backend_name, ())
    m, blank = draft.num_frames, draft.blank
    d2t = getattr(draft, "d2t", None)
    n_pos = 0
    blanks = torch.zeros(m, dtype=torch.float64)
    merged = torch.zeros(max(m - 1, 1), dtype=torch.float64)
    lengths = torch.zeros(m + 1, dtype=torch.float64)
    right = torch.zeros(m, dtype=torch.float64)  # positions whose path's first k+1 tokens are right
    long_enough = torch.zeros(m, dtype=torch.float64)  # positions whose path is >= k+1 long
    frame_right = torch.zeros(m, dtype=torch.float64)
    for r in refs:
        hidden = load_cached(directory, r, "cpu")[0].float()
        seq = torch.tensor(r.prompt + r.answer, dtype=torch.long)
        lo, hi = len(r.prompt) - 1, len(seq) - 2  # hidden at t -> root x_{t+1} -> path from x_{t+2}
        if hi <= lo:
            continue
        with torch.inference_mode():
            z = draft.attn(hidden[None])[0][lo:hi]  # [n, d]
            greedy = torch.cat([draft.frame_logits(z[i:i + 128]).argmax(-1) for i in range(0, len(z), 128)])
            real = torch.cat([draft.frame_logits(z[i:i + 128])[..., :blank].argmax(-1)
                              for i in range(0, len(z), 128)])  # [n, M] the top real class per frame
        n = greedy.shape[0]
        n_pos += n
        blanks += (greedy == blank).double().sum(0)
        if m > 1:
            merged += ((greedy[:, 1:] == greedy[:, :-1]) & (greedy[:, 1:] != blank)).double().sum(0)
        paths = ctc_collapse(greedy, blank)  # [n, M] draft ids, PAD after the end
        if d2t is not None:
            paths = torch.where(paths >= 0, d2t.cpu()[paths.clamp(min=0)], paths)
            real = d2t.cpu()[real]
        plen = (paths != PAD).sum(1)
        lengths += torch.bincount(plen, minlength=m + 1).double()[: m + 1]
        pos = torch.arange(lo, hi)
        idx = (pos[:, None] + 2 + torch.arange(m)[None, :]).clamp(max=len(seq) - 1)
        target = seq[idx]  # [n, M] x_{t+2..t+1+M}
        inside = (pos[:, None] + 2 + torch.arange(m)[None, :]) < len(seq)
        ok = (paths == target) & inside & (paths != PAD)
        lead = ok.long().cumprod(1)  # right at every depth <= k
        right += lead.double().sum(0)
        long_enough += (plen[:, None] > torch.arange(m)[None, :]).double().sum(0)
        tgt_frame = seq[(pos[:, None] + 2 + torch.arange(m)[None, :]).clamp(max=len(seq) - 1)]
        frame_right += ((real == tgt_frame) & inside).double().sum(0)
    out = {"draft": a.draft, "prompts": len(refs), "positions": n_pos, "frames": m,
           "blank_rate_per_frame": (blanks / max(n_pos, 1)).tolist(),
           "repeat_merged_per_frame_pair": (merged / max(n_pos, 1)).tolist() if m > 1 else [],
           "path_length_mean": float((lengths * torch.arange(m + 1)).sum() / max(n_pos, 1)),
           "path_length_share": (lengths / max(n_pos, 1)).tolist(),
           "depth_accuracy": (right / max(n_pos, 1)).tolist(),
           "depth_accuracy_given_long_enough": (right / long_enough.clamp(min=1)).tolist(),
           "frame_top_real_accuracy": (frame_right / max(n_pos, 1)).tolist(),
           "command": "python recipes/ctc_diagnostics.py " + " ".join(
               repo_relative(x) for x in (argv if argv is not None else sys.argv[1:]))}
    text = json.dumps(out, indent=1)
    print(text)
    if a.out:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
