"""Exporting trained weights in Hugging Face format (safetensors + config + tokenizer).

``full_state_dict`` collects the weights on rank 0 (gathering ZeRO-3 and AutoTP shards, merging
LoRA adapters); ``save_causal_lm`` / ``save_reward_model`` write a folder that
``AutoModelForCausalLM`` / ``AutoModelForSequenceClassification`` and vLLM load, atomically
(``atomic.publish``); a LoRA causal LM's folder also holds its adapter alone (``adapter/``,
PEFT's layout: ``lora_adapter``). The weights are placed into a skeleton built on the meta device, so no
second full copy of the model is initialised.

Not here: resumable training checkpoints (``checkpointer``).
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import torch

from treadle.trainer.checkpoint.atomic import publish, staging_dir


def _merged(module: torch.nn.Module) -> torch.nn.Module:
    """``module`` with LoRA adapters merged into a copy (the trained module is left as it is)."""
    from peft import PeftModel  # noqa: PLC0415

    if isinstance(module, PeftModel):
        return copy.deepcopy(module).merge_and_unload()
    inner = getattr(module, "model", None)
    if isinstance(inner, PeftModel):  # a value model whose backbone has adapters
        module = copy.copy(module)
        module.model = copy.deepcopy(inner).merge_and_unload()
    return module


def full_state_dict(engine: Any, *, zero_stage: int, is_main: bool) -> dict[str, torch.Tensor] | None:
    """Every weight of ``engine.module`` on the CPU on rank 0 (None elsewhere); all ranks must call it."""
    module = engine.module
    if getattr(engine, "autotp_size", lambda: 1)() > 1:
        # AutoTP shards are gathered (with ZeRO-3's partitions) by DeepSpeed's own consolidation;
        # named "16bit", it returns the parameters in their training dtype.
        return engine._consolidated_16bit_state_dict()  # noqa: SLF001
    from treadle.trainer.weights.plan import is_4bit  # noqa: PLC0415

    if is_4bit(module):  # QLoRA: the 4-bit base dequantized, adapters merged at full precision
        return _planned(module, is_main, zero3=zero_stage == 3)
    if zero_stage == 3:
        if _has_peft(module):
            return _planned(module, is_main, zero3=True)
        import deepspeed  # noqa: PLC0415

        out: dict[str, torch.Tensor] = {}
        for name, p in module.named_parameters():
            with deepspeed.zero.GatheredParameters([p], modifier_rank=None):
                if is_main:
                    out[name] = p.detach().cpu().clone()
        if is_main:
            out.update({n: b.detach().cpu().clone() for n, b in module.named_buffers() if n in module.state_dict()})
        return out if is_main else None
    if not is_main:
        return None
    return {k: v.detach().cpu().clone() for k, v in _merged(module).state_dict().items()}


def _planned(module: torch.nn.Module, is_main: bool, *, zero3: bool) -> dict[str, torch.Tensor] | None:
    """A LoRA causal LM's merged weights (``W + scaling * B @ A`` per adapted layer; a 4-bit ``W``
    dequantized first), gathered one tensor at a time under ZeRO-3, with the weight sender's plan
    (the same names the engines load)."""
    from peft import PeftModel  # noqa: PLC0415

    from treadle.trainer.weights.gather import walk  # noqa: PLC0415
    from treadle.trainer.weights.plan import plan  # noqa: PLC0415

    if not isinstance(module, PeftModel):
        raise NotImplementedError("exporting a value model (reward model / critic) with LoRA adapters trained "
                                  "with ZeRO-3 or 4-bit weights is not supported yet; use --ds.zero_stage 2 "
                                  "without --ds.load_in_4bit")
    items = plan(module)
    out: dict[str, torch.Tensor] = {}
    for lo, hi in walk(items, [1] * len(items), zero3=zero3):
        if is_main:
            for it in items[lo:hi]:
                out[it.name] = it.value().to(it.dtype).cpu().clone()  # merged in fp32, saved as trained
    return out if is_main else None


def lora_adapter(engine: Any, *, zero_stage: int, is_main: bool) -> tuple[Any, dict[str, torch.Tensor]] | None:
    """A causal LM's LoRA adapter on rank 0: ``(its peft config, its tensors in PEFT's file names)``
    (gathered one tensor at a time under ZeRO-3, every rank must call it); None elsewhere, and for
    a model without adapters (``save_causal_lm``'s ``adapter``)."""
    from treadle.trainer.weights.gather import walk  # noqa: PLC0415
    from treadle.trainer.weights.plan import adapter_items  # noqa: PLC0415

    module = engine.module
    if not hasattr(module, "peft_config") or not hasattr(module, "get_base_model"):  # no peft import without LoRA
        return None
    items = adapter_items(module)
    out: dict[str, torch.Tensor] = {}
    for lo, hi in walk(items, [1] * len(items), zero3=zero_stage == 3):
        if is_main:
            for it in items[lo:hi]:
                out[it.name] = it.value().cpu().clone()
    if not is_main:
        return None
    config = copy.deepcopy(module.peft_config[module.active_adapter])
    config.inference_mode = True
    return config, out


def _has_peft(module: torch.nn.Module) -> bool:
    return any("lora_" in n for n, _ in module.named_parameters())


def _place(skeleton: torch.nn.Module, state: dict[str, torch.Tensor]) -> torch.nn.Module:
    skeleton.load_state_dict(state, strict=False, assign=True)
    if getattr(skeleton.config, "tie_word_embeddings", False):
        skeleton.tie_weights()
    meta = [n for n, p in skeleton.named_parameters() if p.is_meta]
    if meta:
        raise RuntimeError(f"export: no trained weights for {meta[:5]}")
    return skeleton


def _dense_config(config: Any, state: dict[str, torch.Tensor]) -> Any:
    """A copy of ``config`` for the exported weights: their dtype, and no ``quantization_config``
    (a QLoRA model is exported dequantized, so loaders must not expect 4-bit weights)."""
    config = copy.deepcopy(config)
    config.dtype = next(iter(state.values())).dtype
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    return config


def _write(model: torch.nn.Module, tokenizer: Any, out: Path,
           adapter: tuple[Any, dict[str, torch.Tensor]] | None = None) -> Path:
    tmp = staging_dir(out)
    model.save_pretrained(tmp, safe_serialization=True)
    if tokenizer is not None:
        tokenizer.save_pretrained(tmp)
    if adapter is not None:
        _write_adapter(*adapter, tmp / ADAPTER_DIR)
    return publish(tmp, out)


ADAPTER_DIR = "adapter"  # where a LoRA model's export puts its adapter, inside the merged model's folder


def _write_adapter(config: Any, tensors: dict[str, torch.Tensor], out: Path) -> None:
    """PEFT's adapter folder: ``adapter_config.json`` + ``adapter_model.safetensors`` (what
    ``PeftModel.from_pretrained(base, out)`` and vLLM's ``LoRARequest`` load)."""
    from safetensors.torch import save_file  # noqa: PLC0415

    out.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(str(out))
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(out / "adapter_model.safetensors"),
              metadata={"format": "pt"})


