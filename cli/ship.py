"""`specdraft ship`: put a trained draft into the repository (drafts/<name>/), small enough to keep in git and laid
out like a run, so every command that takes a run or an export works on it from a fresh clone:

    drafts/<name>/export/       the export in half precision (model.safetensors, config.json, tuning.json if tuned)
    drafts/<name>/config.yaml   the run's resolved training config; heldout.json, metrics.jsonl beside it
    drafts/<name>/README.md     the model card: base and fingerprint, data (the store's card), recipe and the exact
                                command, which snapshot, the results given with --results

    specdraft ship --export runs/<run>/export --name <name> --command "<how it was trained>" [--results F.md ...]
    specdraft eval --draft drafts/<name>/export          # and serve-check / tune; export --run drafts/<name>

No optimizer state, no base weights: the trainable tensors only, cast to bf16 (or fp16); the draft vocabulary map
stays int64. Refused over --max-mib (32 by default), so the repository stays clonable.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file

from core.atomic import write_dir_atomic, write_text_atomic
from core.checksum import file_sha256
from core.paths import REPO_ROOT

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
RUN_FILES = ("config.yaml", "heldout.json", "metrics.jsonl")


def add_ship_parser(sub) -> None:
    p = sub.add_parser("ship", help="put a trained draft into drafts/<name>/ (half precision, a model card)")
    p.add_argument("--export", required=True, type=Path, help="the export to ship (runs/<run>/export or a snapshot)")
    p.add_argument("--name", required=True, help="drafts/<name>")
    p.add_argument("--run", type=Path, default=None, help="its run directory (default: the export's parent)")
    p.add_argument("--command", dest="train_command", default=None,
                   help="the exact command that trained it (recorded in the card)")
    p.add_argument("--results", type=Path, action="append", default=[],
                   help="a Markdown file of results to put in the card (repeatable)")
    p.add_argument("--dtype", default="bf16", choices=sorted(DTYPES))
    p.add_argument("--max-mib", type=float, default=32.0)
    p.add_argument("--out-root", type=Path, default=None, help="default: <repo>/drafts")


def half_precision_export(src: Path, dest: Path, dtype: torch.dtype) -> Path:
    """Copy an export with its floating tensors cast to `dtype`; config.json gets the new file's sha256."""
    from safetensors import safe_open

    with safe_open(str(src / "model.safetensors"), framework="pt") as f:
        meta = f.metadata() or {}
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    tensors = {k: v.to(dtype) if v.is_floating_point() else v for k, v in tensors.items()}
    config = json.loads((src / "config.json").read_text())

    def write_config(path: Path) -> None:
        config["model_sha256"] = file_sha256(path.parent / "model.safetensors")
        path.write_text(json.dumps(config, indent=2) + "\n")

    files = {"model.safetensors": lambda p: save_file(tensors, str(p), metadata=meta),
             "config.json": write_config}
    for extra in ("tuning.json", "tree.json", "NOTES.md"):
        if (src / extra).is_file():
            files[extra] = lambda p, s=src / extra: shutil.copyfile(s, p)
    return write_dir_atomic(dest, files)


def _store_card(source: str | None) -> dict | None:
    if not source:
        return None
    card = Path(source) / "card.json"
    if not card.is_absolute():
        card = REPO_ROOT / card
    return json.loads(card.read_text()) if card.is_file() else None


def _training_facts(run: Path) -> dict:
    """What the card says of the run: its resolved config's main knobs and how far training went."""
    import yaml

    facts: dict = {}
    cfg_path = run / "config.yaml"
    if cfg_path.is_file():
        from train.config import upgrade_flat_keys

        cfg = yaml.safe_load(cfg_path.read_text()) or {}
        # a run older than the per-family sections keeps flat keys (draft.rnn, draft.ttt_steps): read at their place
        [(_, cfg)] = upgrade_flat_keys([(str(cfg_path), cfg)], note=lambda _msg: None)
        facts["config"] = cfg
    metrics = run / "metrics.jsonl"
    if metrics.is_file():
        rows = [json.loads(ln) for ln in metrics.read_text().splitlines() if ln.strip()]
        steps = [r for r in rows if "step" in r]
        if steps:
            facts["last"] = steps[-1]
    return facts


def _draft_items(draft: dict, family: str) -> list[tuple[str, object]]:
    """The draft keys worth a card: the shared ones that are set, then the family's own section (draft.<family>,
    as `<family>.key`); other families' sections are only their defaults."""
    own = draft.get(family) if isinstance(draft.get(family), dict) else {}
    items = [(k, v) for k, v in draft.items() if not isinstance(v, dict)] + [(f"{family}.{k}", v)
                                                                             for k, v in own.items()]
    return [(k, v) for k, v in items if v not in (None, "", [], {})]


