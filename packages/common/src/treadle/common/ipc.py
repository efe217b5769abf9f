"""CUDA IPC handles of weight buckets, as plain msgpack (the ``cuda_ipc`` weight transport).

A sender colocated with an engine (same GPU) packs its buckets back to back into one CUDA
buffer and shares it once per update (``records.IpcWeights``): ``encode_buckets(buffer, spans)`` runs torch's own
``reduce_tensor`` on the buffer and writes the arguments of its rebuild function field by field
as one msgpack map per bucket (``IpcHandle``: the buffer's fields plus the bucket's offset and
length), never pickle. The engine's ``open_handles(handles, device)`` decodes each map strictly
(an unknown field, a wrong type or another torch rebuild function raises ``IpcHandleError``),
checks that the buffer lives on the engine's own GPU (device UUIDs compared: the two processes
may number GPUs differently under ``CUDA_VISIBLE_DEVICES``), maps each distinct allocation
once with torch's ``rebuild_cuda_tensor`` (which also keeps torch's IPC reference count: one
share, one mapping, one release) and returns a view per bucket.

Several copies, one per GPU: a sender of several ranks whose GPUs each hold engine workers
(``--train.colocate_all`` on several GPUs, as OpenRLHF's per-GPU IPC handles) sends one set of
handles per GPU in one update; each worker takes the set on its own GPU (``handles_on``).

Lifetime: the sender keeps the buffer unchanged until the engine has answered (it also waits
for its own copies into the buffer before sharing it); the engine waits for its copies out of
the buffer, then drops every view (which unmaps it), then answers.

Both sides use it (the trainer encodes, the engines open). Importing it imports no torch.

What this module does not do: decide buckets or layouts (``weights``), or load tensors (engines).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import msgspec

from treadle.common.errors import BadRequest

if TYPE_CHECKING:
    import torch

FORMAT = 1  # bump when the fields change


class IpcHandleError(BadRequest):
    """A cuda_ipc handle that is malformed, of another GPU, or not a flat byte bucket."""


class IpcHandle(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """The arguments of ``torch.multiprocessing.reductions.rebuild_cuda_tensor`` for one flat
    ``uint8`` bucket (the tensor and storage classes are fixed, so not sent)."""

    format: int
    """``FORMAT`` of the writer."""
    device_uuid: str
    """UUID of the GPU holding the buffer (``torch.cuda.get_device_properties(i).uuid``)."""
    numel: int
    """Bytes in the bucket (a 1-d contiguous uint8 view)."""
    tensor_offset: int
    """Offset of the bucket in its storage, in elements (= bytes)."""
    storage_handle: bytes
    """cudaIpcMemHandle of the allocation holding the storage."""
    storage_size_bytes: int
    """Size of the storage."""
    storage_offset_bytes: int
    """Offset of the storage inside that allocation."""
    ref_counter_handle: bytes
    """torch's shared reference counter (a shared-memory file name) for the allocation."""
    ref_counter_offset: int
    """Slot of this share in that counter."""
    event_handle: bytes | None
    """cudaIpcEventHandle recorded after the sender's writes (None: none sent)."""
    event_sync_required: bool
    """Whether the receiver must wait on ``event_handle`` before reading."""


_ENCODER = msgspec.msgpack.Encoder()
_DECODER = msgspec.msgpack.Decoder(IpcHandle)


def handle_from_reduction(rebuild: Any, args: tuple, device_uuid: str) -> IpcHandle:
    """The ``IpcHandle`` of ``reduce_tensor(t)``'s ``(rebuild, args)`` for a flat uint8 CUDA tensor.

    ``args`` is (tensor_cls, size, stride, tensor_offset, storage_cls, dtype, device, handle,
    storage_size_bytes, storage_offset_bytes, requires_grad, ref_counter_handle,
    ref_counter_offset, event_handle, event_sync_required) as torch 2.x writes it.
    """
    if getattr(rebuild, "__name__", "") != "rebuild_cuda_tensor" or len(args) != 15:
        raise IpcHandleError(f"cuda_ipc: expected torch's rebuild_cuda_tensor with 15 arguments, got "
                             f"{getattr(rebuild, '__name__', rebuild)!r} with {len(args)}")
    (_, size, stride, offset, _, dtype, _, handle, size_bytes, offset_bytes, _, ref_handle, ref_offset,
     event_handle, event_sync) = args
    if str(dtype) != "torch.uint8" or len(size) != 1 or tuple(stride) != (1,):
        raise IpcHandleError(f"cuda_ipc shares flat uint8 buckets only, got {dtype} of shape {list(size)} "
                             f"stride {list(stride)}")
    if not isinstance(handle, bytes) or not handle:
        raise IpcHandleError("cuda_ipc: the bucket has no CUDA allocation to share (empty storage)")
    return IpcHandle(format=FORMAT, device_uuid=device_uuid, numel=int(size[0]), tensor_offset=int(offset),
                     storage_handle=handle, storage_size_bytes=int(size_bytes),
                     storage_offset_bytes=int(offset_bytes), ref_counter_handle=bytes(ref_handle),
                     ref_counter_offset=int(ref_offset), event_handle=event_handle, event_sync_required=bool(event_sync))


def dumps(handle: IpcHandle) -> bytes:
    return _ENCODER.encode(handle)


