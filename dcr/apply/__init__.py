"""Receiver data plane: scratch, dispatch hook, loader-path classification, prewarm."""
