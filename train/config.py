"""Typed training config: every default lives here; YAML recipes in configs/ are deltas over it.

    cfg = load_train_config(["configs/medusa.yaml", "configs/smoke.yaml"], ["train.lr=3e-4"])

Each component receives only its own section (cfg.data, cfg.draft, ...). `validate` runs at load and
fails with the key and the fix, so a bad value never reaches a half-finished run.

The options only one family reads are not here: each family declares them as dataclasses in its own folder
(FamilyFacts.draft_options / loss_options, models/families/<family>/model.py), and DraftSection / LossSection nest
them as `draft.<family>` / `loss.<family>` (`draft.eagle3.ttt_steps`, `loss.ctc.token_weight`). The flat keys they had
before (`draft.ttt_steps`) still load, read at their new place with a note (`upgrade_flat_keys`).
"""

from __future__ import annotations

import copy
import dataclasses
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from core.config_loader import ConfigError, Layers, load_typed, to_dict
from core.paths import CONFIGS
from models.registry import DRAFT_MODELS, FAMILIES, config_key_owners, flat_key_owners, option_sections
from train.optimizer import OPTIMIZERS, has_muon

SNAPSHOT_EVALS = ("auto", "field", "decode")  # train.snapshot_eval

log = logging.getLogger(__name__)


@dataclass
class BaseSection:
    path: str = "smollm2"  # "smollm2" (packaged GGUF), "tiny" / "tiny-<arch>" (random, tests), or an HF model directory
    dtype: str = "auto"  # auto = bf16 on CUDA, fp32 on CPU; or fp32 | bf16 | fp16
    partition: str = "none"  # none = whole base on every rank | zero3 = ZeRO-3 partitions, gathered per layer
    # (docs/howto/large_bases.md)


@dataclass
class DataSection:
    source: str = "sharegpt"  # "sharegpt" (the PyPI package) or a ShareGPT .json/.jsonl path
    max_records: int | None = None  # read at most this many valid conversations (None = all)
    max_length: int = 1024  # tokens per conversation after the chat template (truncated)
    val_fraction: float = 0.05  # share of the conversations held out for validation (per-depth accuracy)
    min_assistant_tokens: int = 8  # drop conversations with fewer supervised tokens
    seed: int = 0  # train/val split seed
    cache_dir: str = ""  # "" = $SPECDRAFT_CACHE or ~/.cache/specdraft, subdir data/
    num_proc: int = 1  # processes for tokenizing the data set (datasets.map)
    hidden_cache: str = ""  # "" = run the base every step; "auto" = cache h under cache_dir; or a directory
    hidden_cache_dtype: str = "bf16"  # storage dtype of the cached h: bf16 (half the disk) | fp32 (exact)
    hidden_cache_shard_rows: int = 256  # rows per cache shard: the unit of resume and of the ranks' work split
    # Opening a cache always checks every shard's size against its manifest; true also checks their sha256 (about
    # a second per GiB) and rebuilds any shard that fails.
    hidden_cache_verify: bool = False
    self_distill: bool = False  # train on the base's own answers to the first max_records prompts (Medusa-2)
    self_distill_max_new_tokens: int = 256  # answer length cap of the regenerated turns
    self_distill_temperature: float = 0.0  # 0 = greedy answers; > 0 samples at that temperature
    # > 0: also score the draft on the base's own answers (regenerated once, cached) to this many prompts that come
    # after the training conversations in the prompt source; the acceptance estimate then uses these numbers
    # (docs/concepts.md#on-policy-data). Needs data.max_records (or a regenerated source, which records its slice).
    onpolicy_heldout: int = 0
    # "" = the tokenizer's own chat template; else chatml | llama3 | gemma | a .jinja file, used when the
    # base ships none (base checkpoints) or to override its own; recorded in the export for eval.
    chat_template: str = ""


