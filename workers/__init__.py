"""The worker role (`decentrl worker`, main.py): lease prompts, generate with the newest version
loaded, post rollouts. Also the scorer role (`decentrl scorer`, scorer.py and scorers/) and
`decentrl eval` (evaluate.py).
"""
