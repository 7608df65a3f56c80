"""Synthetic models and runs: what the demo fleet trains, the benchmarks measure and the tests use.

* :mod:`~dcr.models.families` -- tiny and sized configs of the llama, qwen3 and qwen3_moe
  families and their canonical (Hugging Face) tensor shapes;
* :mod:`~dcr.models.synthetic` -- :class:`~dcr.models.synthetic.SyntheticRun`, a deterministic
  sequence of versions of such a model, computed shard by shard;
* :mod:`~dcr.models.updates` -- optimizer-like updates of a chosen fraction of the elements;
* :mod:`~dcr.models.modules` -- a plain torch module holding a state dict;
* :mod:`~dcr.models.hf` -- Hugging Face checkpoint directories written from a state dict;
* :mod:`~dcr.models.compare` -- tensors compared by their stored bits.
"""
