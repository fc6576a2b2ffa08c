"""Training: the WebGPU AdamW optimiser, LR schedules, Alpaca-style data and the Trainer.

>>> # from torch_wgpu_lora import Trainer, train, WgpuAdamW
"""
