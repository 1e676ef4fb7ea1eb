"""The `specdraft` command line: the composition root, the one package that imports across the layers."""

from core.paths import CONFIGS, REPO_ROOT  # noqa: F401 (the CLI's names for them)
