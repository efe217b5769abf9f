# Source on the GPU machine after install_on_device.sh (tools/gpu_tests.sh and device_run.sh do):
# vLLM's site on the path and the variables vLLM needs there; its engine and worker processes
# inherit them.
export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
# the Makefile exports VLLM_TARGET_DEVICE=cpu for the CPU build; here it is CUDA
export VLLM_TARGET_DEVICE=cuda VLLM_CACHE_ROOT=${VLLM_CACHE_ROOT:-/tmp/vllm_cache}
# NVLink multicast must stay off on these machines (KINDS.md)
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
# no network there
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1
export PYTHONUNBUFFERED=1
# torch.cuda.is_available() asks the CUDA runtime, which poisons fork, and vLLM forks its engine core
# unless CUDA is initialised ("Cannot re-initialize CUDA in forked subprocess"): ask NVML instead
export PYTORCH_NVML_BASED_CUDA_CHECK=1
# flashinfer is not carried: without this the sampler imports it unconditionally
# (vllm/v1/sample/ops/topk_topp_sampler.py, flashinfer_sampler_supported) and the
# engine core dies with "ModuleNotFoundError: No module named 'flashinfer'".
export VLLM_USE_FLASHINFER_SAMPLER=0
# a test process that already used CUDA (the HF reference model) cannot fork a working engine core
# ("CUDA error: initialization error" in the second GPU run's bf16 and sleep tests): spawn it
export VLLM_WORKER_MULTIPROC_METHOD=spawn
