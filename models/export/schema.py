"""The one typed schema of an export's config.json, and the checks every file we read back goes through.

A config.json is checked key by key (type and range), for keys nobody writes (a typo: the closest known key is
named) and for the keys its family needs (`FamilyFacts.export_keys`). The keys below are shared or older; a
family's own new keys are typed in its declaration (`FamilyFacts.export_key_types`), not here. A safetensors file
is opened with its header checked against the tensors the draft needs (missing, extra, wrong shape: all listed),
and against the sha256 the export recorded when it was written. Every failure is an `ExportError` (a ValueError
the CLI prints as one line) that names the file, the key or tensor, and the fix.
"""

from __future__ import annotations

import difflib
import json
import warnings
from collections.abc import Callable
from pathlib import Path

from safetensors import SafetensorError, safe_open

from core.checksum import file_sha256


class ExportError(ValueError):
    """A file of an export that cannot be used as it is."""


REEXPORT = "re-export the run (`specdraft export --run runs/<run> --format specdraft --out DIR`) or copy it again"


def _int(lo: int) -> Callable[[object], str | None]:
    def check(v):
        if isinstance(v, bool) or not isinstance(v, int):
            return "an integer"
        return None if v >= lo else f"an integer >= {lo}"
    return check


def _float(lo: float, hi: float | None = None) -> Callable[[object], str | None]:
    def check(v):
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            return "a number"
        return None if v >= lo and (hi is None or v <= hi) else f"a number in [{lo}, {hi if hi is not None else 'inf'}]"
    return check


def _is(kind: type, what: str) -> Callable[[object], str | None]:
    return lambda v: None if isinstance(v, kind) and not (kind is int and isinstance(v, bool)) else what


def _int_list(v) -> str | None:
    ok = isinstance(v, list) and all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in v)
    return None if ok else "a list of integers >= 0"


def _tree(v) -> str | None:
    if isinstance(v, str):
        return None
    ok = isinstance(v, list) and all(isinstance(p, list) and all(isinstance(i, int) and i >= 0 for i in p) for p in v)
    return None if ok else "a static tree name or a list of rank paths, e.g. [[0], [1], [0, 0]]"


def _optional(check: Callable[[object], str | None]) -> Callable[[object], str | None]:
    return lambda v: None if v is None else check(v)


# Every key our exports carry. Drafter options stored in an export (a recipe's beam shape, a searched tree) are
# checked again, typed, when the drafter is built (eval/engine/drafters/options.py).
KEYS: dict[str, Callable[[object], str | None]] = {
    "format": _is(str, "a string"),
    "format_version": _int(1),
    "family": _is(str, "a string"),
    "base_model": _is(str, "a string"),
    "base_fingerprint": _optional(_is(str, "a string")),
    "model_sha256": _is(str, "a string"),
    "hidden_size": _int(1),
    "vocab_size": _int(1),
    "draft_vocab_size": _int(0),
    "draft_vocab_coverage_train": _float(0.0, 1.0),
    "draft_vocab_coverage_heldout": _float(0.0, 1.0),
    "num_heads": _int(1),
    "num_layers": _int(0),
    "num_frames": _int(1),
    "blank": _int(0),
    "ttt_steps": _int(1),
    "block_size": _int(2),
    "num_anchors": _int(1),
    "mask_token_id": _int(0),
    "learned_mask": _is(bool, "true or false"),
    "markov_rank": _int(1),  # DSpark: rank of the Markov logit bias
    "parallel_drafting": _is(bool, "true or false"),  # EAGLE-3 drafting K tokens in one forward (P-EAGLE)
    # EAGLE-3's normalisation variants (models/families/eagle3/model.py: NORM_VARIANTS), written only when true
    "fc_norm": _is(bool, "true or false"),
    "norm_before_fc": _is(bool, "true or false"),
    "norm_output": _is(bool, "true or false"),
    "norm_before_residual": _is(bool, "true or false"),
    "aux_layers": _int_list,
    "exit_dim": _int(1),
    "share_lm_head": _is(bool, "true or false"),
    "prefix_layer": _is(bool, "true or false"),
    "rnn": _is(bool, "true or false"),
    "trained_steps": _int(0),
    "train_seconds": _float(0.0),
    # the training process's CPU seconds over every start; null where a start before they were counted left none
    "train_cpu_seconds": _optional(_float(0.0)),
    "trainable_params": _int(0),
    "hidden_cache": _is(bool, "true or false"),
    "train_dtype": _is(str, "a string"),
    "train_data": _is(dict, "a mapping"),
    "chat_template": _is(str, "a string"),
    "tree": _tree,
    "tree_search": _is(dict, "a mapping"),
    "vllm_num_speculative_tokens": _int(1),  # `specdraft tune`'s vLLM choice (models/export/vllm.py TUNED_TOKENS_KEY)
    # `specdraft tune --concurrency`'s vLLM schedule [[start, end, k], ...] (models/export/vllm.py TUNED_SCHEDULE_KEY)
    "vllm_num_speculative_tokens_per_batch_size": _is(list, "a list of [start, end, k] batch-size ranges"),
    # drafter options an export may carry (typed again by the family's Options)
    "beam_width": _int(1),
    "beam_length": _int(2),
    "ctc_search": _is(str, "a string"),
    "ctc_paths": _optional(_is(list, "a list of rank paths")),
    "ctc_num_paths": _int(1),
    "ctc_topk": _int(1),
    "eagle3_mode": _is(str, "a string"),
    "num_speculative_tokens": _int(1),  # drafts per step (a P-EAGLE export's parallel chain)
    "tree_topk": _int(1),
    "tree_depth": _int(1),
    "tree_nodes": _int(1),
}
COMMON_REQUIRED = ("format", "family", "base_model", "hidden_size", "vocab_size")


