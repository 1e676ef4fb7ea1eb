"""Run in vLLM's venv (.venv-vllm, with `speculators` importable), by tests/test_eagle3_export.py:
load our speculators export with speculators' own Eagle3DraftModel, run its TTT forward on the saved inputs
and compare the per-step draft tokens with ours; read the config the way vLLM does. Prints one JSON line.

    python speculators_roundtrip.py DIR   (DIR/draft = the export, DIR/base = the verifier, DIR/io.safetensors)
"""

import json
import sys

import torch
from safetensors.torch import load_file


def main(root: str) -> None:
    from speculators.models.eagle3 import Eagle3DraftModel, Eagle3SpeculatorConfig

    cfg = Eagle3SpeculatorConfig.from_pretrained(f"{root}/draft")
    cfg.transformer_layer_config._attn_implementation = "eager"  # flex attention needs a GPU build
    model = Eagle3DraftModel.from_pretrained(f"{root}/draft", config=cfg)
    model.load_verifier_weights()  # embed_tokens come from the verifier, as in serving
    model.eval()
    io = load_file(f"{root}/io.safetensors")
    ids, aux = io["ids"], io["aux"]
    # speculators' shift_batch pairs hidden[t] with input_ids[t+1]
    x, hs = ids[:, 1:], aux[:, :-1]
    with torch.no_grad():
        toks = model(hs, x, document_ids=torch.zeros_like(x), ttt_steps=int(io["toks"].shape[0]))
    toks = torch.stack([t + model.d2t[t] if model.d2t is not None else t for t in toks])  # draft -> target ids
    result = {"tokens_equal": bool(torch.equal(toks, io["toks"])), "speculators_tokens": toks.tolist()}

    from vllm.transformers_utils.configs.speculators.base import SpeculatorsConfig

    raw = json.load(open(f"{root}/draft/config.json"))
    vllm_cfg = SpeculatorsConfig.extract_transformers_pre_trained_config(json.loads(json.dumps(raw)))
    result["vllm_speculative"] = SpeculatorsConfig.extract_vllm_speculative_config(raw)
    result["vllm_config"] = {k: vllm_cfg.get(k) for k in ("architectures", "draft_vocab_size", "norm_before_residual",
                                                          "eagle_aux_hidden_state_layer_ids", "num_hidden_layers",
                                                          "target_hidden_size")}
    print(json.dumps(result))


if __name__ == "__main__":
    main(sys.argv[1])
