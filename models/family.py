"""What the rest of specdraft needs to know about a draft family, declared once, next to the family's model.

Every trainable family's model class (models/<family>.py) sets `facts = FamilyFacts(...)` and may override
`DraftModel.check_config` for the training-config rules only it has; the learning-free N-gram family declares
its facts in models/ngram.py. The tables other layers used to keep by hand (which export formats a family has,
which vLLM method or llama.cpp spec type serves it, which families a serving engine can run) are derived from
these declarations (models/registry.py: FAMILIES).
"""

from __future__ import annotations

from dataclasses import dataclass

# Every format `specdraft export --format` knows; a family lists those it supports.
EXPORT_FORMATS = ("specdraft", "medusa", "redrafter-trtllm", "speculators", "vllm", "gguf")


@dataclass(frozen=True)
class FamilyFacts:
    name: str  # registry key; the export config.json's "family"; configs/<name>.yaml is its recipe
    title: str  # name in tables and messages ("Medusa", "EAGLE-3")
    export_formats: tuple[str, ...] = ("specdraft",)  # formats `specdraft export --format` writes for it
    # The speculative method of vLLM that serves its `--format vllm` export (None: vLLM cannot serve it). Engines
    # draft a chain of top-1 tokens; its drafter module says how deep (chain_depth, eval/engine/drafters/registry.py).
    vllm_method: str | None = None
    # llama.cpp's `--spec-type` that serves its `--format gguf` export (None: llama.cpp cannot serve it).
    llamacpp_spec_type: str | None = None
    # True: llama.cpp drafts the draft's whole block or none of it (DFlash: --spec-draft-n-max is block_size - 1,
    # the slots see each other), so a shorter tuned chain cannot be served there.
    llamacpp_whole_block: bool = False
    trainable: bool = True  # False: learning-free (no model to train, no export of weights)
    # Keys its export's config.json must have besides the common ones (checked by models/export/schema.py).
    export_keys: tuple[str, ...] = ()
    # Training-config keys (train/config.py, "draft.x" / "loss.x") only this family reads: a run of another family
    # that sets one away from its default fails at load, naming this family (train/config.py: validate).
    config_keys: tuple[str, ...] = ()

    def __post_init__(self):
        unknown = sorted(set(self.export_formats) - set(EXPORT_FORMATS))
        if unknown:
            raise ValueError(f"family {self.name!r} declares unknown export formats {unknown}; "
                             f"known: {', '.join(EXPORT_FORMATS)}")
        if (self.vllm_method is None) == ("vllm" in self.export_formats):
            raise ValueError(f"family {self.name!r}: a vLLM method goes with the 'vllm' export format and only then")
        if (self.llamacpp_spec_type is None) == ("gguf" in self.export_formats):
            raise ValueError(f"family {self.name!r}: a llama.cpp spec type goes with the 'gguf' export format and "
                             "only then")
        if self.llamacpp_whole_block and self.llamacpp_spec_type is None:
            raise ValueError(f"family {self.name!r}: llamacpp_whole_block needs a llama.cpp spec type")