@dataclass
class SharedDraftSection:
    """The draft keys several families read; DraftSection adds one section per family's own options."""

    family: str = "medusa"  # the draft family: a key of models.registry.DRAFT_MODELS (configs/<family>.yaml)
    num_heads: int = 4  # K: depths 1..K predict x_{t+2} .. x_{t+1+K}
    num_layers: int = 1  # ResBlocks per head; DFlash: draft decoder layers (configs/dflash.yaml: 5)
    share_lm_head: bool = False  # True: every head uses the frozen base lm_head (far fewer parameters)
    dropout: float = 0.0  # dropout inside the heads (Medusa, Hydra, ReDrafter, CTC; Hydra++ recipe: 0.2)
    vocab_size: int = 0  # draft vocabulary: N most frequent target tokens (data/draft_vocab.py); 0 = all V
    aux_layers: list[int] = field(default_factory=list)  # EAGLE-3 / DFlash: fc's base layers; [] = [2, L//2, L-3]


@dataclass
class SharedLossSection:
    """The loss keys several families read; LossSection adds one section per family's own loss options."""

    lambda0: float = 1.0  # head k weight = lambda0 * decay**k (k = 1..K)
    decay: float = 0.8  # see lambda0
    teacher_weight: float = 0.0  # alpha: loss = (1-alpha)*hard CE + alpha*soft CE to the base at t+k
    chunked: bool = True  # fused chunked CE (never holds K*T*V logits); False = plain reference
    chunk_size: int = 1024  # tokens per chunk in the fused loss


def _with_family_sections(shared: type, section: str) -> type:
    """`shared` plus one field per family with options in this section ("draft" / "loss"): <section>.<family>, an
    instance of the family's own dataclass (models/families/<family>/model.py), defaults and all."""
    own = option_sections(section)
    clash = sorted(set(own) & {f.name for f in dataclasses.fields(shared)})
    if clash:
        raise ValueError(f"families {clash} are named like shared {section} keys; rename the family")
    cls = dataclasses.make_dataclass(shared.__name__.removeprefix("Shared"),
                                     [(name, opts, field(default_factory=opts)) for name, opts in own.items()],
                                     bases=(shared,))
    cls.__module__ = __name__
    cls.__doc__ = (f"{section}.*: the shared keys ({shared.__name__}) and {section}.<family>.* for each family's own "
                   "options")
    return cls


DraftSection = _with_family_sections(SharedDraftSection, "draft")
LossSection = _with_family_sections(SharedLossSection, "loss")


