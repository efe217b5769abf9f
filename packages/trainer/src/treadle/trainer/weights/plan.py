"""What the trainer sends as weights, and under which names.

``plan(module, dtype)`` lists the tensors a rollout engine loads (``Item``s), in the order of the
module's parameters, named as ``save_pretrained`` writes them (what the engines' ``WeightSpec``
expects): DeepSpeed's / DDP's ``module.``, peft's ``base_model.model.`` and ``.base_layer`` are
stripped; a tied ``lm_head`` is not listed (``named_parameters`` yields a shared tensor once, and
the engines take the embedding for it); persistent buffers are listed, non-persistent ones
(rotary tables) are not. A LoRA layer's weight is listed once, as the merged
``W + scaling * B @ A`` (peft's own ``get_delta_weight``), computed into a new tensor: the
trained module is never modified. Adapter tensors themselves are not listed; a QLoRA 4-bit base
weight travels dequantized.

``prompt_logprobs`` scores the canary prompt with the module itself (under ZeRO-3 a forward is a
collective: every rank must call it).

``adapter_plan(module, dtype)`` lists the LoRA adapter's tensors alone, in PEFT's file names, and
the ``LoraAdapter`` they make: the adapter-only sync, for engines that serve the base model with
the adapter on top.

Not here: gathering and packing (``gather``), moving bytes (the transports).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from treadle.common.config import ConfigError
from treadle.common.records import LoraAdapter

ADAPTER_PREFIX = "base_model.model."  # peft's PeftModel + LoraModel: where its adapter file's names start
_WRAPPERS = ("module.", ADAPTER_PREFIX)  # DeepSpeed / DDP, peft's PeftModel + LoraModel


@dataclass(frozen=True, slots=True, kw_only=True)
class Item:
    """One tensor of a weight update and where its value comes from."""

    name: str  # HF checkpoint name
    shape: tuple[int, ...]  # full shape (a ZeRO-3 parameter's ``ds_shape``)
    dtype: torch.dtype  # dtype it is sent in (the engine's)
    sources: tuple[torch.Tensor, ...]  # parameters / buffers it is computed from (gathered under ZeRO-3)
    merge: Callable[[], torch.Tensor] | None = None  # LoRA: the merged weight; None: sources[0]

    @property
    def dtype_name(self) -> str:
        return _dtype_name(self.dtype)

    @property
    def nbytes(self) -> int:
        """prod(shape) * itemsize(dtype)."""
        return math.prod(self.shape) * self.dtype.itemsize  # Python ints: exact

    def value(self) -> torch.Tensor:
        """The tensor as trained (sources gathered), in its own dtype; never a view to write into."""
        return self.merge() if self.merge is not None else dense(self.sources[0])


@functools.cache
def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def dense(t: torch.Tensor) -> torch.Tensor:
    """``t`` detached; a ZeRO-3 parameter that is not gathered but whose partition holds all of it
    (one rank: ``gather.whole``) as a view of that partition; a bitsandbytes 4-bit weight (QLoRA's
    frozen base: packed uint8 plus a ``quant_state``) dequantized to its compute dtype and shape."""
    qs = getattr(t, "quant_state", None)
    if qs is None:
        if hasattr(t, "ds_tensor") and t.numel() != t.ds_numel and t.ds_tensor.numel() >= t.ds_numel:
            return t.ds_tensor.detach().reshape(-1)[:t.ds_numel].view(t.ds_shape)
        return t.detach()
    from bitsandbytes.functional import dequantize_4bit  # noqa: PLC0415

    return dequantize_4bit(t.data, qs)


def is_4bit(module: torch.nn.Module) -> bool:
    """Whether any parameter of ``module`` is a bitsandbytes 4-bit weight (QLoRA)."""
    return any(getattr(p, "quant_state", None) is not None for p in module.parameters())


@functools.lru_cache(maxsize=1 << 16)  # a pure function of the name, asked at every sync
def hf_name(name: str) -> str | None:
    """The HF checkpoint name of a (wrapped) model's parameter or buffer; None: not in a checkpoint.

    ``module.base_model.model.model.layers.0.q_proj.base_layer.weight`` -> ``model.layers.0.q_proj.weight``;
    adapter tensors (``lora_A`` ...) and peft's frozen ``original_module`` copies -> None;
    ``x.modules_to_save.<adapter>.weight`` (peft's trained copy) -> ``x.weight``.
    """
    stripped = True
    while stripped:
        stripped = False
        for prefix in _WRAPPERS:
            if name.startswith(prefix):
                name, stripped = name[len(prefix):], True
    parts = name.split(".")
    if "original_module" in parts or any(p.startswith("lora_") for p in parts):
        return None
    if "modules_to_save" in parts:
        i = parts.index("modules_to_save")
        del parts[i:i + 2]
    return ".".join(p for p in parts if p != "base_layer")


def plan(module: torch.nn.Module, dtype: torch.dtype | None = None) -> list[Item]:
    """Every tensor to send, in parameter order then persistent buffers; floating tensors take
    ``dtype`` (None: their own). One walk of the module tree."""
    params, buffers, lora = _walk(module)
    merges = _lora_merges(lora)
    items = []
    for name, p in params:
        hf = hf_name(name)
        if hf is not None:
            extra, merge = merges.get(id(p), ((), None))
            items.append(_item(hf, p, dtype, extra, merge))
    for name, b in buffers:
        hf = hf_name(name)
        if hf is not None:
            items.append(_item(hf, b, dtype))
    names = [it.name for it in items]
    if len(set(names)) != len(names):
        twice = sorted({n for n in names if names.count(n) > 1})
        raise ValueError(f"weight sender: several tensors of the model map to the names {twice[:5]}")
    return items


def _preorder(module: torch.nn.Module) -> Iterator[tuple[str, torch.nn.Module]]:
    """``named_modules()``: (prefix, module) in pre-order, each module once, without its nested
    generators."""
    visited: set[int] = set()
    stack: list[tuple[str, torch.nn.Module]] = [("", module)]
    while stack:
        name, mod = stack.pop()
        if id(mod) in visited:
            continue
        visited.add(id(mod))
        yield name, mod
        prefix = f"{name}." if name else ""
        stack.extend((prefix + child_name, child) for child_name, child in reversed(mod._modules.items())
                     if child is not None)


def _walk(module: torch.nn.Module) -> tuple[list[tuple[str, torch.Tensor]], list[tuple[str, torch.Tensor]], list[Any]]:
    """``named_parameters()``, the persistent buffers (``named_buffers()`` less the
    non-persistent ones) and the LoRA layers, in module order, each tensor once: one walk."""
    lora_cls = _lora_layer_class()
    params: list[tuple[str, torch.Tensor]] = []
    buffers: list[tuple[str, torch.Tensor]] = []
    lora, seen = [], set()
    for mod_name, mod in _preorder(module):
        prefix = f"{mod_name}." if mod_name else ""
        for name, p in mod._parameters.items():
            if p is not None and id(p) not in seen:
                seen.add(id(p))
                params.append((prefix + name, p))
        for name, b in mod._buffers.items():
            if b is not None and name not in mod._non_persistent_buffers_set and id(b) not in seen:
                seen.add(id(b))
                buffers.append((prefix + name, b))
        if lora_cls is not None and isinstance(mod, lora_cls):
            lora.append(mod)
    return params, buffers, lora


def _item(name: str, t: torch.Tensor, dtype: torch.dtype | None, extra: tuple[torch.Tensor, ...] = (),
          merge: Callable[[], torch.Tensor] | None = None) -> Item:
    qs = getattr(t, "quant_state", None)  # a 4-bit weight travels dequantized, in its compute dtype
    own, shape = (qs.dtype, tuple(qs.shape)) if qs is not None else (t.dtype, tuple(getattr(t, "ds_shape", t.shape)))
    target = dtype if dtype is not None and (qs is not None or t.is_floating_point()) else own
    return Item(name=name, shape=shape, dtype=target, sources=(t, *extra), merge=merge)


def adapter_plan(module: torch.nn.Module, dtype: torch.dtype | None = None) -> tuple[list[Item], LoraAdapter]:
    """The LoRA adapter's tensors alone (every ``lora_A`` / ``lora_B``, in parameter order, named as
    PEFT's ``save_pretrained`` writes them: ``base_model.model.<module>.lora_A.weight``), floating
    ones in ``dtype``, and the adapter they make: what an engine serving the untouched base model
    needs to compute as the trained one. Refused (``ConfigError``) where the base is not the
    engines': no adapters, a 4-bit base, trained ``modules_to_save``; and where the adapter is not
    plain ``W x + (alpha / r) B A x`` with one rank and alpha (DoRA, rsLoRA, rank patterns)."""
    params, _, layers = _walk(module)
    if not layers:
        raise ConfigError("adapter-only weight sync needs a model with LoRA adapters (--ds.lora.rank > 0)")
    if is_4bit(module):
        raise ConfigError("adapter-only weight sync with a 4-bit base (--ds.load_in_4bit): the engines' base is "
                          "the unquantized model, the trainer's the 4-bit one; send merged weights")
    shapes: set[tuple[int, float]] = set()
    for layer in layers:
        active = [] if layer.merged or layer.disable_adapters else list(layer.active_adapters)
        if len(active) != 1 or active[0] not in layer.lora_A:
            raise ConfigError(f"adapter-only weight sync sends one active linear LoRA adapter per layer; a layer "
                              f"has {active} active (embedding adapters, several or merged ones: send merged weights)")
        a = active[0]
        if getattr(layer, "lora_variant", {}).get(a) is not None or not math.isclose(
                layer.scaling[a], layer.lora_alpha[a] / layer.r[a]):
            raise ConfigError("adapter-only weight sync sends plain LoRA (scaling alpha / r); this model has a "
                              "variant (DoRA, rsLoRA, ...): send merged weights")
        shapes.add((layer.r[a], float(layer.lora_alpha[a])))
    if len(shapes) > 1:
        raise ConfigError(f"adapter-only weight sync needs one rank and alpha for every layer, got {sorted(shapes)}")
    trained = [n for n, p in params if "modules_to_save" in n.split(".") and p.requires_grad]
    if trained:
        raise ConfigError(f"adapter-only weight sync carries adapters only; {trained[0]} is a trained copy "
                          "(modules_to_save): send merged weights")
    items = adapter_items(module, dtype, params)
    leaves = {it.name.rsplit(".", 2)[0].rpartition(".")[2] for it in items}
    (rank, alpha), = shapes
    return items, LoraAdapter(rank=rank, alpha=alpha, target_modules=sorted(leaves))


def adapter_items(module: torch.nn.Module, dtype: torch.dtype | None = None,
                  params: list[tuple[str, torch.Tensor]] | None = None) -> list[Item]:
    """Every LoRA parameter of ``module`` as an ``Item`` named as in PEFT's adapter file, in
    parameter order (no checks: the adapter export takes any)."""
    if params is None:
        params = _walk(module)[0]
    return [_item(file_name, p, dtype) for name, p in params if (file_name := adapter_file_name(name)) is not None]


def adapter_file_name(name: str) -> str | None:
    """A LoRA parameter's name in PEFT's adapter file, None for any other parameter:
    ``module.base_model.model.x.q_proj.lora_A.default.weight`` -> ``base_model.model.x.q_proj.lora_A.weight``
    (DeepSpeed's ``module.`` and the adapter's name dropped)."""
    while name.startswith("module."):
        name = name[len("module."):]
    parts = name.split(".")
    for i, part in enumerate(parts[:-2]):
        if part in ("lora_A", "lora_B"):
            if not name.startswith(ADAPTER_PREFIX):
                raise ConfigError(f"adapter-only weight sync: {name} is not a PeftModel's parameter")
            return ".".join(parts[:i + 1] + parts[i + 2:])
    return None


@functools.cache
def _lora_layer_class() -> type | None:
    """peft's ``LoraLayer``; None without peft (then no model has adapters)."""
    try:
        from peft.tuners.lora import LoraLayer  # noqa: PLC0415
    except ImportError:
        return None
    return LoraLayer


def _lora_merges(layers: list[Any]) -> dict[int, tuple[tuple[torch.Tensor, ...], Callable[[], torch.Tensor]]]:
    """id(base weight) -> (adapter parameters to gather with it, the merged weight's function)."""
    out = {}
    for layer in layers:
        active = [] if layer.merged or layer.disable_adapters else list(layer.active_adapters)
        adapters = tuple(a for a in active if a in layer.lora_A or a in layer.lora_embedding_A)
        if any(getattr(layer, "lora_variant", {}).get(a) is not None for a in adapters):
            raise ConfigError("the weight sender merges plain LoRA adapters only; this model has a LoRA "
                              "variant (DoRA, ...) whose merged weight is not W + scaling * B @ A")
        extra = tuple(p for n, p in layer.named_parameters() if n.split(".")[0] in layer.adapter_layer_names)
        base = layer.get_base_layer()
        out[id(base.weight)] = (extra, functools.partial(_merged, layer, base, adapters))
    return out


def _merged(layer: Any, base: torch.nn.Module, adapters: tuple[str, ...]) -> torch.Tensor:
    """W + sum_a delta_a, in float32 (a new tensor: adding in place would change the trained W);
    a 4-bit W is dequantized first, so the adapters' delta is added at full precision."""
    w = dense(base.weight)
    if not adapters:
        return w
    with torch.no_grad():
        out = w.to(torch.float32, copy=True)
        for a in adapters:
            out += layer.get_delta_weight(a).float()
    return out


# ------------------------------------------------------------------ canary


def prompt_logprobs(module: torch.nn.Module, token_ids: Sequence[int]) -> np.ndarray:
    """float32 [C-1]: ``log p(token_t | tokens_<t)`` of the module in eval mode (dropout off),
    its train/eval flags restored afterwards. Collective under ZeRO-3."""
    device = next(module.parameters()).device
    ids = torch.as_tensor(list(token_ids), dtype=torch.long, device=device)[None]
    modes = [(m, m.training) for m in module.modules()]
    try:
        module.eval()
        with torch.no_grad():
            logits = module(input_ids=ids, use_cache=False).logits[0, :-1].double()
    finally:
        for m, training in modes:
            m.training = training
    lp = torch.log_softmax(logits, -1).gather(1, ids[0, 1:, None]).squeeze(1)
    return lp.float().cpu().numpy()
