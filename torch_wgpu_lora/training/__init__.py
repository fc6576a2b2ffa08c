"""Training: LR schedules, SFT data in TRL's forms, checkpoints, data parallelism and the Trainer
(its optimizer, ``WgpuAdamW``, lives beside its kernels in ``ops.optimizer``).

>>> # from torch_wgpu_lora import Trainer, train, WgpuAdamW
"""
