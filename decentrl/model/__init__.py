"""The policy model: building version 0 (build.py), tokenizers (tokenizer.py), local chat models and
real shapes (chat_model.py), the sampling distribution and stop rules (sampling.py, stopping.py), MoE
routing (routers.py, routing.py) and the devices a role runs on (devices.py).
"""
