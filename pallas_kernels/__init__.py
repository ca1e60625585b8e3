"""Pallas kernels (INT4 matmul, grouped MoE matmul, paged attention) and their plain-jnp references."""
