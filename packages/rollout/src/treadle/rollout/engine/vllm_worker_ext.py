"""vLLM worker extension: in-place weight loading inside each vLLM worker.

vLLM mixes this class into its worker class (``worker_extension_cls``); the engine front end calls
the ``treadle_*`` methods on every worker through ``AsyncLLM.collective_rpc``. Arguments cross
the process boundary as msgpack, so tensors never travel through the RPC: inline updates come as
a staged safetensors file path, collective updates as buckets over a ``common.weights.WeightGroup``,
cuda_ipc updates as the handles of the sender's buckets, each worker taking the copy on its own GPU
(``common.ipc``).

Loading: an unquantized model on a GPU loads in place through ``model.load_weights`` (each
parameter's own loader copies into its storage, which CUDA graphs keep pointing at), as OpenRLHF
and verl load; everywhere else (CPU, quantized models) through the model runner's
``reload_weights``, whose layer-wise reload rebuilds each layer on the device, reprocesses it and
copies it back (``model.load_weights`` alone does not work on CPU: the weights are repacked after
loading). After every reload of a model with tied
embeddings the output layer re-runs ``quant_method.process_weights_after_loading``: without it the
CPU build keeps computing logits from the old embedding (PLATFORM.md; logprobs off by ~2).

A LoRA adapter update is not loaded here: worker 0 saves its tensors as a file
(``treadle_receive_file``, ``treadle_save_ipc``) that the front end hands to vLLM's LoRA loader.

What this module does not do: check names/shapes/dtypes (the front end did, before calling),
or pause generation (the front end holds the engine while these run).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

from treadle.common.records import WeightGroupSpec
from treadle.common.weights import (
    WeightGroup,
    bucket_ranges,
    bucket_views,
    receive_buckets,
    worker_spec,
)

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

    def treadle_device_uuid(self) -> str:
        """This worker's GPU (``ipc.device_uuid``), which a cuda_ipc sender's buffer must be on."""
        from treadle.common.ipc import device_uuid

        return device_uuid(self.device)

    def treadle_load_ipc(self, handles: Sequence[bytes], names: Sequence[str], dtypes: Sequence[str],
                         shapes: Sequence[Sequence[int]], bucket_sizes: Sequence[int], skip: Sequence[str]) -> None:
        """Map the sender's buckets on this worker's GPU (one handle each, of the sender's copy
        there), load their tensors, wait for the copies, unmap."""
        import torch

        from treadle.common.ipc import open_handles

        flats = buckets = None
        try:
            flats = open_handles(self._treadle_mine(handles, names, bucket_sizes), self.device)
            buckets = ((lo, hi, bucket_views(flat, dtypes[lo:hi], shapes[lo:hi]))
                       for (lo, hi), flat in zip(bucket_ranges(bucket_sizes, len(names)), flats, strict=True))
            self._treadle_reload(_named(names, frozenset(skip), buckets))
        finally:
            # The loader's copies must have read the sender's memory before it is unmapped (the
            # last reference dropped here) and before the sender writes to it again (once we answer).
            if flats is not None:
                torch.cuda.synchronize(self.device)
            flats = buckets = None

    def _treadle_mine(self, handles: Sequence[bytes], names: Sequence[str], bucket_sizes: Sequence[int]) -> list[bytes]:
        """The handles of the sender's copy on this worker's GPU (one set per GPU holding one)."""
        from treadle.common.ipc import device_uuid, handles_on

        return handles_on(list(handles), device_uuid(self.device), len(bucket_sizes) if bucket_sizes else len(names))

    def treadle_join_group(self, group: dict[str, Any]) -> int:
        """Join the sender's group (or a relay's) at this worker's rank (``worker_spec``); returns it."""
        if self._treadle_group is not None:
            self._treadle_group.close()
        spec = worker_spec(WeightGroupSpec(**group), self.rank)
        self._treadle_group = WeightGroup(spec)
        return spec.rank

    def treadle_receive(self, names: Sequence[str], dtypes: Sequence[str], shapes: Sequence[Sequence[int]],
                        bucket_sizes: Sequence[int], skip: Sequence[str]) -> None:
        """Receive the buckets of one update and load them while they arrive."""
        buckets = receive_buckets(self._treadle_require_group(), dtypes, shapes, bucket_sizes, device=str(self.device))
        self._treadle_reload(_named(names, frozenset(skip), buckets))

    def treadle_receive_file(self, path: str, names: Sequence[str], dtypes: Sequence[str],
                             shapes: Sequence[Sequence[int]], bucket_sizes: Sequence[int]) -> None:
        """Receive the buckets of one update (a LoRA adapter's) and, on worker 0, save their
        tensors as a safetensors file at ``path``; nothing is loaded into the model."""
        buckets = receive_buckets(self._treadle_require_group(), dtypes, shapes, bucket_sizes, device=str(self.device))
        self._treadle_save(path, _named(names, frozenset(), buckets))

    def treadle_save_ipc(self, path: str, handles: Sequence[bytes], names: Sequence[str], dtypes: Sequence[str],
                         shapes: Sequence[Sequence[int]], bucket_sizes: Sequence[int]) -> None:
        """Worker 0: map the sender's buckets and save their tensors (a LoRA adapter's) at ``path``."""
        from treadle.common.ipc import open_handles

        if self.rank != 0:
            return
        flats = open_handles(self._treadle_mine(handles, names, bucket_sizes), self.device)
        try:
            buckets = ((lo, hi, bucket_views(flat, dtypes[lo:hi], shapes[lo:hi]))
                       for (lo, hi), flat in zip(bucket_ranges(bucket_sizes, len(names)), flats, strict=True))
            self._treadle_save(path, _named(names, frozenset(), buckets))
        finally:
            flats = None

    def _treadle_save(self, path: str, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Worker 0 writes ``weights`` (host copies) to ``path``; the others only drain them."""
        tensors = {name: t.detach().to("cpu", copy=True) for name, t in weights}
        if self.rank == 0:
            from safetensors.torch import save_file

            save_file(tensors, path)

    def treadle_discard(self, dtypes: Sequence[str], shapes: Sequence[Sequence[int]],
                        bucket_sizes: Sequence[int]) -> None:
        """Receive the buckets of a refused update and drop them (keeps the sender unblocked)."""
        for _ in receive_buckets(self._treadle_require_group(), dtypes, shapes, bucket_sizes, device=str(self.device)):
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
        from vllm.platforms import current_platform

        if current_platform.is_cpu() or self.model_config.quantization is not None:
            self.reload_weights(weights_iterator=weights)  # type: ignore[attr-defined]
        else:
            self.model_runner.get_model().load_weights(weights)
        self._treadle_refresh_tied_head()

    def _treadle_refresh_tied_head(self) -> None:
        """Re-derive the output layer's kernel weight from the (reloaded) embedding."""
        if not getattr(self.model_config.hf_config, "tie_word_embeddings", False):
            return
        head = getattr(self.model_runner.get_model(), "lm_head", None)
        method = getattr(head, "quant_method", None)  # absent on pipeline ranks without the head
        if method is not None:
            method.process_weights_after_loading(head)


def _named(names: Sequence[str], skip: frozenset[str],
           buckets: Iterable[tuple[int, int, list[torch.Tensor]]]) -> Iterator[tuple[str, torch.Tensor]]:
    """``(name, tensor)`` for every tensor of ``buckets`` (``(lo, hi, views)``, as they come),
    but those in ``skip`` (received, since the sender sends them, not loaded)."""
    for lo, hi, views in buckets:
        for name, view in zip(names[lo:hi], views, strict=True):
            if name not in skip:
                yield name, view
