"""A tuned choice: how `specdraft tune` makes it (stats.py), where it keeps it (record.py: the export's
tuning.json) and how a run applies it where it was measured (apply.py: `specdraft eval` / `field`, `serve-check`,
`export --format vllm`).

This subpackage sits below the harness (docs/architecture.md, the layer rule): the eval runner and serve-check read
tuning.json through it, while the rest of eval/tune/ drives our decoder and the serving engines from above them.
"""

from eval.tune.choice.apply import (
    Decision,
    apply_knobs,
    decide,
    ours_here,
    serving_here,
    shape_keys_set,
    tuned_eval_config,
    tuned_serving_chain,
    untuned_speed,
    vllm_export_config,
)
from eval.tune.choice.record import (
    MIN_REPEATS,
    RUN_ID,
    TOKENS_KNOB,
    TUNING_FILE,
    TUNING_FORMAT,
    WHERE_FIELDS,
    applicable,
    describe_choice,
    engine_device,
    machine_info,
    quick_elsewhere,
    read_tuning,
    repeats_mark,
    retune_command,
    tuned_choice,
    tuned_num_speculative_tokens,
    where_measured,
    write_tuning,
)
from eval.tune.choice.stats import (
    AR_LABEL,
    CONFIDENCE,
    DEFAULT_ALPHA,
    DEFAULT_MIN_GAIN,
    EXACT_DTYPES,
    bonferroni_quantile,
    choose,
    confirmation_interval,
    geomean,
    is_exact,
    log_mean,
    pooled_noise,
    t_cdf,
    t_quantile,
)

__all__ = [
    "AR_LABEL", "CONFIDENCE", "DEFAULT_ALPHA", "DEFAULT_MIN_GAIN", "EXACT_DTYPES",
    "MIN_REPEATS", "RUN_ID", "TOKENS_KNOB", "TUNING_FILE",
    "TUNING_FORMAT", "WHERE_FIELDS", "Decision", "applicable", "apply_knobs", "bonferroni_quantile", "choose",
    "confirmation_interval", "decide", "describe_choice", "engine_device", "geomean", "is_exact", "log_mean",
    "machine_info", "ours_here", "pooled_noise", "quick_elsewhere", "read_tuning",
    "repeats_mark", "retune_command", "serving_here", "shape_keys_set",
    "t_cdf", "t_quantile", "tuned_num_speculative_tokens", "tuned_choice", "tuned_eval_config", "tuned_serving_chain",
    "untuned_speed", "vllm_export_config", "where_measured", "write_tuning",
]
