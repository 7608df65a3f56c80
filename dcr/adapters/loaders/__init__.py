"""Native loaders: plain torch modules and vLLM."""
