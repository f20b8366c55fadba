"""What replacing the FFN up-projection ``W_u`` by STEM's table row ``U_l[t]`` costs and saves: FLOPs
(the paper's Table 1 and §3.1, and the exact matmul count), parameters, training ROI and MFU.

One module per concern; import from the module (``stem_megatron.flops.counts``), not from here. The
command line is ``stem-flops`` (``stem_megatron.flops.cli``); see docs/flops.md.
"""
