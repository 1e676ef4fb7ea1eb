"""What the rest of specdraft needs to know about a draft family, declared once, in the family's own package.

Every family is one package, models/families/<name>/ (models/families/__init__.py registers them). Its model class
(model.py) sets `facts = FamilyFacts(...)` and may override `DraftModel.check_config` for the training-config rules
only it has; a learning-free family (N-gram) declares a module-level `facts` in its model.py. The package's
__init__.py builds its registration, `spec = FamilySpec(...)`: the facts, the model class and its export writers,
referenced directly. A family's training options are dataclasses in its own files, named here (`draft_options`,
`loss_options`): train/config.py nests them as the sections `draft.<name>` and `loss.<name>`
(`draft.eagle3.ttt_steps`), so a new family's options never touch a shared file. Everything other layers used to
keep in tables of their own (which export formats a family has, which vLLM method or llama.cpp spec type serves it,
whether vLLM may schedule its draft count, whether the teacher-forced chain estimate can read its loss, the types
of its export's own keys) is a field here, read through the registry.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field

# Every format `specdraft export --format` knows; a family lists those it supports.
EXPORT_FORMATS = ("specdraft", "medusa", "redrafter-trtllm", "speculators", "vllm", "gguf")
_KEY_TYPES = (int, bool, str, list)  # what FamilyFacts.export_key_types may declare


@dataclass(frozen=True)
class FamilyFacts:
    name: str  # registry key; the export config.json's "family"; configs/<name>.yaml is its recipe
    title: str  # name in tables and messages ("Medusa", "EAGLE-3")
    export_formats: tuple[str, ...] = ("specdraft",)  # formats `specdraft export --format` writes for it
    # The speculative method of vLLM that serves its `--format vllm` export (None: vLLM cannot serve it). Engines
    # draft a chain of top-1 tokens; its drafter module says how deep (num_speculative_tokens,
    # eval/engine/drafters/registry.py).
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
    # Shared keys its own option declares for it ({"draft.num_heads": "draft.eagle3.ttt_steps"}): the option is the
    # one declaration, the shared key is set from it when the config loads, and a config that still sets the shared
    # key is read as the option with a note (train/config.py: upgrade_flat_keys). A new family needs none.
    shared_from: dict[str, str] = field(default_factory=dict, hash=False)
    config_keys: tuple[str, ...] = ()  # gone: the flat per-family keys are now draft_options / loss_options
    # One line for the families tables (README.md, docs/families/README.md: `specdraft docs-families`).
    summary: str = ""
    # Files it uses outside its folder (models/families/<name>/) beyond its loss module, recipes and docs page, for
    # the families tables, e.g. a shared block only it and another family use.
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

    def option_keys(self) -> list[str]:
        """Its nested training-config keys ("draft.eagle3.ttt_steps"), draft options first."""
        return [f"{section}.{self.name}.{f.name}"
                for section, options in (("draft", self.draft_options), ("loss", self.loss_options))
                if options is not None for f in dataclasses.fields(options)]


@dataclass(frozen=True)
class FieldRun:
    """A run a family contributes to the field-families experiment (recipes/field_families.sh: every family at one
    budget, judged on the field benchmark; recipes/field_plan.py prints them). The strings are the recipe's own."""

    name: str  # the run's name, REPORTS/<prefix>-<name> ("hydra_pp": a Hydra variant)
    label: str  # its row's name in the table ("Hydra++")
    # Its config file and its recipe's overrides (after the experiment's shared ones: they win); a learning-free run
    # has the script that judges it instead, run per shape as `<script> --refs REFS <shape's overrides> --out DIR`.
    args: str
    shapes: tuple[str, ...] = ("default",)  # field shapes judged, "name overrides...", chains first
    default: bool = True  # in the experiment's default run list (P-EAGLE is not)
    queue: int = 100  # its place in the default queue, lower first (the built-in runs number theirs 1-10)
    # The run every other run is paired with (`specdraft field --against`): its first shape with their first (the
    # chains), its second with their later ones (trees, beams, paths). One run at most.
    reference: bool = False
    # A script run once on the trained draft beside its field reports (`<script> --draft EXPORT --refs REFS
    # --num-prompts 10 --out REPORTS/<run>/<script's stem>.json`): the CTC drafter's blank and collapse diagnostics.
    diagnostics: str = ""


# Export formats whose files differ per family: each family that has one names its writer in FamilySpec.writers.
OWN_FORMATS = tuple(f for f in EXPORT_FORMATS if f not in ("specdraft", "gguf"))


@dataclass(frozen=True)
class FamilySpec:
    """A family's registration (models/families/__init__.py: register_family), built in its package's __init__.py.

    What sits in the layers above models is found by role, never named here: the layer that needs it imports
    `<package>.<role>`, a fixed module name: `drafter` (eval/engine/drafters/registry.py: the drafter declaration),
    `tune` and `lockstep` (optional declarations of its drafter; eval/engine), `sweep` (eval/harness/runner.py: a
    learning-free family's option sweep), `gguf` (eval/serving/llamacpp_gguf.py: `converter_input`, what
    llama.cpp's converter reads)."""

    package: str  # its package ("models.families.eagle3"); the role modules hang off it
    facts: FamilyFacts
    model: type | None = None  # its DraftModel subclass (declaring `facts`); None: learning-free
    # Its writer of each format of OWN_FORMATS it exports: (draft, out_dir, export_cfg, base_view) -> out_dir (a
    # learning-free family's "vllm" writer takes (eval options, out_dir): N-gram's has no draft).
    writers: dict[str, Callable] = field(default_factory=dict, hash=False)
    # Its runs of the field-families experiment (models/registry.py: field_runs; none declared: a trainable family
    # contributes one run named after it, configs/<name>.yaml as it is, its drafter's default shape).
    field_runs: tuple[FieldRun, ...] = ()

    @property
    def name(self) -> str:
        return self.facts.name

    def __post_init__(self):
        f = self.facts
        if (self.model is not None) != f.trainable or (self.model is not None and self.model.facts is not f):
            raise ValueError(f"family {f.name!r}: a trainable family registers its model class (whose `facts` are "
                             "the spec's), a learning-free one (trainable=False) none")
        need = {fmt for fmt in f.export_formats if fmt in OWN_FORMATS}
        if set(self.writers) != need:
            raise ValueError(f"family {f.name!r}: FamilySpec.writers must hold a writer for each of its formats "
                             f"{sorted(need)} (files that differ per family), got {sorted(self.writers)}")
