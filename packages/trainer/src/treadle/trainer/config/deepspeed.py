"""DeepSpeed, precision, attention, packing, context-parallel and LoRA settings (the ``ds`` group).

Shared by every trained model of a run. Only describes the engine; building the DeepSpeed
config dict and the engine is ``treadle.trainer``'s strategy module's job (no deepspeed here).
"""

from __future__ import annotations

from typing import Literal

from treadle.common.config import ConfigError, configclass


@configclass
class LoraConfig:
    """LoRA adapters (ds.lora); rank 0 trains the full model."""

    rank: int = 0
    """Adapter rank r; 0 disables LoRA."""
    alpha: int = 16
    """Scaling numerator: adapters are scaled by alpha / r."""
    target_modules: tuple[str, ...] = ("all-linear",)
    """Module names (or all-linear) that get adapters."""
    dropout: float = 0.0
    """Dropout on the adapter input."""

    def __post_init__(self) -> None:
        if self.rank < 0:
            raise ConfigError(f"--rank must be >= 0 (0 disables LoRA), got {self.rank}")
        if self.alpha <= 0:
            raise ConfigError(f"--alpha must be > 0, got {self.alpha}")
        if not self.target_modules:
            raise ConfigError("--target_modules is empty: name at least one module (or all-linear)")
        if not 0 <= self.dropout < 1:
            raise ConfigError(f"--dropout must be in [0, 1), got {self.dropout}")


