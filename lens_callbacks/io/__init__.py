"""lens_callbacks.io (pure torch/numpy; never imports lightning)."""
