"""Training: LR schedules, SFT data in TRL's forms, checkpoints, data parallelism and the Trainer
(its optimizer, ``WgpuAdamW``, is ``torch_wgpu_lora.optim``'s).

>>> # from torch_wgpu_lora import Trainer, train, WgpuAdamW
"""
