from pathlib import Path

from setuptools import find_packages, setup

setup(
    name="torch_wgpu_lora",
    version="0.1.0",
    description="Finetune LoRA adapters of BitNet b1.58 models with WebGPU compute kernels from PyTorch",
    long_description=Path("README.md").read_text(encoding="utf-8") if Path("README.md").exists() else "",
    long_description_content_type="text/markdown",
    python_requires=">=3.10",
    packages=find_packages(include=["torch_wgpu_lora", "torch_wgpu_lora.*"]) + ["torch_wgpu_lora.wgsl"],
    # The shaders live in the top-level wgsl/ folder and ship inside the package.
    package_dir={"torch_wgpu_lora.wgsl": "wgsl"},
    package_data={"torch_wgpu_lora.wgsl": ["*.wgsl"], "torch_wgpu_lora": ["assets/*", "assets/**/*"]},
    # The floors are the first releases with the APIs the package uses (tests/test_packaging.py checks them):
    # torch 2.6: torch.compiler.set_stance, torch.nn.utils.get_total_norm / clip_grads_with_norm_
    # (torch.library.custom_op with register_fake / register_autograd needs 2.4);
    # transformers 5.13: packed AutoBitLinear checkpoints (microsoft/bitnet-b1.58-2B-4T's format) load as
    # ternary weights its forward runs (4.56 and 5.0 report the packed tensors as mismatched; 5.9, 5.11 and
    # 5.12 keep uint8 codes their forward cannot multiply); from_pretrained(dtype=...) needs 4.56.
    # accelerate 1.1: transformers loads quantised BitNet checkpoints only with it (ACCELERATE_MIN_VERSION).
    install_requires=[
        "torch>=2.6",
        "numpy>=1.24",
        "wgpu>=0.32,<0.33",
        "transformers>=5.13",
        "accelerate>=1.1",
        "safetensors>=0.4",
        "tokenizers>=0.19",
        "tqdm>=4.60",
    ],
    # gguf (integrations.gguf, reading and writing GGUF files): 0.11 decodes TQ1_0 / TQ2_0 (gguf.quants); below
    # 0.20 because the tensor table is read through GGUFReader._build_tensors, not a public API. transformers 5.18:
    # PreTrainedTokenizerFast(gguf_file=...) builds the tokenizer of a GGUF of any architecture (5.17 and earlier
    # only of architectures transformers itself loads, which BitNet's are not).
    # Parquet/CSV data and datasets.Dataset inputs (datasets), YAML --config files (pyyaml),
    # report_to="tensorboard" / "wandb"; TRL's SFTTrainer runs models holding our adapters (the tests use it),
    # and torch_wgpu_lora's SFTTrainer / DPOTrainer subclass TRL's (the trl extra).
    extras_require={
        "plot": ["matplotlib>=3.7"],
        "peft": ["peft>=0.19"],
        "trl": ["trl>=1.0", "peft>=0.19", "datasets>=2.14"],
        "gguf": ["gguf>=0.11,<0.20", "transformers>=5.18"],
        "data": ["datasets>=2.14", "pyyaml>=6"],
        "tensorboard": ["tensorboard>=2.12"],
        "wandb": ["wandb>=0.15"],
        # the optional Dawn backend (TORCH_WGPU_LORA_BACKEND=dawn or auto): the wgpu-py API on Dawn
        "dawn": ["wgpudawn>=0.32.0.4,<0.33"],
        "notebooks": ["jupyter", "ipykernel", "matplotlib>=3.7", "pandas>=2"],
        "test": ["pytest>=8", "nbmake>=1.5", "ipykernel", "peft>=0.19", "matplotlib>=3.7", "pandas>=2",
                 "gguf>=0.11,<0.20", "transformers>=5.18", "trl>=1.0", "datasets>=2.14", "tensorboard>=2.12",
                 "pyyaml>=6", "wgpudawn>=0.32.0.4,<0.33"],
    },
    entry_points={"console_scripts": ["torch-wgpu-lora=torch_wgpu_lora.cli:main"]},
)
