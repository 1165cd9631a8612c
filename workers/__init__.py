"""The worker role: learn the newest version, pull it from the store, generate, post rollouts."""