@dataclass
class TrainSection:
    epochs: float = 1.0  # passes over the training conversations (fractions allowed)
    max_steps: int = 0  # > 0 overrides epochs and max_tokens
    # > 0 overrides epochs: as many steps as see about this many tokens (prompt and answer, after truncation) at the
    # train split's mean conversation length; compares data sets of different lengths at one token budget
    max_tokens: int = 0
    max_minutes: float = 0.0  # > 0: stop (and save) after this much training wall time
    global_batch_size: int = 16  # conversations per optimizer step, over all ranks
    micro_batch_size: int = 4  # conversations per forward on one rank
    lr: float = 1e-3  # peak learning rate (AdamW), reached after warmup
    weight_decay: float = 0.0  # AdamW weight decay (and Muon's, with optimizer=muon)
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])  # AdamW betas
    # adamw | muon: Muon (torch.optim.Muon, its update scaled to AdamW's size) for the draft's hidden 2-D weight
    # matrices and AdamW for the rest (norms, biases, LM heads, embeddings); needs deepspeed.zero_stage=0
    # (train/optimizer.py)
    optimizer: str = "adamw"
    muon_lr: float = 0.0  # optimizer=muon: Muon's peak learning rate; 0 = train.lr (speculators uses 0.02)
    warmup_ratio: float = 0.05  # share of the steps spent warming the LR up linearly
    min_lr_ratio: float = 0.1  # cosine decays to lr * min_lr_ratio
    grad_clip: float = 1.0  # max gradient norm; 0 = off
    precision: str = "auto"  # auto = bf16 on CUDA with bf16 support, else fp32; or fp32 | bf16
    log_every: int = 10  # steps between metrics.jsonl / W&B rows
    save_every: int = 0  # steps between checkpoints; 0 = only at the end (and on SIGTERM)
    keep_checkpoints: int = 2  # newest checkpoints kept in checkpoints/
    # > 0: every this many steps also write a snapshot, exports/step<N>/ (the export plus its heldout.json), so a
    # long run leaves the points of its learning curve to decode (`specdraft eval --draft runs/<run>/exports/...`)
    export_every: int = 0
    val_batches: int = 16  # held-out micro-batches for the per-head accuracy table (0 = skip)
    # > 0: at every snapshot (export_every) and at the end, score the export as a greedy chain of the family's depth
    # on this many prompts (per stored set with snapshot_eval=field) and log its AL; the run's export/ is then the
    # best-scored snapshot, the final state stays in export_last/
    # (docs/howto/train.md#acceptance-while-training-the-best-snapshot-is-the-export). Needs `specdraft train` (cli
    # builds the scorer); 0 = off
    decode_eval_prompts: int = 0
    decode_eval_tokens: int = 64  # new tokens per decoded prompt (snapshot_eval=decode)
    # How snapshots are scored when decode_eval_prompts > 0. field: the exact simulated greedy AL (`specdraft field`)
    # on the stored base answers in field_refs, decode_eval_prompts prompts of each of field_eval_sets, their whole
    # stored answers; the drafter's cost only, so more prompts for the same minutes. decode: decode held-out ShareGPT
    # prompts. auto: field when field_refs holds this base's answers, else decode
    snapshot_eval: str = "auto"
    field_refs: str = "datasets/smollm2-field-refs"  # stored base answers (`specdraft field-refs`), for field
    # the stored sets scored at snapshots (comma-separated): held-out ShareGPT slices, not the sets reported headline
    field_eval_sets: str = "sharegpt-code,sharegpt-math,sharegpt-writing,sharegpt-chat"
    seed: int = 0  # model init, data order and dropout
    # an export directory of the same family and shape, trained on this base: the draft starts from its weights
    # (fresh optimizer and LR schedule) instead of the family's initialisation; "" = off (train/init_from.py)
    init_from: str = ""
    num_threads: int = 0  # CPU threads for torch; 0 = torch's default
    # Sequence parallelism (DeepSpeed Ulysses): each conversation is split over this many ranks, which share it; the
    # base's forward (online training) and the draft's attention over the sequence run sharded, each rank's loss over
    # its rows. Must divide the number of ranks; only families whose loss takes a sequence shard (EAGLE-3, Hydra /
    # Hydra++, CTC, DFlash, DSpark, Domino; others fail at load); 1 = off
    # (docs/howto/train.md#long-sequences-sequence-parallelism)
    sequence_parallel: int = 1


@dataclass
class DeepSpeedSection:
    zero_stage: int = 0  # 0-3 (3 shards the draft's parameters; works, rarely worth it for heads)
    offload_optimizer: str = "none"  # none | cpu
    overlap_comm: bool = False  # overlap gradient reduction with the backward (multi-GPU)
    bucket_size: int = 50_000_000  # reduce/allgather bucket (elements)
    extra: dict[str, Any] = field(default_factory=dict)  # merged verbatim into the DeepSpeed JSON


@dataclass
class WandbSection:
    enabled: bool = True  # false: no W&B at all (metrics.jsonl is always written)
    project: str = "specdraft"  # W&B project
    mode: str = "offline"  # offline | online | disabled; the WANDB_MODE environment variable wins
    entity: str | None = None  # W&B entity (team); None = your default
    tags: list[str] = field(default_factory=list)  # W&B run tags


