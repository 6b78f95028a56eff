"""JAX launchers and custom_vjp ops (private)."""
