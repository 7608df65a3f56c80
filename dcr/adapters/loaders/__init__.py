"""Native loaders: plain torch modules, a sharded reference receiver, vLLM."""
