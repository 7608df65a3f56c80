"""Tensor math of the training side: bit views, change detection, mappings, records."""
