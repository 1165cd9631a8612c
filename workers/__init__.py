"""The worker role: learn the newest version, pull it from the store, generate, post rollouts.

main.py builds a worker from the run config (`decentrl worker`); worker.py is the loop (lease
slots, the weight swapper, posting), with batching.py, episodes.py, sample.py and spool.py its
parts; backends/ the inference engines; simulation.py the benchmark-only injected latency;
evaluate.py scores a version (`decentrl eval`).
"""
