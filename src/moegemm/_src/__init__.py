"""moegemm's private implementation: kernels, configs, the launch planner and the launchers.

Nothing here is public API. The public names are listed in ``__all__`` of ``moegemm.torch``,
``moegemm.jax``, ``moegemm.jax.sharding`` and ``moegemm.jax.flax``.
"""