@dataclass
class TrainConfig:
    run_name: str = "medusa"  # names the run directory runs/<run_name> and the W&B run
    run_dir: str = ""  # "" = runs/<run_name>
    resume: str = "none"  # none | auto (latest checkpoint in run_dir) | path to a checkpoint dir
    base: BaseSection = field(default_factory=BaseSection)
    data: DataSection = field(default_factory=DataSection)
    draft: DraftSection = field(default_factory=DraftSection)
    loss: LossSection = field(default_factory=LossSection)
    train: TrainSection = field(default_factory=TrainSection)
    deepspeed: DeepSpeedSection = field(default_factory=DeepSpeedSection)
    wandb: WandbSection = field(default_factory=WandbSection)

    @property
    def resolved_run_dir(self) -> Path:
        return Path(self.run_dir) if self.run_dir else Path("runs") / self.run_name


def _fail(key: str, value, fix: str) -> None:
    raise ConfigError(f"invalid value {key}={value!r}: {fix}")


def _get(cfg, key: str):
    for part in key.split("."):
        cfg = getattr(cfg, part)
    return cfg


def _check_family_keys(cfg: TrainConfig) -> None:
    """A family's own option (draft.<family>.* / loss.<family>.*), set away from its default on another family's
    run, is a mistake (it would be ignored): fail naming the family it belongs to."""
    defaults = TrainConfig()
    for key, owner in config_key_owners().items():
        value = _get(cfg, key)
        if owner != cfg.draft.family and value != _get(defaults, key):
            _fail(key, value, f"an option of the {FAMILIES[owner].title} family ({owner}) only, and this run trains "
                  f"{cfg.draft.family}: drop it, or set draft.family={owner}")


def _field_names(cls: type) -> set[str]:
    return {f.name for f in dataclasses.fields(cls)}


def upgrade_flat_keys(layers: Layers, note: Callable[[str], None] | None = None) -> Layers:
    """Reads the flat per-family keys of older configs (`draft.ttt_steps`, in a recipe, an override or a run's saved
    config.yaml) at their place in the family's section (`draft.eagle3.ttt_steps`), with one note per file or
    override naming the new keys. A flat key goes to the run's family (the last draft.family of the layers) when
    that family has the option, else to the family it moved into (FamilyFacts.flat_keys); a key several other
    families have, or given both flat and nested with different values, fails naming the new keys. A shared key the
    run's family declares by an option of its own (FamilyFacts.shared_from: EAGLE-3's draft.num_heads is its
    draft.eagle3.ttt_steps) is read as that option, with the same note; `validate` sets the shared key from it."""
    note = note or log.warning
    family = SharedDraftSection.family
    for _, tree in layers:
        draft = tree.get("draft")
        if isinstance(draft, dict) and "family" in draft:
            family = draft["family"]
    moved_to = flat_key_owners()
    out = []
    for where, tree in layers:
        tree, moved = copy.deepcopy(tree), []
        for section, shared in (("draft", SharedDraftSection), ("loss", SharedLossSection)):
            sub, own = tree.get(section), option_sections(section)
            if not isinstance(sub, dict):
                continue
            for key in [k for k in sub if k not in _field_names(shared) and k not in own]:
                if family in own and key in _field_names(own[family]):
                    target = family
                elif f"{section}.{key}" in moved_to:
                    target = moved_to[f"{section}.{key}"]
                else:
                    have = [name for name, opts in own.items() if key in _field_names(opts)]
                    if not have:
                        continue  # an unknown key: the loader names it with the closest valid ones
                    raise ConfigError(f"{where}: '{section}.{key}' is no shared key; it is the family option "
                                      f"{' or '.join(f'{section}.{name}.{key}' for name in have)}, and this run "
                                      f"trains {family}: give the nested key of the family it is for")
                new = f"{section}.{target}.{key}"
                nested = sub.get(target)
                if nested is None:
                    nested = sub[target] = {}
                if not isinstance(nested, dict):
                    raise ConfigError(f"{where}: '{section}.{target}' is a section; give it as a mapping of keys")
                if key in nested and nested[key] != sub[key]:
                    raise ConfigError(f"{where}: '{section}.{key}' (an old flat key, now {new}) and '{new}' are both "
                                      f"set, to {sub[key]!r} and {nested[key]!r}: keep only {new}")
                nested[key] = sub.pop(key)
                moved.append(f"{section}.{key} -> {new}")
        for old, new in (FAMILIES[family].shared_from.items() if family in FAMILIES else ()):
            value = _at(tree, old)
            if value is None:
                continue
            now = _at(tree, new)
            if now is not None and now != value:
                raise ConfigError(f"{where}: '{old}' (for {family} an old key, now {new}) and '{new}' are both set, "
                                  f"to {value!r} and {now!r}: keep only {new}")
            _put(tree, new, value)
            moved.append(f"{old} -> {new}")
        if moved:
            note(f"note: {where}: old flat keys read at their new place: {', '.join(moved)} (write the new keys to "
                 "drop this note)")
        out.append((where, tree))
    return out


