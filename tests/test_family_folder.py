"""A family is one folder: a toy served family written into a temporary folder (a package with its model, drafter and
vLLM writer), registered with `register_family`, goes through the normal entry points with no edit anywhere else:
a smoke train (`train.loop.train` on the tiny base), lossless decoding, the specdraft export and its vLLM writer,
each read back."""

from __future__ import annotations

import importlib
import json
import sys
import textwrap

import pytest
import torch
from helpers.decoding import assert_simulation_exact
from safetensors.torch import load_file

# The toy family's package, file by file: one linear layer over h_t, read through the base's frozen LM head,
# drafts x_{t+2} (a chain of one draft behind the root).
TOY = {
    "__init__.py": '''
        from models.family import FamilySpec
        from toyfam.export_vllm import export_vllm_toy
        from toyfam.model import ToyDraft

        spec = FamilySpec(__name__, ToyDraft.facts, model=ToyDraft, writers={"vllm": export_vllm_toy})
        ''',
    "model.py": '''
        import torch
        from torch import nn

        from data.targets import offset_labels
        from losses.fused_linear_ce import linear_cross_entropy_reference
        from models.draft import DraftLossOutput, DraftModel, add_depth_loss
        from models.family import FamilyFacts


        class ToyDraft(DraftModel):
            facts = FamilyFacts("toyfam", "Toy", ("specdraft", "vllm"), vllm_method="toyfam", summary="a test family")

            def __init__(self, base):
                super().__init__()
                self.hidden_size, self.vocab_size = base.hidden_size, base.vocab_size
                self.proj = nn.Linear(base.hidden_size, base.hidden_size)  # [d, d], starts as the identity
                with torch.no_grad():
                    self.proj.weight.copy_(torch.eye(base.hidden_size))
                    self.proj.bias.zero_()
                self.lm_head = base.lm_head_weight  # [V, d], the base's frozen head (not a parameter)

            @classmethod
            def from_config(cls, draft_cfg, base):
                return cls(base)

            @classmethod
            def from_export_config(cls, cfg, base):
                return cls(base)

            def export_config(self):
                return {"family": self.family, "hidden_size": self.hidden_size, "vocab_size": self.vocab_size}

            def forward(self, hidden):  # [..., d] -> logits [..., V] of x_{t+2}
                return self.proj(hidden) @ self.lm_head.T

            def loss(self, batch, base, loss_cfg):
                labels = offset_labels(batch.input_ids, batch.loss_mask, 2)  # [B, T]: x_{t+2} or -100
                sel = labels != -100
                loss_sum, stats = linear_cross_entropy_reference(self.proj(batch.hidden[sel]), self.lm_head,
                                                                 labels[sel])
                per_depth = []
                total = add_depth_loss(batch.hidden.new_zeros(()), 1.0, loss_sum, stats, per_depth)
                return DraftLossOutput(total, per_depth)
        ''',
    "drafter.py": '''
        import torch

        from eval.engine.drafters.drafter import Drafter
        from eval.engine.drafters.options import NoOptions
        from eval.engine.tree import chain_tree


        class ToyDrafter(Drafter):
            name, max_nodes = "toyfam", 2

            def __init__(self, draft):
                self.draft = draft.eval()

            @torch.inference_mode()
            def propose(self, state):
                return chain_tree(state.root, [int(self.draft(state.last_hidden).argmax())])


        Options = NoOptions


        def build(draft, export_cfg, eval_cfg, options):
            return ToyDrafter(draft), {}


        def chain(depth):
            return {}


        def num_speculative_tokens(info, drafter):
            return 1


        def shape(info):
            return "chain of 1"
        ''',
    "export_vllm.py": '''
        import json
        from pathlib import Path

        from safetensors.torch import save_file

        from core.atomic import write_dir_atomic
        from models.export.tensors import draft_tensors
        from models.export.vllm import SPECULATIVE_CONFIG_FILE


        def export_vllm_toy(draft, out_dir, export_cfg, base):
            spec = {"method": "toyfam", "model": str(Path(out_dir).resolve()), "num_speculative_tokens": 1}
            tensors = draft_tensors(draft)
            return write_dir_atomic(Path(out_dir), {
                "model.safetensors": lambda p: save_file(tensors, str(p)),
                SPECULATIVE_CONFIG_FILE: lambda p: p.write_text(json.dumps(spec)),
            })
        ''',
}


