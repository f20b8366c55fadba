#!/usr/bin/env python
"""FLOPs / parameters / training ROI of STEM vs dense models: a thin wrapper of ``stem-flops``.

Same arguments as ``stem-flops`` (``stem_megatron.flops.cli.main``); see docs/flops.md. Example:
``.venv/bin/python tools/estimate_flops.py 'qwen2.5_*' --ratio all``.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from stem_megatron.flops.cli import main

if __name__ == "__main__":
    main()
