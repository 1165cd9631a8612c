"""decentrl: decentralized, asynchronous reinforcement learning for language models.

`decentrl/` is what every role shares (config, wire contract, checkpoint store, staleness rule,
losses, tasks, the trainer and the CLI); `orchestrator/` and `workers/` are the other two roles.
"""

__version__ = "0.1.0"