def loads(data: bytes) -> IpcHandle:
    """Decode and check one handle; anything unexpected raises ``IpcHandleError``."""
    try:
        h = _DECODER.decode(data)
    except (msgspec.DecodeError, msgspec.ValidationError, TypeError) as e:
        raise IpcHandleError(f"cuda_ipc: malformed handle ({len(data)} bytes): {e}") from None
    if h.format != FORMAT:
        raise IpcHandleError(f"cuda_ipc handle format {h.format}, this engine reads {FORMAT}")
    if h.numel <= 0 or h.tensor_offset < 0 or h.storage_size_bytes < h.tensor_offset + h.numel:
        raise IpcHandleError(f"cuda_ipc: bucket [{h.tensor_offset}, {h.tensor_offset + h.numel}) does not lie "
                             f"inside its storage of {h.storage_size_bytes} bytes")
    if h.event_sync_required and not h.event_handle:
        raise IpcHandleError("cuda_ipc: the handle asks for an event wait but carries no event")
    return h


def device_uuid(device: torch.device | str | int) -> str:
    """The UUID of a CUDA device, as both processes can compare it."""
    import torch

    return str(torch.cuda.get_device_properties(device).uuid)


def encode_buckets(buffer: torch.Tensor, spans: list[tuple[int, int]]) -> list[bytes]:
    """One handle per ``(offset, length)`` byte span of a flat uint8 CUDA ``buffer``, all of one
    share of the buffer (open them together, with ``open_handles``)."""
    from torch.multiprocessing.reductions import reduce_tensor

    if not buffer.is_cuda:
        raise IpcHandleError(f"cuda_ipc shares CUDA tensors only, got one on {buffer.device}")
    for off, n in spans:
        if off < 0 or n <= 0 or off + n > buffer.numel():
            raise IpcHandleError(f"cuda_ipc: span [{off}, {off + n}) outside the buffer of {buffer.numel()} bytes")
    rebuild, args = reduce_tensor(buffer)
    base = handle_from_reduction(rebuild, args, device_uuid(buffer.device))
    return [dumps(msgspec.structs.replace(base, numel=n, tensor_offset=base.tensor_offset + off)) for off, n in spans]


def handles_on(handles: list[bytes], uuid: str, buckets: int) -> list[bytes]:
    """The ``buckets`` handles of ``handles`` (one set per GPU holding a copy) whose buffer lives
    on the GPU ``uuid``, in bucket order; ``IpcHandleError`` naming the GPUs there are when that
    GPU has none (or another count)."""
    mine = [h for h in handles if loads(h).device_uuid == uuid]
    if len(mine) != buckets:
        gpus = sorted({loads(h).device_uuid for h in handles})
        if not mine:
            raise IpcHandleError(f"cuda_ipc: the sender's buffers are on GPU(s) {', '.join(gpus)}, this engine on "
                                 f"{uuid}: colocate them (same GPU) or use the collective transport")
        raise IpcHandleError(f"cuda_ipc: {len(mine)} handles on GPU {uuid} for {buckets} buckets")
    return mine


def check_colocated(handle: IpcHandle, device: torch.device, mine: str | None = None) -> None:
    """Raise unless ``handle``'s buffer lives on ``device`` (the engine's own GPU), whose UUID is
    ``mine`` (None: ask CUDA)."""
    if device.type != "cuda":
        raise IpcHandleError(f"cuda_ipc needs an engine on a CUDA device colocated with the sender; this "
                             f"engine runs on {device}")
    mine = mine or device_uuid(device)
    if handle.device_uuid != mine:
        raise IpcHandleError(f"cuda_ipc: the sender's buffer is on GPU {handle.device_uuid}, this engine on "
                             f"{mine}: colocate them (same GPU) or use the collective transport")


def open_handles(handles: list[bytes], device: torch.device | str) -> list[torch.Tensor]:
    """The sender's buckets as uint8 tensors on ``device`` (memory shared, not copied).

    Handles of one allocation (one ``encode_buckets`` call) are mapped once. Wait for any work
    reading the buckets, then drop every reference (views included): that unmaps the memory and
    releases the sender's reference count.
    """
    import torch

    device = torch.device(device)
    decoded = [loads(h) for h in handles]
    for h in decoded[:1]:
        check_colocated(h, device)
    mapped: dict[tuple[bytes, int], torch.Tensor] = {}
    out = []
    for h in decoded:
        if h.device_uuid != decoded[0].device_uuid:
            check_colocated(h, device)
        key = (h.storage_handle, h.storage_offset_bytes)
        if key not in mapped:
            mapped[key] = _map(h, device)
        out.append(mapped[key][h.tensor_offset:h.tensor_offset + h.numel])
    return out


def _map(h: IpcHandle, device: torch.device) -> torch.Tensor:
    """The whole shared storage of ``h`` as a flat uint8 tensor of ``device`` (torch's own rebuild,
    which maps it into that device's context, whichever GPU holds it)."""
    import torch
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    index = device.index if device.index is not None else torch.cuda.current_device()
    return rebuild_cuda_tensor(torch.Tensor, torch.Size([h.storage_size_bytes]), (1,), 0,
                               torch.storage.TypedStorage, torch.uint8, index, h.storage_handle,
                               h.storage_size_bytes, h.storage_offset_bytes, False, h.ref_counter_handle,
                               h.ref_counter_offset, h.event_handle, h.event_sync_required)
