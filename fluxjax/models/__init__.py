"""Flax NNX Qwen2.5-VL family: model, processing, tokenizer, HF interop."""