def save_causal_lm(state: dict[str, torch.Tensor], config: Any, tokenizer: Any, out: str | Path, *,
                   adapter: tuple[Any, dict[str, torch.Tensor]] | None = None) -> Path:
    """Write a causal LM folder (rank 0 only) that ``AutoModelForCausalLM`` and vLLM load; with
    ``adapter`` (``lora_adapter``'s) the LoRA adapter alone as well, in PEFT's layout, in its
    ``adapter/`` folder."""
    from transformers import AutoModelForCausalLM  # noqa: PLC0415

    config = _dense_config(config, state)
    config.use_cache = True
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(config)
    return _write(_place(skeleton, state), tokenizer, Path(out), adapter)


def save_reward_model(state: dict[str, torch.Tensor], config: Any, tokenizer: Any, out: str | Path, *,
                      mean: float = 0.0, std: float = 1.0, head_prefix: str = "score") -> Path:
    """Write a reward-model folder (rank 0 only) that ``AutoModelForSequenceClassification`` loads
    (``num_labels=1``); the score statistics go into the config as ``reward_mean`` / ``reward_std``.

    transformers names the head ``score``: a head trained under another ``head_prefix`` is saved
    as ``score.weight``, and the prefix is recorded in the config as ``value_head_prefix``."""
    from transformers import AutoModelForSequenceClassification  # noqa: PLC0415

    state = dict(state)
    if head_prefix != "score":
        state["score.weight"] = state.pop(f"{head_prefix}.weight")
    config = _dense_config(config, state)
    config.value_head_prefix = head_prefix
    config.num_labels = 1
    config.reward_mean, config.reward_std = float(mean), float(std)
    config.architectures = None
    with torch.device("meta"):
        skeleton = AutoModelForSequenceClassification.from_config(config)
    if config.pad_token_id is None and tokenizer is not None:  # HF's own scoring finds the last token by it
        skeleton.config.pad_token_id = tokenizer.pad_token_id
    return _write(_place(skeleton, state), tokenizer, Path(out))
