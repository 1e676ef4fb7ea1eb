"""What the rest of specdraft needs to know about a draft family, declared once, next to the family's model.

Every trainable family's model class (models/<family>.py) sets `facts = FamilyFacts(...)` and may override
`DraftModel.check_config` for the training-config rules only it has; a learning-free family (N-gram) declares a
module-level `facts` in its models/<family>.py. models/registry.py finds the declarations by scanning models/ (no
list of families is kept anywhere), and eval/engine/drafters/registry.py finds each family's drafter module by its
name. A family's training options are dataclasses in its own file, named here (`draft_options`, `loss_options`):
train/config.py nests them as the sections `draft.<name>` and `loss.<name>` (`draft.eagle3.ttt_steps`), so a new
family's options never touch a shared file. Everything other layers used to keep in tables of their own (which
export formats a family has and which function writes each, which vLLM method or llama.cpp spec type serves it,
whether vLLM may schedule its draft count, whether the teacher-forced chain estimate can read its loss, the types
of its export's own keys) is a field here, read through the registry.
"""

from __future__ import annotations

import dataclasses
import importlib
import re
from collections.abc import Callable
from dataclasses import dataclass, field

# Every format `specdraft export --format` knows; a family lists those it supports.
EXPORT_FORMATS = ("specdraft", "medusa", "redrafter-trtllm", "speculators", "vllm", "gguf")
_REF = re.compile(r"[A-Za-z_][\w.]*:[A-Za-z_]\w*")  # "package.module:function" (FamilyFacts.exporters)
_KEY_TYPES = (int, bool, str, list)  # what FamilyFacts.export_key_types may declare


@dataclass(frozen=True)
class FamilyFacts:
    name: str  # registry key; the export config.json's "family"; configs/<name>.yaml is its recipe
    title: str  # name in tables and messages ("Medusa", "EAGLE-3")
    export_formats: tuple[str, ...] = ("specdraft",)  # formats `specdraft export --format` writes for it
    # The speculative method of vLLM that serves its `--format vllm` export (None: vLLM cannot serve it). Engines
    # draft a chain of top-1 tokens; its drafter module says how deep (chain_depth, eval/engine/drafters/registry.py).
    vllm_method: str | None = None
    # vLLM's proposer for that method drafts the count its scheduler picks per step, so `specdraft tune
    # --concurrency` may store a per-batch-size schedule for it (vLLM 0.32: eagle3, dflash; Medusa's asserts the
    # configured count).
    vllm_schedule: bool = False
    # llama.cpp's `--spec-type` that serves its `--format gguf` export (None: llama.cpp cannot serve it).
    llamacpp_spec_type: str | None = None
    # True: llama.cpp drafts the draft's whole block or none of it (DFlash: --spec-draft-n-max is block_size - 1,
    # the slots see each other), so a shorter tuned chain cannot be served there.
    llamacpp_whole_block: bool = False
    # The family's own writer of each export format whose files differ per family, as "module:function": named, not
    # imported, so a model module never imports an exporter or a serving layer; the code that writes the format
    # imports it (`writer`). "vllm": (draft, out_dir, export_cfg, base_view) -> out_dir, models/export/vllm.py: the
    # directory vLLM serves (N-gram's takes its eval options instead: export_vllm_ngram). "gguf": (draft,
    # export_cfg, base_dir, out_dir) -> the directory llama.cpp's converter reads, eval/serving/llamacpp_gguf.py.
    exporters: dict[str, str] = field(default_factory=dict, hash=False)
    trainable: bool = True  # False: learning-free (no model to train, no export of weights)
    # Its loss scores depth k at root t from positions <= t + k only, without randomness, so train/chain_estimate.py
    # can difference it over cuts of a text to replay the decoder's chain walk (DFlash samples block anchors, CTC
    # reports a collapsed draft's prefix accuracy: neither).
    chain_estimate: bool = False
    # Keys its export's config.json must have besides the common ones (checked by models/export/schema.py).
    export_keys: tuple[str, ...] = ()
    # Keys only its export writes, with their type (int: an integer >= 0; bool; str; list), checked beside the
    # shared ones of models/export/schema.py: KEYS (which a new family's keys need not touch).
    export_key_types: dict[str, type] = field(default_factory=dict, hash=False)
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
        if self.vllm_schedule and self.vllm_method is None:
            raise ValueError(f"family {self.name!r}: vllm_schedule needs a vLLM method")
        for fmt, needs in (("vllm", self.vllm_method), ("gguf", self.llamacpp_spec_type)):
            if (fmt in self.exporters) != (needs is not None):
                raise ValueError(f"family {self.name!r}: the {fmt!r} format needs its writer in `exporters` (and "
                                 "only a family that has the format names one)")
        for fmt, ref in self.exporters.items():
            if fmt not in self.export_formats:
                raise ValueError(f"family {self.name!r} names a writer of {fmt!r}, which is not in its export_formats")
            if not _REF.fullmatch(ref):
                raise ValueError(f"family {self.name!r}: writer {ref!r} of {fmt!r} must be 'package.module:function'")
        bad_types = {k: t for k, t in self.export_key_types.items() if t not in _KEY_TYPES}
        if bad_types:
            raise ValueError(f"family {self.name!r}: export_key_types {bad_types} must be one of "
                             f"{', '.join(t.__name__ for t in _KEY_TYPES)}")
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

    def writer(self, fmt: str) -> Callable:
        """The function `exporters[fmt]` names, imported now (by the layer that writes `fmt`)."""
        if fmt not in self.exporters:
            raise ValueError(f"the {self.title} family has no writer of its own for {fmt!r}; its formats: "
                             f"{', '.join(self.export_formats)}")
        module, _, name = self.exporters[fmt].partition(":")
        return getattr(importlib.import_module(module), name)

    def option_keys(self) -> list[str]:
        """Its nested training-config keys ("draft.eagle3.ttt_steps"), draft options first."""
        return [f"{section}.{self.name}.{f.name}"
                for section, options in (("draft", self.draft_options), ("loss", self.loss_options))
                if options is not None for f in dataclasses.fields(options)]
