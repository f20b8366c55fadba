"""``python -m stem_megatron.flops``: the same as ``stem-flops``."""

from stem_megatron.flops.cli import main

if __name__ == "__main__":
    main()
