"""The model: a Qwen2/Qwen3/Llama-family decoder as pure functions over a parameter pytree.

decoder.py (forward, the KV-cache forward, log-probs and entropy), config.py (ModelConfig), attention.py (naive,
blockwise, segment masks), rope.py, kv_cache.py, sharding.py (logical axes -> mesh shardings), lora.py,
hf_config.py / hf_io.py (HF safetensors in and out), gguf.py (GGUF files via transformers).

Imports: nothing else of sage_jax (the bottom floor, beside rewards/).
"""
