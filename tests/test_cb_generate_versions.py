"""data/cb_generate.py against the transformers it meets: ours (5.24, `page_size`) and the GPU image's (5.17, whose
ContinuousBatchingConfig has only `block_size`). `make gpu-dry` runs the kit's calls with the image's version
(.venv-image); this checks the one name that differs, on whichever version is installed and on both shapes."""

from __future__ import annotations

import dataclasses

from transformers.generation.configuration_utils import ContinuousBatchingConfig

from data.cb_generate import PAGE_SIZE, HFCBGenerator, _page_size_key
from models.tiny import tiny_model


@dataclasses.dataclass
class Old:  # transformers 5.17
    block_size: int = 256
    num_blocks: int | None = None


@dataclasses.dataclass
class New:  # transformers 5.24: page_size, block_size kept as a deprecated alias
    page_size: int = 256
    num_blocks: int | None = None
    block_size: int | None = None


def test_the_page_size_goes_by_the_name_each_version_has():
    assert _page_size_key(Old) == "block_size" and _page_size_key(New) == "page_size"


def test_the_cpu_config_builds_on_the_installed_transformers():
    engine = HFCBGenerator(tiny_model("llama", seed=0), [2], 8, 0.0, max_requests=3)
    cfg = engine._cb_config([10, 70, 5], [8, 8, 8], seed=0)
    assert isinstance(cfg, ContinuousBatchingConfig)
    assert getattr(cfg, _page_size_key(ContinuousBatchingConfig)) == PAGE_SIZE
    assert cfg.num_blocks == 1 + 2 + 1 + 1 and cfg.max_requests_per_batch == 3