# Drafts per verification step have one name everywhere, vLLM's: eval options (`extra.num_speculative_tokens`),
# drafter report info, export config.json keys, tuning.json knobs. The names they had before, which stored files
# (configs, exports, tuning.json, reports) may still use, are read as it by `upgrade_keys`: the one mapping.
DRAFTS_PER_STEP = "num_speculative_tokens"
OLD_KEYS = {
    "chain_length": DRAFTS_PER_STEP,  # EAGLE-3 / DSpark / Domino eval option and report key; P-EAGLE exports
    "n_max": DRAFTS_PER_STEP,  # tuning.json's llama.cpp knob (llama-server's --spec-draft-n-max)
}


class RenamedKeyWarning(FutureWarning):
    """A stored file or config uses a key's old name (OLD_KEYS); it is read under the new one."""


NOTED: set[str] = set()  # the old keys warned about in this process (one note each)


def upgrade_keys(tree, where: str = ""):
    """`tree` (a mapping, or a list, nested at any depth) with every old key of OLD_KEYS read under its new name,
    and one warning per old key and process ("`chain_length` is now `num_speculative_tokens`"). An old key next to
    its new one is dropped when they agree, an error when they do not. The input is not changed; a tree without old
    keys comes back as it is."""
    if isinstance(tree, list):
        out = [upgrade_keys(v, where) for v in tree]
        return tree if all(a is b for a, b in zip(out, tree)) else out
    if not isinstance(tree, dict):
        return tree
    out, changed = {}, False
    for key, value in tree.items():
        new = upgrade_keys(value, where)
        changed |= new is not value
        if key in OLD_KEYS:
            changed, name = True, OLD_KEYS[key]
            if name in tree and tree[name] != value:
                raise ValueError(f"{where or 'config'}: `{key}` (the old name of `{name}`) is {value!r} but `{name}` "
                                 f"is {tree[name]!r}: keep only `{name}`")
            if key not in NOTED:
                NOTED.add(key)
                warnings.warn(f"`{key}` is now `{name}` (first read from {where or 'a config'}; write `{name}` to "
                              "drop this note)", RenamedKeyWarning, stacklevel=2)
            out.setdefault(name, new)
        else:
            out[key] = new
    return out if changed else tree


# The checks a family's declared key types (FamilyFacts.export_key_types) stand for.
TYPE_CHECKS: dict[type, Callable[[object], str | None]] = {
    int: _int(0), bool: _is(bool, "true or false"), str: _is(str, "a string"), list: _is(list, "a list"),
}


