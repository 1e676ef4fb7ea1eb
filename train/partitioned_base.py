"""A frozen base partitioned over the ranks with ZeRO-3 (`base.partition=zero3`, docs/howto/large_bases.md).

Why: a base that does not fit one device (70B in bf16 = 140 GB) cannot be loaded whole on every rank.
ZeRO-3 keeps 1/N of every parameter on each of N ranks and all-gathers one layer's parameters just
before that layer runs, freeing them right after; the frozen base never trains, so no optimizer, no
gradients and no checkpoint of it exist.

How (read from DeepSpeed 0.19's source):
- load: an HF directory is built by transformers under `deepspeed.zero.Init` when an `HfDeepSpeedConfig`
  with stage 3 is alive (`PreTrainedModel._from_config` / `from_pretrained`), and each module's weights
  are loaded into its partitions (`_load_state_dict_into_zero3_model`: gathered per module, rank 0 reads
  the values, then re-partitioned), so no rank ever holds the whole base. A base built in code (the tiny
  test base) is built whole and partitioned when the engine is made (`DeepSpeedZeRoOffload` wraps
  unconverted parameters in `zero.Init(module=...)`).
- forward: `deepspeed.initialize(model=<decoder body>, config=<stage 3>)` without an optimizer returns an
  inference-only engine whose `DeepSpeedZeRoOffload` registers pre/post forward hooks on every submodule
  (fetch = all-gather the module's parameters, release = drop them after use). The body (embeddings,
  decoder layers, final norm; `model.model` for LLaMA) is the engine's root module, so the start/end of
  forward hooks fire on `last_hidden_and_logits(model, ...)`, which calls exactly that body.
- the draft's engine is separate and unchanged.

Every rank must run every forward of the partitioned base (each is a sequence of collectives): callers
that run the base on rank 0 only (held-out eval) run it on every rank instead; the hidden-state cache
build keeps the ranks in lockstep (data/hidden_cache.py).

The frozen lm_head / input embeddings the losses and drafters read (`BaseView.lm_head_weight`,
`.embed_weight`, [V, d] each, one tensor when tied) are gathered once and kept as a full copy on every
rank: `full_copy_bytes` reports what that costs (SmolLM2: 28.3M values; 70B LLaMA-3: 2 x 1.05G values).
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from models.base import LoadedBase, load_base
from models.draft import BaseView

log = logging.getLogger(__name__)


def zero3_inference_config(dtype: torch.dtype) -> dict:
    """DeepSpeed JSON of the base's inference-only stage-3 engine (no optimizer, never steps).

    param_persistence_threshold 0: every parameter is partitioned, even the norms (by default DeepSpeed keeps
    parameters under 1e5 values whole on every rank; that would keep all of a tiny test base whole and
    blur the 1/N memory check). bf16/fp16 follow the base's dtype, since the engine casts to its own dtype.
    """
    return {
        "train_micro_batch_size_per_gpu": 1,  # required by the config parser; the base never trains
        "gradient_accumulation_steps": 1,
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0,
                              "stage3_model_persistence_threshold": 0, "overlap_comm": False},
        "bf16": {"enabled": dtype == torch.bfloat16},
        "fp16": {"enabled": dtype == torch.float16},
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }


@contextlib.contextmanager
def zero3_construction(ds_config: dict):
    """While inside, transformers builds models under deepspeed.zero.Init (parameters partitioned at
    construction) and loads checkpoints partition by partition. Unset on exit, so later loads (an eval
    base, a fresh tiny model) are whole again."""
    from transformers.integrations.deepspeed import HfDeepSpeedConfig, unset_hf_deepspeed_config

    keep_alive = HfDeepSpeedConfig(ds_config)  # transformers only holds a weakref to it
    try:
        yield keep_alive
    finally:
        unset_hf_deepspeed_config()


def _decoder_body(model: nn.Module) -> nn.Module:
    body = getattr(model, "model", None)
    if body is None or not hasattr(body, "layers"):
        raise TypeError(f"base.partition=zero3 needs a decoder body at `.model` with `.layers` (LLaMA-style causal "
                        f"LMs); {type(model).__name__} has none; use base.partition=none")
    return body


def _gathered_copy(weight: nn.Parameter) -> torch.Tensor:
    """A full, detached copy of one (possibly partitioned) parameter, gathered once."""
    import deepspeed

    with deepspeed.zero.GatheredParameters([weight], modifier_rank=None):
        return weight.detach().clone()


def local_partition_bytes(module: nn.Module) -> int:
    """Bytes of base parameters this rank holds: its partitions (ds_tensor) of partitioned parameters, the
    whole tensor of any other. Shared (tied) parameters count once."""
    seen, total = set(), 0
    for p in module.parameters():
        if id(p) in seen:
            continue
        seen.add(id(p))
        part = getattr(p, "ds_tensor", None)
        total += part.numel() * part.element_size() if part is not None else p.numel() * p.element_size()
    return total


def full_parameter_bytes(module: nn.Module) -> int:
    """Bytes the base would take whole (ds_numel of partitioned parameters; tied ones once)."""
    seen, total = set(), 0
    for p in module.parameters():
        if id(p) in seen:
            continue
        seen.add(id(p))
        numel = getattr(p, "ds_numel", None) or p.numel()
        part = getattr(p, "ds_tensor", None)
        total += numel * (part.element_size() if part is not None else p.element_size())
    return total


def gathered_bytes(module: nn.Module) -> int:
    """Bytes of partitioned parameters that are gathered (whole) right now: 0 between forwards if every
    layer was released after use."""
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

    seen, total = set(), 0
    for p in module.parameters():
        if id(p) in seen or getattr(p, "ds_tensor", None) is None:
            continue
        seen.add(id(p))
        if p.ds_status != ZeroParamStatus.NOT_AVAILABLE:
            total += p.data.numel() * p.data.element_size()
    return total


@dataclass
class PartitionedBase:
    """A LoadedBase whose parameters are ZeRO-3 partitions, plus the engine that gathers them per layer."""

    base: LoadedBase  # base.model's parameters are partitioned; forwards must run on every rank together
    engine: object  # DeepSpeed's inference-only stage-3 engine around the decoder body
    lm_head_weight: torch.Tensor  # [V, d] full copy, gathered once
    embed_weight: torch.Tensor  # [V, d] full copy (the same tensor when the base ties them)

    def view(self) -> BaseView:
        """BaseView with the full copies (the partitioned lm_head / embeddings would be empty tensors)."""
        head, emb = self.lm_head_weight, self.embed_weight
        return BaseView(head, emb, head.shape[1], head.shape[0], self.base.model)

    @property
    def full_copy_bytes(self) -> int:
        """What keeping the frozen lm_head / embeddings whole costs per rank."""
        n = self.lm_head_weight.numel() * self.lm_head_weight.element_size()
        if self.embed_weight.data_ptr() != self.lm_head_weight.data_ptr():
            n += self.embed_weight.numel() * self.embed_weight.element_size()
        return n

    def memory_report(self) -> dict:
        """Per-rank bytes: partitions held, the whole base, and the full lm_head/embedding copies."""
        return {"partition_bytes": local_partition_bytes(self.base.model),
                "full_base_bytes": full_parameter_bytes(self.base.model),
                "full_copy_bytes": self.full_copy_bytes, "gathered_bytes": gathered_bytes(self.base.model)}

    @contextlib.contextmanager
    def gathered_last_layer(self):
        """The base's last decoder layer gathered whole while inside: Hydra++'s prefix layer and the CTC
        attention module copy its weights (models/prefix_attention.py) when the draft is built."""
        import deepspeed

        layer = _decoder_body(self.base.model).layers[-1]
        with deepspeed.zero.GatheredParameters(list(layer.parameters()), modifier_rank=None):
            yield layer


def _convert_smollm2_first(path: str, dtype: torch.dtype, cache_dir: str | None) -> None:
    """The packaged SmolLM2's one-time GGUF conversion builds and saves a whole model, which must not happen
    under zero.Init: rank 0 converts it (a whole load of the small base) before the partitioned load."""
    import torch.distributed as dist

    from core.paths import default_cache_dir
    from models.base import SMOLLM2_NAME
    from models.smollm2_gguf import MARKER_FILE, smollm2_cache_path

    if path != SMOLLM2_NAME:
        return
    converted = (smollm2_cache_path(Path(cache_dir) if cache_dir else default_cache_dir()) / MARKER_FILE).is_file()
    if not converted and dist.get_rank() == 0:
        load_base(path, dtype=dtype, cache_dir=cache_dir)
    dist.barrier()


def load_partitioned_base(path: str, *, dtype: torch.dtype, device: torch.device,
                          cache_dir: str | None = None, chat_template: str | None = None) -> PartitionedBase:
    """Load `path` (smollm2, tiny, an HF directory) with its parameters partitioned over the ranks of the
    already initialized process group. Collective: every rank must call it."""
    import deepspeed

    ds_config = zero3_inference_config(dtype)
    _convert_smollm2_first(path, dtype, cache_dir)
    with zero3_construction(ds_config):
        base = load_base(path, dtype=dtype, device=device, cache_dir=cache_dir, chat_template=chat_template)
    model = base.model
    body = _decoder_body(model)
    engine, _, _, _ = deepspeed.initialize(model=body, config=ds_config)
    engine.eval()
    # Parameters outside the body (an untied lm_head) are partitioned when built under zero.Init, and kept
    # whole otherwise; _gathered_copy handles both (GatheredParameters ignores parameters that are whole).
    head = model.get_output_embeddings().weight
    emb = model.get_input_embeddings().weight
    head_copy = _gathered_copy(head)
    emb_copy = head_copy if emb is head else _gathered_copy(emb)
    out = PartitionedBase(base, engine, head_copy, emb_copy)
    mem = out.memory_report()
    log.info("base partitioned with ZeRO-3: %.1f MiB of parameters on this rank (whole base %.1f MiB) + "
             "%.1f MiB full lm_head/embedding copy", mem["partition_bytes"] / 2**20,
             mem["full_base_bytes"] / 2**20, mem["full_copy_bytes"] / 2**20)
    return out
