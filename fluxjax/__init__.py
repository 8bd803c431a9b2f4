"""fluxjax: RL post-training of vision-language models on JAX/XLA meshes."""

__version__ = "0.1.0"