@configclass
class DeepSpeedConfig:
    """How models are sharded, stored and computed."""

    zero_stage: int = 2
    """ZeRO stage: 0 (DDP), 1 (optimizer states), 2 (+ gradients), 3 (+ parameters)."""
    param_dtype: Literal["bf16", "fp16", "fp32"] = "bf16"
    """Parameter / compute dtype (fp32 for CPU runs)."""
    zpg: int = 1
    """ZeRO++ hierarchical partition size (1: off)."""
    adam_offload: bool = False
    """Keep optimizer states in CPU memory (DeepSpeed's CPU Adam steps them there)."""
    param_offload: bool = False
    """Keep parameters in CPU memory between uses (ZeRO-3 only)."""
    attn_implementation: str | None = None
    """HF attention implementation: eager, sdpa, flash_attention_2, flash_attention_3, treadle_varlen (packed rows without flash-attn), or a kernels-hub name; None: flash_attention_2 where flash-attn is installed on CUDA, else treadle_varlen for packed rows on CUDA, else sdpa."""
    varlen_kernel: Literal["auto", "fa4_varlen", "flash_varlen", "sdpa_by_sequence"] = "auto"
    """treadle_varlen's kernel: auto takes the fastest that fits (FlashAttention-4 on Hopper / Blackwell where the flash-attn-4 package is installed, 1.7x FlashAttention-2's forward + backward on an H200; then PyTorch's varlen FlashAttention-2; then SDPA per sequence); a name starts the search there."""
    experts_implementation: Literal["eager", "batched_mm", "grouped_mm", "deepgemm"] | None = None
    """MoE expert computation passed to transformers; None lets transformers choose."""
    use_liger_kernel: bool = False
    """Liger's Triton kernels (RoPE, RMSNorm, SwiGLU MLP) patched into every model loaded (CUDA and liger-kernel needed: treadle-trainer[liger]; refused at start otherwise, or for a model type Liger does not cover)."""
    grad_accum_dtype: Literal["fp32", "bf16", "fp16"] | None = None
    """Dtype of gradient accumulation buffers; None: DeepSpeed's default."""
    overlap_comm: bool | None = None
    """Overlap gradient reduction with the backward pass; None: DeepSpeed's own choice, on under ZeRO-3 (where it measured fastest on 2xH200) and off for stages 1-2 (where it holds 4.5x the reduce bucket in memory)."""
    zero3_prefetch_bucket_size: int = 500_000_000
    """ZeRO-3: parameter elements gathered ahead of use (DeepSpeed's own default, 5e7, left 2xH200 step time to the gathers)."""
    zero3_param_persistence_threshold: int = 1_000_000
    """ZeRO-3: parameters with fewer elements stay whole on every rank, never gathered (DeepSpeed's default: 1e5)."""
    zero3_max_live_parameters: int = 1_000_000_000
    """ZeRO-3: most parameter elements held gathered at once (DeepSpeed's default)."""
    zero3_max_reuse_distance: int = 1_000_000_000
    """ZeRO-3: a gathered parameter used again within this many parameter elements is kept, not
    released and gathered again (DeepSpeed's default); above the model's size, the forward's
    gathers serve the backward too."""
    compile_layers: bool | None = None
    """torch.compile each decoder layer's forward (ZeRO-3 gathers each layer whole: DeepSpeed leaf modules; eager again for all layers if compiling fails); None: on for ZeRO-3 training on CUDA (the 1.35B step 37% faster on 2xH200), off on CPU and with LoRA, ring attention, AutoTP, 4-bit weights, parameter offload or deepcompile (untested together), and with Liger's kernels (refused together: they crashed)."""
    deepcompile: bool = False
    """Compile the model with DeepSpeed's deepcompile (CUDA and ZeRO stage 1-3 only)."""
    enable_sleep: bool = False
    """Offload model and optimizer states between phases when models share GPUs (colocation)."""
    tensor_parallel_size: int = 1
    """DeepSpeed AutoTP degree: consecutive ranks that split each linear layer and see the same batches (SFT, DPO, KTO)."""
    packing_samples: bool = False
    """Pack several samples into one row without padding (needed by ring attention and dynamic batches)."""
    ring_attn_size: int = 1
    """Ranks that split one sequence with ring attention (context parallelism); 1: off."""
    ring_attn_head_stride: int = 1
    """Key/value heads sent around the ring per pass (with their query heads); a divisor of the key/value head count (larger: fewer passes, more memory per pass)."""
    load_in_4bit: bool = False
    """Load the base weights in 4 bit (QLoRA; needs lora.rank > 0)."""
    lora: LoraConfig = LoraConfig()
    """LoRA adapters."""
    value_head_prefix: str = "score"
    """Attribute name of the value head of reward models and critics (score loads with AutoModelForSequenceClassification)."""
    use_universal_ckpt: bool = False
    """Save and load DeepSpeed universal checkpoints (resume with a different parallel layout)."""

    def __post_init__(self) -> None:
        if self.zero_stage not in (0, 1, 2, 3):
            raise ConfigError(f"--zero_stage must be 0, 1, 2 or 3, got {self.zero_stage}")
        for name in ("zpg", "tensor_parallel_size", "ring_attn_size", "ring_attn_head_stride"):
            if getattr(self, name) < 1:
                raise ConfigError(f"--{name} must be >= 1, got {getattr(self, name)}")
        if self.ring_attn_size > 1 and not self.packing_samples:
            raise ConfigError(f"--ring_attn_size {self.ring_attn_size} needs --packing_samples")
        if self.tensor_parallel_size > 1 and self.ring_attn_size > 1:
            raise ConfigError("--tensor_parallel_size > 1 with --ring_attn_size > 1: AutoTP and ring attention "
                              "are not combined; pick one")
        if self.tensor_parallel_size > 1 and self.lora.rank > 0:
            raise ConfigError("--tensor_parallel_size > 1 with --lora.rank > 0: AutoTP shards the linear layers "
                              "LoRA adapts; not supported")
        if self.load_in_4bit and self.lora.rank == 0:
            raise ConfigError("--load_in_4bit needs LoRA: 4-bit base weights cannot be trained; set --lora.rank")
        for name in ("zero3_prefetch_bucket_size", "zero3_param_persistence_threshold", "zero3_max_live_parameters",
                     "zero3_max_reuse_distance"):
            if getattr(self, name) < 0:
                raise ConfigError(f"--{name} must be >= 0, got {getattr(self, name)}")
        if self.compile_layers and self.deepcompile:
            raise ConfigError("--compile_layers and --deepcompile both compile the model; pick one")
        if self.compile_layers and self.use_liger_kernel:
            raise ConfigError("--compile_layers with --use_liger_kernel: compiled layers around Liger's Triton kernels "
                              "died of a CUDA illegal memory access on an H200 (docs/benchmarks.md, Liger); pick one "
                              "(compiled layers measured 5% faster)")
        if self.param_offload and self.zero_stage != 3:
            raise ConfigError(f"--param_offload needs --zero_stage 3, got {self.zero_stage}")
        if not self.value_head_prefix.isidentifier():
            raise ConfigError(f"--value_head_prefix must be an attribute name, got {self.value_head_prefix!r}")
