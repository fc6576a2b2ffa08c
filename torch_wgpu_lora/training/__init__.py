"""Training: the WebGPU AdamW optimiser, LR schedules, SFT data in TRL's forms and the Trainer.

>>> # from torch_wgpu_lora import Trainer, train, WgpuAdamW
"""