def model_card(name: str, config: dict, facts: dict, store: dict | None, command: str | None, snapshot: dict | None,
               results: list[str], dtype: str, size_mib: float) -> str:
    cfg = facts.get("config", {})
    data, train, draft = cfg.get("data", {}), cfg.get("train", {}), cfg.get("draft", {})
    last = facts.get("last", {})
    lines = [f"# {name}: a draft of the {config['family']} family for {config.get('base_model')}", "",
             f"- **Base**: `{config.get('base_model')}`, fingerprint `{config.get('base_fingerprint')}` (a base with "
             "another fingerprint is refused at load, with the base it needs).",
             f"- **Weights**: `export/model.safetensors`, {dtype}, {size_mib:.1f} MiB, trainable tensors only.",
             f"- **Draft**: {', '.join(f'{k}={v}' for k, v in _draft_items(draft, config['family']))}."]
    if store:
        engine = str(store.get("settings", {}).get("engine"))
        # the store records "<engine> <its version line>" (e.g. "vllm vllm 0.32.0 bfloat16"): say the engine once
        first, _, rest = engine.partition(" ")
        engine = rest if rest.startswith(first) else engine
        lines.append(f"- **Data**: the on-policy store `{store.get('store_path')}` ({store.get('name')}: "
                     f"{store.get('records'):,} records of the first {store.get('conversations'):,} ShareGPT "
                     f"conversations, answers by `{store.get('base')}` through {engine}; "
                     f"data sha256 `{str(store.get('data_sha256'))[:16]}…`), cut at data.max_length="
                     f"{data.get('max_length')}. Made with `{store.get('made_with')}`.")
    elif data:
        lines.append(f"- **Data**: `{data.get('source')}`, max_records={data.get('max_records')}, "
                     f"max_length={data.get('max_length')}.")
    lines.append(f"- **Recipe**: lr {train.get('lr')}, epochs {train.get('epochs')}, time budget "
                 f"{train.get('max_minutes')} min, precision {train.get('precision')}, global batch "
                 f"{train.get('global_batch_size')}; training stopped at step {last.get('step', '?')}"
                 + (f", {last.get('tokens_seen'):,} tokens seen" if last.get("tokens_seen") else "") + ".")
    if command:
        lines += ["", "Trained with:", "", "```bash", command, "```"]
    if snapshot:
        lines += ["", f"**Snapshot**: {snapshot}"]
    lines += ["", "## Use it", "", "```bash",
              f"specdraft eval --draft drafts/{name}/export                  # MT-bench, our decoder",
              f"specdraft eval --draft drafts/{name}/export --suite default  # every prompt set",
              f"specdraft serve-check --draft drafts/{name}/export --engine all",
              f"specdraft tune --draft drafts/{name}/export",
              f"specdraft export --run drafts/{name} --format vllm --out exports/{name}-vllm",
              "```"]
    if results:
        lines += ["", "## Results", ""] + results
    return "\n".join(lines) + "\n"


def cmd_ship(args) -> int:
    src = Path(args.export)
    if not (src / "config.json").is_file() or not (src / "model.safetensors").is_file():
        raise ValueError(f"{src}: not an export (needs config.json and model.safetensors); pass runs/<run>/export")
    run = Path(args.run) if args.run else src.parent
    root = Path(args.out_root) if args.out_root else REPO_ROOT / "drafts"
    dest = root / args.name
    missing = [str(r) for r in args.results if not Path(r).is_file()]
    if missing:
        raise ValueError(f"--results: no such file: {', '.join(missing)}")
    export = half_precision_export(src, dest / "export", DTYPES[args.dtype])
    size = (export / "model.safetensors").stat().st_size / 2**20
    if size > args.max_mib:
        shutil.rmtree(dest / "export")
        raise ValueError(f"{src}: {size:.1f} MiB in {args.dtype}, over --max-mib {args.max_mib:g}; ship a smaller "
                         "draft (e.g. draft.share_lm_head=true) or raise the cap")
    for name in RUN_FILES:
        if (run / name).is_file():
            shutil.copyfile(run / name, dest / name)
    config = json.loads((export / "config.json").read_text())
    facts = _training_facts(run)
    store = _store_card(facts.get("config", {}).get("data", {}).get("source"))
    snapshot_file = src / "snapshot.json"
    snapshot = json.loads(snapshot_file.read_text()) if snapshot_file.is_file() else None
    results = [Path(r).read_text().rstrip() for r in args.results]
    card = model_card(args.name, config, facts, store, args.train_command, snapshot, results, args.dtype, size)
    write_text_atomic(dest / "README.md", card)
    print(f"ship: {dest} ({size:.1f} MiB {args.dtype}); card {dest / 'README.md'}")
    return 0

