import pathlib
import sys

import pytest

# Test helpers (ir_fixtures, hf_tiny) live beside the tests.
sys.path.insert(0, str(pathlib.Path(__file__).parent))


def pytest_collection_modifyitems(config, items):
    try:
        import torch

        has_gpu = torch.cuda.is_available()
    except Exception:
        has_gpu = False
    if has_gpu:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="module")
def llama_source(tmp_path_factory):
    """A tiny random llama checkpoint (vocabulary 320) with a tokenizer of 300 ids, once per module."""
    from hf_tiny import make_checkpoint
    from tiny_tokenizer import write_tokenizer

    path = tmp_path_factory.mktemp("llama")
    make_checkpoint("llama", path, vocab_size=320)
    write_tokenizer(path, vocab_size=300)
    return path
