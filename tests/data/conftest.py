"""Fixtures shared by the data tests: the pydoc corpus, the MiniLM tokenizer and pairs built
from them are made once per test run."""

import pytest

from qkv.data import make_nsp_examples, minilm_wordpiece, pydoc_documents, pydoc_texts
from qkv.models.checkpoints.bundled import default_model_path


@pytest.fixture(scope="session")
def minilm_folder():
    return default_model_path()


@pytest.fixture(scope="session")
def minilm():
    return minilm_wordpiece()


@pytest.fixture(scope="session")
def documents():
    return pydoc_documents()


@pytest.fixture(scope="session")
def texts():
    return pydoc_texts()


@pytest.fixture(scope="session")
def nsp_examples(documents, minilm):
    """Pairs of at most 128 tokens from pydoc with the MiniLM vocabulary, seed 0 (about 1000)."""
    return make_nsp_examples(documents, minilm, max_length=128, seed=0)