def _at(tree: dict, key: str):
    """The value at a dotted key of a config tree, None where it is not set."""
    for part in key.split("."):
        if not isinstance(tree, dict) or part not in tree:
            return None
        tree = tree[part]
    return tree


def _put(tree: dict, key: str, value) -> None:
    """Set a dotted key of a config tree, making its sections."""
    *parents, last = key.split(".")
    for part in parents:
        if tree.get(part) is None:
            tree[part] = {}
        tree = tree[part]
        if not isinstance(tree, dict):
            raise ConfigError(f"'{key}': '{part}' is a section; give it as a mapping of keys")
    tree[last] = value


def saved_config_tree(saved: dict) -> dict:
    """A run's saved config.yaml as this code's full tree: old flat keys at their new place (quietly), and the keys
    it predates at their defaults, which is how the run that wrote it behaved. For comparing it with the config
    resuming the run (train/loop.py)."""
    [(_, tree)] = upgrade_flat_keys([("saved config", saved)], note=lambda _: None)

    def fill(defaults: dict, given: dict) -> dict:
        out = dict(given)
        for k, v in defaults.items():
            if k not in out:
                out[k] = v
            elif isinstance(v, dict) and isinstance(out[k], dict) and k != "extra":
                out[k] = fill(v, out[k])
        return out

    return fill(to_dict(TrainConfig()), tree)


def _check_sequence_parallel(cfg: TrainConfig) -> None:
    """The rules of train.sequence_parallel > 1 that do not depend on the number of ranks (the loop checks that)."""
    family = DRAFT_MODELS.get(cfg.draft.family)
    if family is not None and not family.sequence_parallel:
        able = sorted(name for name, cls in DRAFT_MODELS.items() if cls.sequence_parallel)
        _fail("train.sequence_parallel", cfg.train.sequence_parallel, f"the {family.facts.title} loss does not take "
              f"a sequence shard yet (families that do: {', '.join(able)}); use 1")
    if cfg.base.partition == "zero3":
        _fail("train.sequence_parallel", cfg.train.sequence_parallel, "a ZeRO-3-partitioned base runs its forward "
              "collectively over whole sequences; use base.partition=none with sequence parallelism")
    if cfg.data.self_distill:
        _fail("train.sequence_parallel", cfg.train.sequence_parallel, "build the self-distilled file first "
              "(`specdraft self-distill`) and train on it with data.source=<file>")