def check_export_config(config: object, path: Path, required: tuple[str, ...] = (),
                        own_types: dict[str, type] | None = None) -> dict:
    """`config` (parsed from `path`) against KEYS and the family's own key types (`own_types`, its
    FamilyFacts.export_key_types); `required`: the family's own keys. Returns it unchanged."""
    if not isinstance(config, dict):
        raise ExportError(f"{path}: expected a JSON object of export settings, got {type(config).__name__}; {REEXPORT}")
    keys = {**KEYS, **{k: TYPE_CHECKS[t] for k, t in (own_types or {}).items()}}
    unknown = sorted(set(config) - set(keys))
    if unknown:
        hints = [f"{k} (did you mean {m[0]}?)" if (m := difflib.get_close_matches(k, keys, n=1)) else k
                 for k in unknown]
        raise ExportError(f"{path}: unknown key(s) {', '.join(hints)}; fix or remove them (an export's keys are "
                          "listed in models/export/schema.py and in its family's FamilyFacts.export_key_types)")
    missing = [k for k in (*COMMON_REQUIRED, *required) if k not in config]
    if missing:
        raise ExportError(f"{path}: missing key(s) {missing} that a {config.get('family', '?')} export needs; "
                          f"{REEXPORT}")
    for key, value in config.items():
        wrong = keys[key](value)
        if wrong:
            raise ExportError(f"{path}: \"{key}\": {json.dumps(value)} must be {wrong}; fix the value (or {REEXPORT})")
    return config


def read_json_file(path: Path, what: str) -> object:
    """A JSON file we wrote, read back: a damaged one is a clear error naming it."""
    try:
        return json.loads(Path(path).read_bytes().decode("utf-8"))
    except UnicodeDecodeError as err:
        raise ExportError(f"{path}: {what} is not UTF-8 text (damaged at byte {err.start}); {REEXPORT}") from None
    except json.JSONDecodeError as err:
        raise ExportError(f"{path}: {what} is not valid JSON ({err.msg}; line {err.lineno}, column {err.colno}): "
                          f"the file is damaged or cut short; {REEXPORT}") from None


def safetensors_shapes(path: Path) -> dict[str, tuple[int, ...]]:
    """name -> shape from a safetensors header; a truncated or damaged file is an ExportError naming it."""
    path = Path(path)
    if not path.is_file():
        raise ExportError(f"{path} is missing; {REEXPORT}")
    try:
        with safe_open(str(path), framework="pt") as f:
            return {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
    except (SafetensorError, OSError) as err:
        raise ExportError(f"{path} is corrupt or cut short ({err}); {REEXPORT}") from None


def check_tensors(path: Path, found: dict[str, tuple[int, ...]], expected: dict[str, tuple[int, ...]]) -> None:
    """The tensors of `path` against the ones the draft needs: missing, extra and wrong shapes, all listed."""
    missing = sorted(set(expected) - set(found))
    extra = sorted(set(found) - set(expected))
    shapes = [f"{k} {list(found[k])} (needs {list(expected[k])})" for k in sorted(set(found) & set(expected))
              if tuple(found[k]) != tuple(expected[k])]
    problems = ([f"missing {missing[:8]}{' ...' if len(missing) > 8 else ''}"] if missing else []) + \
               ([f"unexpected {extra[:8]}{' ...' if len(extra) > 8 else ''}"] if extra else []) + \
               ([f"wrong shape: {', '.join(shapes[:8])}"] if shapes else [])
    if problems:
        raise ExportError(f"{path}: the tensors do not match the draft its config.json describes "
                          f"({'; '.join(problems)}); config.json and model.safetensors come from different exports, "
                          f"or one was edited; {REEXPORT}")


def check_sha256(path: Path, want: str | None) -> None:
    """The file's bytes against the sha256 the export recorded when it wrote them (None: an older export)."""
    if want and file_sha256(path) != want:
        raise ExportError(f"{path}: its bytes differ from what was exported (sha256 mismatch): the file is damaged; "
                          f"{REEXPORT}")
