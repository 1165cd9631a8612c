"""The worker role: learn the newest version, pull it from the store, generate, post rollouts.

main.py builds a worker from the run config (`decentrl worker`); worker.py is the loop (lease
slots, the weight swapper), with lease_loop.py (ask, renew, post with the spool; the scorer's
too), batching.py, episodes.py and sample.py its parts; backends/ the inference engines;
simulation.py the benchmark-only injected latency; evaluate.py scores a version (`decentrl eval`);
scorer.py and scorers/ the scorer role.
"""
