"""PyTorch launchers and custom ops (private)."""
