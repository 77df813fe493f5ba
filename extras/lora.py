"""LoRA adapters for rti.py's models (peft, an optional package); optional (extras/).

    python -m extras.scale train --model /models/Qwen3-8B --device cuda --dtype bf16 --lora-r 16

extras/scale.py adds them with --lora-r: only the adapters train, so the optimizer holds states
for a small share of the weights, and a saved model is the adapters alone.
"""

from __future__ import annotations

import warnings

PEFT_INSTALL = "pip install -r requirements-lora.txt (peft)"


def add_lora(model, r: int, alpha: float, gradient_checkpointing: bool = False):
    """`model` with rank-r LoRA adapters on every linear layer but the output head, the only
    weights that train. peft keeps the adapters in fp32 when the base weights are bf16."""
    try:
        from peft import LoraConfig, get_peft_model
    except ImportError:
        raise ImportError(f"--lora-r needs the optional package peft: {PEFT_INSTALL}") from None
    config = LoraConfig(
        r=r,
        lora_alpha=alpha,
        lora_dropout=0.0,
        target_modules="all-linear",
        task_type="CAUSAL_LM",
    )
    with warnings.catch_warnings():  # peft 0.21 asks by the name transformers 5 deprecated
        warnings.filterwarnings(
            "ignore", "`is_gradient_checkpointing` is deprecated", FutureWarning
        )
        model = get_peft_model(model, config)
    if gradient_checkpointing:
        # the frozen embeddings' output requires grad, so that checkpointed blocks always see a
        # grad-requiring input and the adapters get gradients
        model.enable_input_require_grads()
    return model
