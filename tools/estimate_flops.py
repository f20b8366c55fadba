#!/usr/bin/env python
"""FLOPs / parameters / training ROI of STEM vs dense models: a thin wrapper of ``stem-flops``.

Same arguments as ``stem-flops`` (``stem_megatron.flops.cli.main``); see docs/flops.md. Example:
``.venv/bin/python tools/estimate_flops.py 'qwen2.5_*' --ratio all``.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's stem_megatron, installed or not
from stem_megatron.setup_check import require_environment  # noqa: E402

require_environment()  # another Python gets `make setup`, not a traceback

from stem_megatron.flops.cli import main  # noqa: E402

if __name__ == "__main__":
    main()