@pytest.fixture
def toy_family(tmp_path, monkeypatch):
    """The toy package written under tmp_path, imported and registered; the registries restored afterwards."""
    from eval.engine.drafters import registry as drafters
    from models import families

    for name, text in TOY.items():
        (tmp_path / "toyfam").mkdir(exist_ok=True)
        (tmp_path / "toyfam" / name).write_text(textwrap.dedent(text).lstrip())
    monkeypatch.syspath_prepend(str(tmp_path))
    saved = [(d, dict(d)) for d in (families.SPECS, families.FAMILIES, families.DRAFT_MODELS, drafters.DRAFTERS)]
    spec = families.register_family(importlib.import_module("toyfam").spec)
    yield spec
    for d, before in saved:
        d.clear()
        d.update(before)
    for name in [m for m in sys.modules if m == "toyfam" or m.startswith("toyfam.")]:
        del sys.modules[name]


def test_a_family_in_its_own_folder_trains_decodes_judges_and_exports(toy_family, tmp_path):
    from eval.engine.backends.hf import HFBackend
    from eval.engine.decoder import autoregressive_generate, speculative_generate
    from eval.engine.drafters.registry import build_drafter, drafter_family
    from eval.harness.config import EvalConfig
    from models.export.formats import FORMAT_WRITERS
    from models.export.load import load_export
    from models.export.vllm import read_speculative_config
    from train.config import load_train_config
    from train.loop import train

    cfg = load_train_config(["configs/smoke.yaml"],
                            ["draft.family=toyfam", "draft.num_heads=1", f"run_dir={tmp_path / 'run'}"])
    run_dir = train(cfg)
    loaded = load_export(run_dir / "export")
    assert loaded.family == "toyfam" and type(loaded.draft).__module__ == "toyfam.model"

    drafter, _ = build_drafter(loaded.draft, loaded.config, EvalConfig())
    assert drafter_family("toyfam").shape({}) == "chain of 1"
    backend = HFBackend(loaded.base.model)
    for prompt in ([1, 5, 9, 2], [7, 3, 3, 8, 11, 4]):
        want = autoregressive_generate(backend, prompt, max_new_tokens=12).tokens
        got = speculative_generate(backend, drafter, prompt, max_new_tokens=12)
        assert got.tokens == want
        # judged on the field: the simulation on the stored greedy answer equals the decoded run step for step
        assert_simulation_exact(backend, drafter, torch.tensor(prompt), got)

    out = FORMAT_WRITERS["vllm"](loaded, tmp_path / "vllm")
    assert read_speculative_config(out)["method"] == "toyfam"
    back = load_file(str(out / "model.safetensors"))
    assert set(back) == set(loaded.draft.state_dict())
    assert all(back[k].equal(v) for k, v in loaded.draft.state_dict().items())
    again = FORMAT_WRITERS["specdraft"](loaded, tmp_path / "again")
    assert json.loads((again / "config.json").read_text())["family"] == "toyfam"


def test_a_registered_family_is_in_every_registry(toy_family):
    from eval.engine.drafters.registry import drafter_family
    from models.registry import DRAFT_MODELS, FAMILIES, family_spec, vllm_families

    assert family_spec("toyfam") is toy_family and FAMILIES["toyfam"] is toy_family.facts
    assert DRAFT_MODELS["toyfam"] is toy_family.model and "toyfam" in vllm_families()
    assert drafter_family("toyfam").num_speculative_tokens({}, None) == 1
