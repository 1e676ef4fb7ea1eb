"""What the rest of specdraft needs to know about a draft family, declared once, next to the family's model.

Every trainable family's model class (models/<family>.py) sets `facts = FamilyFacts(...)` and may override
`DraftModel.check_config` for the training-config rules only it has; the learning-free N-gram family declares
its facts in models/ngram.py. A family's training options are dataclasses in its own file, named here
(`draft_options`, `loss_options`): train/config.py nests them as the sections `draft.<name>` and `loss.<name>`
(`draft.eagle3.ttt_steps`), so a new family's options never touch a shared file. The tables other layers used to
keep by hand (which export formats a family has, which vLLM method or llama.cpp spec type serves it, which
families a serving engine can run) are derived from these declarations (models/registry.py: FAMILIES).
"""

from __future__ import annotations

import dataclasses
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
    # Its training options, dataclasses whose every field has a default and a comment (the comment is the config
    # reference's documentation): `draft_options` become the keys draft.<name>.*, `loss_options` loss.<name>.*
    # (train/config.py). A run of another family that sets one away from its default fails at load, naming this
    # family. Options several families read stay in the shared sections (draft.num_heads, draft.aux_layers).
    draft_options: type | None = None
    loss_options: type | None = None
    # Flat keys these options had before they were nested ("draft.ttt_steps", "loss.token_weight"): a config that
    # still uses one is read as draft.<name>.<key> with a note (train/config.py: upgrade_flat_keys). A new family
    # has none.
    flat_keys: tuple[str, ...] = ()
    config_keys: tuple[str, ...] = ()  # gone: the flat per-family keys are now draft_options / loss_options
    # One line for the families tables (README.md, docs/families/README.md: `specdraft docs-families`).
    summary: str = ""
    # Files of the family beyond its model, drafter, loss module, recipes and docs page (found by name), for the
    # families tables, e.g. a block only it uses.
    also_files: tuple[str, ...] = ()

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
        if self.config_keys:
            raise ValueError(f"family {self.name!r}: config_keys {list(self.config_keys)} are gone; declare the "
                             "family's options as dataclasses in its own file (FamilyFacts.draft_options / "
                             "loss_options, keys draft.<name>.* / loss.<name>.*; docs/howto/add_a_family.md)")
        for section, options in (("draft", self.draft_options), ("loss", self.loss_options)):
            if options is None:
                continue
            if not dataclasses.is_dataclass(options):
                raise ValueError(f"family {self.name!r}: {section}_options must be a dataclass, got {options!r}")
            missing = [f.name for f in dataclasses.fields(options)
                       if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
            if missing:
                raise ValueError(f"family {self.name!r}: every option needs a default; {options.__name__} has none "
                                 f"for {', '.join(missing)}")
        for key in self.flat_keys:
            section, _, name = key.partition(".")
            options = {"draft": self.draft_options, "loss": self.loss_options}.get(section)
            if options is None or name not in {f.name for f in dataclasses.fields(options)}:
                raise ValueError(f"family {self.name!r}: flat key {key!r} is not a field of its {section}_options")

    def option_keys(self) -> list[str]:
        """Its nested training-config keys ("draft.eagle3.ttt_steps"), draft options first."""
        return [f"{section}.{self.name}.{f.name}"
                for section, options in (("draft", self.draft_options), ("loss", self.loss_options))
                if options is not None for f in dataclasses.fields(options)]
