"""The transformers helper's parts that need no torch (run by CI): a quantized checkpoint is
refused by `load_without_experts` before anything is read. The helper with torch: test_hf.py."""

from __future__ import annotations

import pytest

from expertmesh import hf


def test_a_quantized_checkpoint_is_refused_naming_its_method():
    hf.refuse_quantized("ckpt", None)
    hf.refuse_quantized("ckpt", {})

    class Gptq:
        quant_method = "gptq"

    for qc, method in (
        ({"quant_method": "fp8", "weight_block_size": [128, 128]}, "'fp8'"),
        ({"quant_method": "compressed-tensors"}, "'compressed-tensors'"),
        (Gptq(), "'gptq'"),
    ):
        with pytest.raises(ValueError, match=f"ckpt: a quantized checkpoint \\(quant_method {method}\\)"):
            hf.refuse_quantized("ckpt", qc)
