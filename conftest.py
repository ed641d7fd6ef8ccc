"""Doctest names shared by every docstring example."""

import pytest
import torch
from torch import nn

import functional_shard as fs


@pytest.fixture(autouse=True)
def _doctest_names(doctest_namespace: dict) -> None:
    doctest_namespace.update(torch=torch, nn=nn, fs=fs)
