"""Training: LR schedules, Alpaca-style data, checkpoints, data parallelism and the Trainer
(its optimizer, ``WgpuAdamW``, is ``torch_wgpu_lora.optim``'s).

>>> # from torch_wgpu_lora import Trainer, train, WgpuAdamW
"""
