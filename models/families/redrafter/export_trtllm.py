"""Export a ReDrafter draft for TensorRT-LLM (`specdraft export --format redrafter-trtllm`).

TensorRT-LLM builds ReDrafter engines from a checkpoint made by its converter
`examples/redrafter/convert_checkpoint.py --model_dir <base HF dir> --drafter_model_dir <this export>
--redrafter_num_beams W --redrafter_draft_len_per_beam L-1`. The converter reads Apple's reference drafter
layout (ml-recurrent-drafter `Drafter` / `DrafterConfig`), which is what this writes:

    config.json         model_type, vocab_size, hidden_size, exit_dim, num_draft_layers, rnn
                        (+ redrafter_num_beams / redrafter_draft_len_per_beam: the converter takes
                        those as flags; they are stored here so the values travel with the weights)
    model.safetensors   ours                          -> drafter dir           -> TRT-LLM checkpoint
                        input_proj.{weight,bias}      -> input_proj.*          -> drafter.input_proj.*
                        layers.{i}.linear.{w,b}       -> lm_head.{i}.linear.*  -> drafter.layers.{i}.linear.*
                        lm_head.weight (or the base)  -> lm_head.{L}.weight    -> drafter.lm_head.weight
                        rnn_u.{weight,bias}           -> rnn_u.*               -> drafter.rnn_u.*
                        rnn_w.weight                  -> rnn_w.weight          -> drafter.rnn_w.weight

input_proj exists only when exit_dim != 2·hidden_size (our share_lm_head layout); rnn_* only with
rnn=true. With share_lm_head the frozen base lm_head is written as the drafter's head (the reference
drafter always carries its own). TensorRT-LLM's draft length excludes the root token, so
redrafter_draft_len_per_beam = beam_length - 1. Mapping sources are cited in docs/families/redrafter.md.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from core.atomic import write_dir_atomic
from models.draft import BaseView
from models.export.tensors import draft_tensors, read_tensors
from models.families.redrafter.model import DEFAULT_BEAM_LENGTH, DEFAULT_BEAM_WIDTH, ReDrafterDraft

MODEL_TYPE = "recurrent_drafting_drafter"  # Apple's DrafterConfig.model_type


def trtllm_tensors(draft: ReDrafterDraft, base: BaseView) -> dict[str, torch.Tensor]:
    """Our state dict renamed to the reference drafter layout (contiguous CPU copies)."""
    ours = draft_tensors(draft)
    out: dict[str, torch.Tensor] = {}
    for name, value in ours.items():
        if name.startswith("layers."):  # layers.{i}.linear.* -> lm_head.{i}.linear.* (Sequential index i)
            out["lm_head." + name.removeprefix("layers.")] = value
        elif name == "lm_head.weight":
            out[f"lm_head.{draft.num_layers}.weight"] = value
        else:  # rnn_u.*, rnn_w.weight, input_proj.*: same names
            out[name] = value
    if draft.share_lm_head:
        out[f"lm_head.{draft.num_layers}.weight"] = base.lm_head_weight.detach().cpu().contiguous().clone()
    return out


def export_redrafter_trtllm(draft, out_dir: Path, export_cfg: dict, base: BaseView, beam_width: int | None = None,
                            beam_length: int | None = None) -> Path:
    """Write the drafter directory TensorRT-LLM's ReDrafter converter reads (see the module docstring).
    beam_width / beam_length (root counted) default to the draft's own defaults."""
    if getattr(draft, "family", None) != "redrafter":
        raise ValueError(f"--format redrafter-trtllm needs a ReDrafter draft, this run is "
                         f"{getattr(draft, 'family', type(draft).__name__)!r}")
    if getattr(draft, "draft_vocab_size", 0):
        raise ValueError(f"--format redrafter-trtllm: this draft predicts over a draft vocabulary of "
                         f"{draft.draft_vocab_size} tokens (draft.vocab_size), and TensorRT-LLM's drafter layout has "
                         "no token map (its head must have the base's V rows); retrain with draft.vocab_size=0 or "
                         "serve the specdraft export")
    width = int(beam_width if beam_width is not None else draft.beam_width)
    length = int(beam_length if beam_length is not None else draft.beam_length)
    if width < 1 or length < 2:
        raise ValueError(f"TensorRT-LLM needs beam_width >= 1 and beam_length >= 2 (root + >= 1 draft), got "
                         f"{width} and {length}")
    tensors = trtllm_tensors(draft, base)
    config = {"model_type": MODEL_TYPE, "vocab_size": draft.vocab_size, "hidden_size": draft.hidden_size,
              "exit_dim": draft.exit_dim, "num_draft_layers": draft.num_layers, "rnn": draft.rnn,
              "redrafter_num_beams": width, "redrafter_draft_len_per_beam": length - 1,
              "base_model_name_or_path": export_cfg["base_model"], "specdraft_num_heads": draft.num_heads}
    return write_dir_atomic(out_dir, {
        "model.safetensors": lambda p: save_file(tensors, str(p), metadata={"format": "pt"}),
        "config.json": lambda p: p.write_text(json.dumps(config, indent=2) + "\n"),
    })


def load_redrafter_trtllm(export_dir: Path, base: BaseView) -> ReDrafterDraft:
    """Read a reference-layout drafter directory back into a ReDrafterDraft (round trips, and drafters
    trained with Apple's code). share_lm_head is inferred: exit_dim == hidden_size means input_proj + a
    d-wide head; the stored head must then equal the base lm_head, or it is not a shared-head draft."""
    export_dir = Path(export_dir)
    if not (export_dir / "config.json").is_file():
        raise FileNotFoundError(f"no config.json in {export_dir}: pass a directory written by "
                                "`specdraft export --format redrafter-trtllm`")
    cfg = json.loads((export_dir / "config.json").read_text())
    d, layers = cfg["hidden_size"], cfg["num_draft_layers"]
    if cfg["exit_dim"] not in (d, 2 * d):
        raise ValueError(f"{export_dir}: exit_dim={cfg['exit_dim']} is neither 2*hidden_size ({2 * d}) nor "
                         f"hidden_size ({d}); only those two layouts map onto a specdraft ReDrafter")
    share = cfg["exit_dim"] == d
    tensors = read_tensors(export_dir / "model.safetensors")
    head = tensors.pop(f"lm_head.{layers}.weight")
    if share and not torch.equal(head, base.lm_head_weight.detach().cpu().to(head.dtype)):
        raise ValueError(f"{export_dir}: a d-wide drafter head that differs from the base lm_head; specdraft "
                         "only shares the frozen base head (train it with draft.share_lm_head=true)")
    draft = ReDrafterDraft(cfg.get("specdraft_num_heads", 5), layers, base, share_lm_head=share,
                           rnn=bool(cfg["rnn"]), beam_width=cfg.get("redrafter_num_beams", DEFAULT_BEAM_WIDTH),
                           beam_length=cfg.get("redrafter_draft_len_per_beam", DEFAULT_BEAM_LENGTH - 1) + 1)
    state = {("layers." + k.removeprefix("lm_head.")) if k.startswith("lm_head.") else k: v
             for k, v in tensors.items()}
    if not share:
        state["lm_head.weight"] = head
    missing, unexpected = draft.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise ValueError(f"{export_dir}: tensors do not match a ReDrafter with this config.json "
                         f"(missing {missing[:5]}, unexpected {unexpected[:5]})")
    return draft.eval()
