"""A tuned choice: how `specdraft tune` makes it (stats.py), where it keeps it (record.py: the export's
tuning.json) and how a run applies it where it was measured (apply.py: `specdraft eval` / `field`, `serve-check`,
`export --format vllm`).

This package sits below the harness, the field benchmark and serving (docs/architecture.md, the layer rule): they
read tuning.json through it, and eval/tune/, which makes the choice, drives them from above. Import from the modules
(`from eval.choice.apply import tuned_eval_config`).
"""
