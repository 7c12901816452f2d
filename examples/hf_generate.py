#!/usr/bin/env python3
"""Generate text with a transformers MoE model whose MoE layers run on an ExpertMesh fabric.

Attention, norms, embeddings and dense layers run here (CPU, or --device cuda); every sparse
MoE block is replaced by a call to the router (`expertmesh.hf.attach`), and the experts are
never read from the checkpoint (`expertmesh.hf.load_without_experts`). Serve the same
checkpoint first:

    expertmesh convert --checkpoint DIR --topology examples/cpu-host.toml --out W
    expertmesh up --topology examples/cpu-host.toml --weights W

then:

    python examples/hf_generate.py --checkpoint DIR --router 127.0.0.1:47400 \
        --cluster cpu-host --prompt "The capital of France is"

Needs: pip install ./python torch transformers (written against transformers 4.57).
"""

import argparse
import time

import torch
import transformers

import expertmesh
from expertmesh import hf


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--checkpoint", required=True, help="Hugging Face checkpoint folder (config.json, tokenizer, safetensors)")
    ap.add_argument("--router", required=True, help="router frontend address HOST:PORT")
    ap.add_argument("--cluster", default="single-host", help="cluster name (the topology's name)")
    ap.add_argument("--prompt", required=True)
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    ap.add_argument("--device", default="cpu", help="where attention and dense layers run")
    a = ap.parse_args()

    tok = transformers.AutoTokenizer.from_pretrained(a.checkpoint)
    client = expertmesh.RouterClient(a.router, cluster=a.cluster)
    # Only the non-expert tensors are read: the experts live on the fabric.
    model = hf.load_without_experts(
        a.checkpoint, client, dtype=getattr(torch, a.dtype), device=a.device
    )
    layers = model.expertmesh_layers
    print(f"{len(layers)} MoE blocks served by {client.addr}: layers {min(layers)}..{max(layers)}")

    inputs = tok(a.prompt, return_tensors="pt").to(a.device)
    t = time.perf_counter()
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=a.max_new_tokens, do_sample=False)
    took = time.perf_counter() - t
    new = out.shape[1] - inputs["input_ids"].shape[1]
    print(tok.decode(out[0], skip_special_tokens=True))
    print(f"{new} tokens in {took:.2f} s ({new / took:.1f} tokens/s)")


if __name__ == "__main__":
    main()
