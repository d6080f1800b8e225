"""lens_callbacks.process (pure torch/numpy; never imports lightning)."""
