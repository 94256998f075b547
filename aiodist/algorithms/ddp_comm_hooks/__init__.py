"""DDP communication hooks (torch's ``torch.distributed.algorithms.ddp_comm_hooks``):
``default_hooks.allreduce_hook``, ``fp16_compress_hook``, ``bf16_compress_hook`` and the
``*_compress_wrapper`` forms, for ``DistributedDataParallel.register_comm_hook`` and the
``Reducer`` under it."""

from aiodist.algorithms.ddp_comm_hooks import default_hooks

__all__ = ["default_hooks"]
