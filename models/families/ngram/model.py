"""Model-derived N-gram tables for the learning-free N-gram drafts (docs/families/ngram.md, N-grammys §4.1).

- bigram: top-k of p_M(. | a) for every vocabulary token a, the base run on the one-token sequence [a]
  (batched forwards, a one-off cost; cached on disk keyed by the base fingerprint, dtype and k);
- extended bigram: greedy chaining through the bigram's top-1, a [V, w] lookup table;
- unigram: p(x) ∝ exp(-d(x)), d(x) = ||u_x - ū||_V, u = output embeddings, ū their mean, and
  ||y||_V^2 = y^T C y with C = E^T E / V the (uncentred) covariance of the input embeddings E.

Every fast path has a slow twin (`*_reference`) for the parity tests.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from tqdm import tqdm

from core.atomic import atomic_path
from models.family import FamilyFacts

log = logging.getLogger("specdraft.ngram")
CACHE_SUBDIR = "ngram"

# Learning-free: nothing to train or export but vLLM's own n-gram config (`--format vllm --method ngram`). A
# module-level `facts` is how a family without a model class declares itself (its package registers it).
facts = FamilyFacts("ngram", "N-gram", ("vllm",), vllm_method="ngram", trainable=False,
                    summary="learning-free: context n-grams, model bigram / unigram tables, vLLM's prompt lookup",
                    also_files=("configs/eval/ngram.yaml",))


@dataclass
class BigramTable:
    """tokens [V, K] long: the K most likely next tokens after each token a, best first;
    probs [V, K] float32: their probabilities p_M(tokens[a, j] | a)."""

    tokens: torch.Tensor
    probs: torch.Tensor

    @property
    def vocab_size(self) -> int:
        return int(self.tokens.shape[0])

    @property
    def k(self) -> int:
        return int(self.tokens.shape[1])

    def truncate(self, k: int) -> BigramTable:
        if k > self.k:
            raise ValueError(f"the bigram table holds the top-{self.k} only; rebuild it with k >= {k}")
        return BigramTable(self.tokens[:, :k], self.probs[:, :k])


def _model_device(model) -> torch.device:
    return next(model.parameters()).device


@torch.inference_mode()
def _next_token_logits(model, tokens: torch.Tensor) -> torch.Tensor:
    """tokens [B] -> fp32 logits [B, V] of the base on the B one-token sequences [a] (no cache)."""
    out = model(input_ids=tokens[:, None].to(_model_device(model)), use_cache=False)
    return out.logits[:, -1].float()


def build_bigram_table(model, k: int, *, batch_size: int = 256, progress: bool = True) -> BigramTable:
    """Top-k p_M(. | a) for all a in the vocabulary, `batch_size` one-token sequences per forward."""
    vocab = int(model.config.vocab_size)
    if not 1 <= k <= vocab:
        raise ValueError(f"bigram k={k} must be in [1, vocab size {vocab}]")
    toks = torch.empty(vocab, k, dtype=torch.long)
    probs = torch.empty(vocab, k, dtype=torch.float32)
    starts = range(0, vocab, batch_size)
    t0 = time.perf_counter()
    bar = tqdm(starts, desc=f"bigram table (V={vocab}, top-{k})", unit="batch", disable=not progress,
               dynamic_ncols=True)
    for i, s in enumerate(bar):
        batch = torch.arange(s, min(s + batch_size, vocab))
        p, t = _next_token_logits(model, batch).softmax(-1).topk(k, dim=-1)  # [B, k] each
        toks[s:s + batch.numel()], probs[s:s + batch.numel()] = t.cpu(), p.cpu()
        if i == 0 and len(starts) > 1 and progress:  # tqdm shows an ETA too; this line survives non-tty runs
            est = (time.perf_counter() - t0) * len(starts)
            print(f"bigram table: the first of {len(starts)} forwards took {time.perf_counter() - t0:.1f} s: about "
                  f"{est / 60:.1f} min in all (one-off, then cached)", flush=True)
    return BigramTable(toks, probs)


def build_bigram_table_reference(model, k: int) -> BigramTable:
    """Slow twin: one forward per token, one token at a time."""
    vocab = int(model.config.vocab_size)
    toks, probs = [], []
    for a in range(vocab):
        p, t = _next_token_logits(model, torch.tensor([a]))[0].softmax(-1).topk(k)
        toks.append(t.cpu())
        probs.append(p.cpu())
    return BigramTable(torch.stack(toks), torch.stack(probs))


def bigram_cache_path(cache_dir: Path, fingerprint: str, dtype: torch.dtype, k: int) -> Path:
    """The table depends on the weights (fingerprint), the compute dtype and k."""
    return Path(cache_dir) / CACHE_SUBDIR / f"bigram-{fingerprint}-{str(dtype).removeprefix('torch.')}-k{k}.safetensors"


def _find_cached(cache_dir: Path, fingerprint: str, dtype: torch.dtype, k: int) -> Path | None:
    """The exact-k file, else any cached file with a larger k (a top-K table holds every top-k, k <= K)."""
    exact = bigram_cache_path(cache_dir, fingerprint, dtype, k)
    if exact.exists():
        return exact
    stem = bigram_cache_path(cache_dir, fingerprint, dtype, 0).name.removesuffix("0.safetensors")
    larger = []
    for f in (Path(cache_dir) / CACHE_SUBDIR).glob(f"{stem}*.safetensors"):
        kk = f.name.removeprefix(stem).removesuffix(".safetensors")
        if kk.isdigit() and int(kk) >= k:
            larger.append((int(kk), f))
    return min(larger)[1] if larger else None


def save_bigram_table(table: BigramTable, path: Path, fingerprint: str) -> None:
    """Atomic: written to a temp file next to `path`, then renamed (readers never see half a file)."""
    with atomic_path(path) as tmp:  # made readable like a plain file: the cache is shared like the base's
        save_file({"tokens": table.tokens.to(torch.int32).contiguous(), "probs": table.probs.contiguous()},
                  str(tmp), metadata={"fingerprint": fingerprint, "k": str(table.k)})


def load_bigram_table(path: Path) -> BigramTable:
    t = load_file(str(path))
    return BigramTable(t["tokens"].long(), t["probs"].float())


def bigram_table_for(base, k: int, *, cache_dir: str | os.PathLike | None = None, batch_size: int = 256,
                     progress: bool = True) -> tuple[BigramTable, Path, bool]:
    """(table, cache file, was_cached) for a models.base.LoadedBase; builds and caches it on a miss."""
    from core.paths import default_cache_dir

    root = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    found = _find_cached(root, base.fingerprint, base.dtype, k)
    if found is not None:
        try:
            table = load_bigram_table(found)
        except (SafetensorError, OSError, KeyError, ValueError) as err:  # a damaged cache file is rebuilt
            log.warning("the cached bigram table %s is damaged (%s); building it again", found, err)
            table = None
        if table is not None and table.vocab_size == base.vocab_size:
            return table.truncate(k), found, True
        if table is not None:
            log.warning("ignoring %s: vocab %d != base vocab %d", found, table.vocab_size, base.vocab_size)
    path = bigram_cache_path(root, base.fingerprint, base.dtype, k)
    if progress:  # a one-off cost worth knowing about before it starts (minutes for a 49k-token vocabulary)
        vocab = int(base.model.config.vocab_size)
        print(f"building the model bigram table of {base.name}: one forward per vocabulary token ({vocab:,} tokens "
              f"in {-(-vocab // batch_size)} batches of {batch_size}), {vocab * k * 8 / 2**20:.1f} MiB, cached at "
              f"{path} and reused afterwards", flush=True)
    table = build_bigram_table(base.model, k, batch_size=batch_size, progress=progress)
    save_bigram_table(table, path, base.fingerprint)
    return table, path, False


def extend_bigram(top1: torch.Tensor, w: int) -> torch.Tensor:
    """top1 [V] long (argmax p(. | a)) -> chain [V, w]: chain[a, 0] = top1[a], chain[a, j] =
    top1[chain[a, j-1]] -- the greedy w-token continuation after a. All V rows at once, w gathers."""
    cols, cur = [], torch.arange(top1.shape[0])
    for _ in range(w):
        cur = top1[cur]
        cols.append(cur)
    return torch.stack(cols, dim=1) if cols else torch.empty(top1.shape[0], 0, dtype=torch.long)


def extend_bigram_reference(top1: torch.Tensor, w: int) -> torch.Tensor:
    """Slow twin: follow the chain token by token."""
    t = top1.tolist()
    rows = []
    for a in range(len(t)):
        row, cur = [], a
        for _ in range(w):
            cur = t[cur]
            row.append(cur)
        rows.append(row)
    return torch.tensor(rows, dtype=torch.long).reshape(len(t), w)


def _embeddings(model) -> tuple[torch.Tensor, torch.Tensor]:
    """(input embeddings E [V, d], output embeddings U [V, d]) in fp32 (tied models: the same matrix)."""
    return (model.get_input_embeddings().weight.detach().float(),
            model.get_output_embeddings().weight.detach().float())


def unigram_distances(model) -> torch.Tensor:
    """d [V] = ||u_x - ū||_V (paper §4.1). ||y||_V^2 = y^T C y = ||E y||^2 / V, C = E^T E / V."""
    emb_in, emb_out = _embeddings(model)
    cov = emb_in.T @ emb_in / emb_in.shape[0]  # [d, d]
    diff = emb_out - emb_out.mean(dim=0, keepdim=True)  # [V, d]
    return ((diff @ cov) * diff).sum(-1).clamp(min=0).sqrt()


def unigram_distances_reference(model) -> torch.Tensor:
    """Slow twin: the sum-over-vocabulary form, sqrt(Σ_x (y^T v_x)^2 / V), one token at a time."""
    emb_in, emb_out = _embeddings(model)
    mean = emb_out.mean(dim=0)
    return torch.stack([((emb_in @ (emb_out[i] - mean)) ** 2).mean().sqrt() for i in range(emb_out.shape[0])])


def model_unigram(model) -> tuple[torch.Tensor, torch.Tensor]:
    """(tokens [V] ranked most likely first, p [V] ∝ exp(-d), in the same order)."""
    logp = (-unigram_distances(model)).log_softmax(-1)
    p, order = logp.exp().sort(descending=True, stable=True)
    return order, p