def validate(cfg: TrainConfig) -> TrainConfig:
    """Check values that types alone cannot; raise ConfigError naming the key and the fix."""
    t, d = cfg.train, cfg.draft
    if cfg.base.dtype not in ("auto", "fast", "fp32", "bf16", "fp16"):
        _fail("base.dtype", cfg.base.dtype, "use one of auto, fast (bf16 where the hardware runs it fast, else "
              "fp32), fp32, bf16, fp16")
    if cfg.base.partition not in ("none", "zero3"):
        _fail("base.partition", cfg.base.partition, "use none (whole base on every rank) or zero3 (parameters "
              "partitioned over the ranks, for bases larger than one device)")
    if cfg.base.partition == "zero3" and cfg.data.self_distill:
        _fail("base.partition", "zero3", "data.self_distill generates with the base, which a ZeRO-3-partitioned "
              "base does not do here; build the self-distilled file first (`specdraft self-distill`, a whole base) "
              "and train on it with data.source=<file>")
    if d.family not in DRAFT_MODELS:
        _fail("draft.family", d.family, f"use one of {', '.join(sorted(DRAFT_MODELS))}")
    if d.num_heads < 1:
        _fail("draft.num_heads", d.num_heads, "a draft needs at least one head (Medusa default 4)")
    if d.num_layers < 0:
        _fail("draft.num_layers", d.num_layers, "use 0 or more ResBlocks per head")
    if d.vocab_size < 0:
        _fail("draft.vocab_size", d.vocab_size, "use 0 (the full vocabulary) or 1..V draft tokens (e.g. 16384); "
              "the upper bound V is checked against the base when the map is built")
    if not 0.0 <= d.dropout < 1.0:
        _fail("draft.dropout", d.dropout, "use a probability in [0, 1)")
    if d.family in DRAFT_MODELS:
        for shared, own in FAMILIES[d.family].shared_from.items():  # declared by the family's own option
            *parents, last = shared.split(".")
            setattr(_get(cfg, ".".join(parents)), last, _get(cfg, own))
        _check_family_keys(cfg)
        DRAFT_MODELS[d.family].check_config(cfg, _fail)
    if t.lr <= 0:
        _fail("train.lr", t.lr, "the learning rate must be > 0 (Medusa uses 1e-3)")
    if t.micro_batch_size < 1:
        _fail("train.micro_batch_size", t.micro_batch_size, "use 1 or more")
    if t.global_batch_size < t.micro_batch_size or t.global_batch_size % t.micro_batch_size:
        _fail("train.global_batch_size", t.global_batch_size,
              f"must be a multiple of train.micro_batch_size={t.micro_batch_size} "
              f"(e.g. {max(1, t.global_batch_size // t.micro_batch_size) * t.micro_batch_size})")
    if t.epochs <= 0 and t.max_steps <= 0:
        _fail("train.epochs", t.epochs, "set epochs > 0 or train.max_steps > 0")
    if t.max_steps < 0:
        _fail("train.max_steps", t.max_steps, "use 0 (derive from epochs) or a positive step count")
    if not 0.0 <= t.warmup_ratio < 1.0:
        _fail("train.warmup_ratio", t.warmup_ratio, "use a fraction of the steps in [0, 1)")
    if not 0.0 <= t.min_lr_ratio <= 1.0:
        _fail("train.min_lr_ratio", t.min_lr_ratio, "use a fraction in [0, 1]")
    if t.grad_clip < 0:
        _fail("train.grad_clip", t.grad_clip, "use 0 (off) or a positive norm")
    if t.sequence_parallel < 1:
        _fail("train.sequence_parallel", t.sequence_parallel, "use 1 (off) or the number of ranks that share a "
              "sequence (2, 4, 8, ...)")
    if t.sequence_parallel > 1:
        _check_sequence_parallel(cfg)
    if t.optimizer not in OPTIMIZERS:
        _fail("train.optimizer", t.optimizer, f"use one of {', '.join(OPTIMIZERS)}")
    if t.optimizer == "muon" and not has_muon():
        _fail("train.optimizer", "muon", f"the installed torch {torch.__version__} has no torch.optim.Muon; upgrade "
              "torch, or use adamw")
    if t.optimizer == "muon" and cfg.deepspeed.zero_stage > 0:
        _fail("train.optimizer", "muon", f"ZeRO stage {cfg.deepspeed.zero_stage} hands the optimizer flat 1-D "
              "partitions and Muon orthogonalises 2-D matrices: set deepspeed.zero_stage=0 (a draft's optimizer state "
              "is small) or use adamw")
    if t.muon_lr < 0 or (t.muon_lr and t.optimizer != "muon"):
        _fail("train.muon_lr", t.muon_lr, "Muon's peak learning rate: 0 (= train.lr) or more, and only with "
              "train.optimizer=muon")
    if len(t.betas) != 2 or not all(0 <= b < 1 for b in t.betas):
        _fail("train.betas", t.betas, "give two Adam betas in [0, 1), e.g. [0.9, 0.999]")
    if t.precision not in ("auto", "fast", "fp32", "bf16"):
        _fail("train.precision", t.precision, "use auto, fast (bf16 on GPUs and on CPUs with bf16 matrix "
              "instructions, else fp32), fp32 or bf16")
    if t.init_from and not (Path(t.init_from) / "config.json").is_file():
        _fail("train.init_from", t.init_from, "give an export directory (one holding config.json and "
              "model.safetensors, e.g. drafts/smollm2-eagle3-store/export), or leave it empty")
    if t.log_every < 1:
        _fail("train.log_every", t.log_every, "use 1 or more steps")
    if t.decode_eval_prompts < 0:
        _fail("train.decode_eval_prompts", t.decode_eval_prompts, "use 0 (off) or a number of prompts, e.g. 8")
    if t.snapshot_eval not in SNAPSHOT_EVALS:
        _fail("train.snapshot_eval", t.snapshot_eval, f"use one of {', '.join(SNAPSHOT_EVALS)}")
    if t.snapshot_eval == "field" and not [s for s in t.field_eval_sets.split(",") if s.strip()]:
        _fail("train.field_eval_sets", t.field_eval_sets, "name at least one stored set, e.g. sharegpt-chat")
    if t.decode_eval_tokens < 2:
        _fail("train.decode_eval_tokens", t.decode_eval_tokens, "use at least 2 new tokens, e.g. 64")
    if t.keep_checkpoints < 1:
        _fail("train.keep_checkpoints", t.keep_checkpoints, "keep at least 1 checkpoint")
    if cfg.data.max_length < 8:
        _fail("data.max_length", cfg.data.max_length, "use at least 8 tokens (1024 is typical)")
    if not 0.0 < cfg.data.val_fraction < 1.0:
        _fail("data.val_fraction", cfg.data.val_fraction, "use a fraction in (0, 1), e.g. 0.05")
    if cfg.data.max_records is not None and cfg.data.max_records < 2:
        _fail("data.max_records", cfg.data.max_records, "use None (all) or at least 2 (train + val)")
    if cfg.data.hidden_cache_dtype not in ("bf16", "fp32", "fp16"):
        _fail("data.hidden_cache_dtype", cfg.data.hidden_cache_dtype, "use bf16, fp32 or fp16")
    if cfg.data.hidden_cache_shard_rows < 1:
        _fail("data.hidden_cache_shard_rows", cfg.data.hidden_cache_shard_rows, "use 1 or more rows per shard (256 "
              "typical; with N ranks, at least N shards keep every rank busy)")
    if cfg.data.self_distill and cfg.data.max_records is None:
        _fail("data.max_records", None, "data.self_distill regenerates every answer with the base and eval holds out "
              "the conversations after them: set data.max_records=N (e.g. 800)")
    if cfg.data.self_distill_max_new_tokens < 1:
        _fail("data.self_distill_max_new_tokens", cfg.data.self_distill_max_new_tokens, "use 1 or more (256 typical)")
    if cfg.base.partition == "zero3" and cfg.data.onpolicy_heldout:
        _fail("data.onpolicy_heldout", cfg.data.onpolicy_heldout, "the on-policy held-out slice is generated with the "
              "base, which a ZeRO-3-partitioned base cannot do in one process; regenerate it with `specdraft "
              "regenerate` and train on it, or set data.onpolicy_heldout=0")
    if t.max_tokens < 0:
        _fail("train.max_tokens", t.max_tokens, "use 0 (train.epochs decides) or a token count")
    if cfg.data.onpolicy_heldout < 0:
        _fail("data.onpolicy_heldout", cfg.data.onpolicy_heldout, "use 0 (off) or a number of conversations (64)")
    if cfg.data.self_distill_temperature < 0:
        _fail("data.self_distill_temperature", cfg.data.self_distill_temperature, "use 0 (greedy) or a temperature > 0")
    if cfg.data.chat_template:
        from data.template import resolve_chat_template

        try:
            resolve_chat_template(cfg.data.chat_template)
        except ValueError as err:
            _fail("data.chat_template", cfg.data.chat_template, str(err))
    if not 0.0 <= cfg.loss.teacher_weight <= 1.0:
        _fail("loss.teacher_weight", cfg.loss.teacher_weight, "use a weight in [0, 1]")
    if cfg.loss.lambda0 <= 0 or cfg.loss.decay <= 0:
        _fail("loss.lambda0/decay", (cfg.loss.lambda0, cfg.loss.decay), "head weights must be > 0")
    if cfg.loss.chunk_size < 1:
        _fail("loss.chunk_size", cfg.loss.chunk_size, "use a positive number of tokens, e.g. 1024")
    if cfg.deepspeed.zero_stage not in (0, 1, 2, 3):
        _fail("deepspeed.zero_stage", cfg.deepspeed.zero_stage, "ZeRO stages are 0, 1, 2 or 3")
    if cfg.deepspeed.zero_stage == 3 and not d.share_lm_head:
        _fail("deepspeed.zero_stage", 3,
              "ZeRO-3 partitions parameters, and the fused loss reads each head's own LM-head weight directly "
              "(outside its Linear's forward), which ZeRO-3 cannot re-gather for backward; use stage 2 (a "
              "draft's parameters are small, stage 3 would only shard them) or draft.share_lm_head=true")
    if cfg.deepspeed.offload_optimizer not in ("none", "cpu"):
        _fail("deepspeed.offload_optimizer", cfg.deepspeed.offload_optimizer, "use none or cpu")
    if cfg.wandb.mode not in ("offline", "online", "disabled"):
        _fail("wandb.mode", cfg.wandb.mode, "use offline, online or disabled")
    if cfg.resume not in ("none", "auto") and not Path(cfg.resume).exists():
        _fail("resume", cfg.resume, "use none, auto, or the path of an existing checkpoint directory")
    return cfg


def load_train_config(config_paths: list[str] | None = None, overrides: list[str] | None = None) -> TrainConfig:
    return validate(load_typed(TrainConfig, config_paths, overrides, upgrade=upgrade_flat_keys))


def family_recipes(configs_dir: Path | None = None) -> dict[str, str]:
    """Recipe name -> path (relative to the checkout) of every family recipe: a configs/<name>.yaml whose name starts
    with the draft family it sets (medusa, hydra, hydra_pp, ...; an overlay such as demo.yaml that also sets one is
    not a recipe). A new family's recipe is picked up by the benchmarks and GPU checks that train every one."""
    import yaml

    configs_dir = configs_dir or CONFIGS
    out = {}
    for path in sorted(configs_dir.glob("*.yaml")):
        draft = (yaml.safe_load(path.read_text()) or {}).get("draft") or {}
        if "family" in draft and path.stem.split("_")[0] == draft["family"]:
            out[path.stem] = str(path.relative_to(configs_dir.parent))
    return out
