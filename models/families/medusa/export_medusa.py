"""The original Medusa layout, for Medusa-compatible serving stacks (`specdraft export --format medusa`):

    medusa_lm_head.safetensors  keys "{head}.{layer}.linear.{weight,bias}" and "{head}.{L}.weight"
    config.json                 medusa_num_heads, medusa_num_layers, base_model_name_or_path, ...

A draft with a draft vocabulary is refused: the original layout has no token map, and scattering its N rows into a
V-row head would leave the other rows' logits undefined (zero rows would compete).
"""

from __future__ import annotations

import json
from pathlib import Path

from safetensors.torch import save_file

from core.atomic import write_dir_atomic
from models.draft import BaseView


def export_medusa(draft, out_dir: Path, export_cfg: dict, base: BaseView) -> Path:
    """Original Medusa layout. With share_lm_head the frozen base lm_head is copied into every head,
    since Medusa checkpoints always carry one LM head per head. A draft vocabulary is refused (no token
    map in this layout)."""
    if draft.family != "medusa":
        raise ValueError(f"--format medusa needs a Medusa draft, this run is {draft.family!r}")
    if getattr(draft, "draft_vocab_size", 0):
        raise ValueError(f"--format medusa: this draft predicts over a draft vocabulary of {draft.draft_vocab_size} "
                         "tokens (draft.vocab_size) and the original Medusa layout has no token map (every head "
                         "must have the base's V rows); retrain with draft.vocab_size=0, or use a format that "
                         "carries the map (the specdraft export)")
    # the draft's state as models/export/tensors.py: draft_tensors copies it, under the layout's names
    tensors = {name.removeprefix("heads."): value.detach().to("cpu").contiguous().clone()
               for name, value in draft.state_dict().items()}
    if draft.share_lm_head:
        for k in range(draft.num_heads):
            tensors[f"{k}.{draft.num_layers}.weight"] = base.lm_head_weight.detach().cpu().contiguous().clone()
    config = {"medusa_num_heads": draft.num_heads, "medusa_num_layers": draft.num_layers,
              "base_model_name_or_path": export_cfg["base_model"], "hidden_size": draft.hidden_size,
              "vocab_size": draft.vocab_size}
    return write_dir_atomic(out_dir, {
        "medusa_lm_head.safetensors": lambda p: save_file(tensors, str(p)),
        "config.json": lambda p: p.write_text(json.dumps(config, indent=2) + "\n"),
    })
