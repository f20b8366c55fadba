"""The single-process export: its format, the writer that gathers a run into it, and the model it loads into."""
