"""Real-data pipeline for the demo run: corpus preparation and token-window batching."""
