"""``python -m torch_wgpu_lora``: the same command line as ``torch-wgpu-lora`` (see ``cli``)."""

import sys

from .cli import main

sys.exit(main())
