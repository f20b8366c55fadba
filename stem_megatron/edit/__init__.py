"""Knowledge editing on STEM tables (paper §5.2): reversible row copies/swaps ``e_src <- e_tgt``."""

from stem_megatron.edit.edits import EditRecord, StemEditor, load_log
from stem_megatron.edit.row_plan import STRATEGIES, RowPlan, plan_rows

__all__ = ["EditRecord", "StemEditor", "load_log", "STRATEGIES", "RowPlan", "plan_rows"]
