"""The torch engine backend: a transformers causal LM in this process, continuous batching over a
slot KV cache (``engine.TorchEngine``), a fast decoder for Llama-family models (``decoder``)
and transformers' own forward for the rest (``model``). ``backend.open_torch_engine`` starts it."""
