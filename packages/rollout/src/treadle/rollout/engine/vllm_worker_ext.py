"""vLLM worker extension: in-place weight loading inside each vLLM worker.

vLLM mixes this class into its worker class (``worker_extension_cls``); the engine front end calls
the ``treadle_*`` methods on every worker through ``AsyncLLM.collective_rpc``. Arguments cross
the process boundary as msgpack, so tensors never travel through the RPC: inline updates come as
a staged safetensors file path, collective updates as buckets over a ``group.WeightGroup``.

Loading goes through the model runner's ``reload_weights`` (``model.load_weights`` alone does not
work on CPU: the weights are repacked after loading). After every reload of a model with tied
embeddings the output layer re-runs ``quant_method.process_weights_after_loading``: without it the
CPU build keeps computing logits from the old embedding (PLATFORM.md; logprobs off by ~2).

What this module does not do: check names/shapes/dtypes (the front end did, before calling),
or pause generation (the front end holds the engine while these run).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

from treadle.rollout.engine.group import GroupSpec, WeightGroup, receive_buckets

if TYPE_CHECKING:
    import torch


class TreadleWorkerExtension:
    """Methods added to vLLM's worker (``self`` is the worker: ``model_runner``, ``rank``, ...)."""

    _treadle_group: WeightGroup | None = None

    # vLLM's worker provides these (annotations only: vLLM refuses extensions that define
    # attributes its worker already has); plus ``reload_weights``.
    model_runner: Any
    model_config: Any
    rank: int
    device: Any

    def treadle_load_file(self, path: str, names: Sequence[str], skip: Sequence[str]) -> None:
        """Load ``names`` (minus ``skip``) from the safetensors file at ``path``, in order."""
        from safetensors import safe_open

        def tensors() -> Iterable[tuple[str, torch.Tensor]]:
            with safe_open(path, framework="pt", device="cpu") as f:
                for name in names:
                    if name not in skip:
                        yield name, f.get_tensor(name)

        self._treadle_reload(tensors())

    def treadle_join_group(self, group: dict[str, Any]) -> int:
        """Join the sender's group as rank ``group["rank"] + this worker's rank``; returns it."""
        if self._treadle_group is not None:
            self._treadle_group.close()
        spec = GroupSpec.from_dict(group)
        spec = spec.with_rank(spec.rank + self.rank)
        self._treadle_group = WeightGroup(spec)
        return spec.rank

    def treadle_receive(self, names: Sequence[str], dtypes: Sequence[str], shapes: Sequence[Sequence[int]],
                        bucket_sizes: Sequence[int], skip: Sequence[str]) -> None:
        """Receive the buckets of one update and load them while they arrive."""
        self._treadle_reload(receive_buckets(self._treadle_require_group(), names, dtypes, shapes,
                                             bucket_sizes, device=str(self.device), skip=frozenset(skip)))

    def treadle_discard(self, names: Sequence[str], dtypes: Sequence[str], shapes: Sequence[Sequence[int]],
                        bucket_sizes: Sequence[int]) -> None:
        """Receive the buckets of a refused update and drop them (keeps the sender unblocked)."""
        for _ in receive_buckets(self._treadle_require_group(), names, dtypes, shapes, bucket_sizes,
                                 device=str(self.device)):
            pass

    def treadle_leave_group(self) -> None:
        group, self._treadle_group = self._treadle_group, None
        if group is not None:
            group.close()

    def _treadle_require_group(self) -> WeightGroup:
        if self._treadle_group is None:
            raise RuntimeError(f"worker rank {self.rank} has not joined a weight group")
        return self._treadle_group

    def _treadle_reload(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        self.reload_weights(weights_iterator=weights)  # type: ignore[attr-defined]
        self._treadle_refresh_tied_head()

    def _treadle_refresh_tied_head(self) -> None:
        """Re-derive the output layer's kernel weight from the (reloaded) embedding."""
        if not getattr(self.model_config.hf_config, "tie_word_embeddings", False):
            return
        head = getattr(self.model_runner.get_model(), "lm_head", None)
        method = getattr(head, "quant_method", None)  # absent on pipeline ranks without the head
        if method is not None:
            method.process_weights_after_loading(head)
