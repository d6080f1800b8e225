"""lens_callbacks.anchor (pure torch/numpy; never imports lightning)."""
