"""The checkpoint store: versions as HF directories with a BLAKE3 manifest written last
(checkpoints.py), the manifest and its signature (manifest.py, signing.py), the verified local cache
(cache.py), delta versions (delta.py) and reading and writing the weights (weights.py).
"""
