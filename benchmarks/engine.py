"""``python -m benchmarks.engine``: the whole-model benchmark (see torch_wgpu_lora.benchmarks.engine)."""

import sys

from torch_wgpu_lora.benchmarks.engine import main

if __name__ == "__main__":
    sys.exit(main())
