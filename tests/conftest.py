"""Shared fixtures and the test session's environment (the packaged SmolLM2 for end-to-end checks;
tiny random models and synthetic tensors live in ``helpers.py``)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
# Tests never write to the user's home: kvpack's cache (the converted default model, the default
# prefix store) goes to a directory of the checkout (git-ignored), kept between runs so that the
# GGUF is converted once, unless the caller chose one.
os.environ.setdefault("KVPACK_CACHE_DIR", str(Path(__file__).resolve().parent.parent / ".kvpack-test-cache"))
# Without a GPU, Triton kernels are checked on CPU tensors by the Triton interpreter; the variable
# must be set before triton is first imported.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Imported after the variables above: importing kvpack imports transformers, which imports Triton.
from .helpers import RedisServer  # noqa: E402


@pytest.fixture(scope="session")
def smollm2():
    """(model, tokenizer) of the packaged default model, loaded once per session."""
    from kvpack.hf.models import load_model

    return load_model("smollm2")


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory):
    """A real redis-server on 127.0.0.1 (a free port) for the session, stopped by PID at the end."""
    server = RedisServer(tmp_path_factory.mktemp("redis"))
    yield server
    server.stop()


@pytest.fixture
def redis_url(redis_server):
    """The session's server, emptied for this test."""
    client = redis_server.client()
    client.flushall()
    client.close()
    return redis_server.url
