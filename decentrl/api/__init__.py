"""The wire contract every role shares: the request and response schema (wire.py), its JSON and
msgpack encodings (encoding.py) and the HTTP client of the orchestrator's API (client.py).
"""
