"""The one place the DeepSpeed JSON is built from the typed config."""

from __future__ import annotations

import torch

from train.config import TrainConfig


def resolve_precision(precision: str, device: torch.device) -> str:
    """auto = bf16 on CUDA devices that support it, fp32 elsewhere; fast = bf16 also on CPUs with bf16 matrix
    instructions (core.hardware.cpu_has_fast_bf16), fp32 on the others, where bf16 matmuls are emulated and slower."""
    if precision == "fast":
        from core.hardware import cpu_has_fast_bf16

        if device.type == "cpu":
            return "bf16" if cpu_has_fast_bf16() else "fp32"
        precision = "auto"
    if precision != "auto":
        return precision
    if device.type == "cuda" and torch.cuda.is_bf16_supported():
        return "bf16"
    return "fp32"


def grad_accumulation_steps(cfg: TrainConfig, world_size: int) -> int:
    t = cfg.train
    per_step = t.micro_batch_size * world_size
    if t.global_batch_size % per_step:
        raise ValueError(
            f"train.global_batch_size={t.global_batch_size} is not divisible by micro_batch_size "
            f"({t.micro_batch_size}) x world size ({world_size}); pick a global batch that is a multiple of "
            f"{per_step} or change train.micro_batch_size")
    return t.global_batch_size // per_step


def build_deepspeed_config(cfg: TrainConfig, world_size: int, precision: str) -> dict:
    ds = cfg.deepspeed
    zero: dict = {"stage": ds.zero_stage}
    if ds.zero_stage > 0:
        zero.update({"overlap_comm": ds.overlap_comm, "contiguous_gradients": True,
                     "reduce_bucket_size": ds.bucket_size, "allgather_bucket_size": ds.bucket_size})
    if ds.offload_optimizer == "cpu":
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": torch.cuda.is_available()}
    out = {
        "train_micro_batch_size_per_gpu": cfg.train.micro_batch_size,
        "gradient_accumulation_steps": grad_accumulation_steps(cfg, world_size),
        "gradient_clipping": cfg.train.grad_clip,
        "zero_optimization": zero,
        "bf16": {"enabled": precision == "bf16"},
        "steps_per_print": 10**9,  # we log ourselves (rank 0, tqdm + metrics.jsonl)
        "wall_clock_breakdown": False,
    }
    _deep_merge(out, ds.extra)
    return out


def _deep_merge(dst: dict, src: dict) -> None:
    for k, v in src.items():
        if isinstance(v, dict) and isinstance(dst.get(k), dict):
            _deep_merge(dst[k], v)
        else:
            dst[k] = v
