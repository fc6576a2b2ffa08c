"""Run the LoRA op benchmark: ``python -m benchmarks.lora_op --out benchmarks/out``.

The harness lives in the package (``torch_wgpu_lora.benchmarks``) so that
``torch-wgpu-lora bench`` and the kernels notebook use the same code.
"""

import sys

from torch_wgpu_lora.benchmarks.cli import main

if __name__ == "__main__":
    sys.exit(main())
