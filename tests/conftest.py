import os

# No model hub: tiny models are built from a config and tokenizers made locally.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def pytest_collection_modifyitems(config, items):  # noqa: ANN001 - pytest hook signature
    """`gpu` tests need CUDA; `vllm` tests need the vllm package (its own virtualenv)."""
    import importlib.util

    import pytest
    import torch

    skips = {
        "gpu": None if torch.cuda.is_available() else pytest.mark.skip(reason="needs a CUDA GPU"),
        "vllm": None if importlib.util.find_spec("vllm") else pytest.mark.skip(reason="needs vllm installed"),
    }
    for item in items:
        for marker, skip in skips.items():
            if skip is not None and marker in item.keywords:
                item.add_marker(skip)
