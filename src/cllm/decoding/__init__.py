"""Decoding engines: greedy autoregressive (the oracle) and Jacobi with fast-forward commit.

Token ids in, token ids out: nothing here knows about tokenizers.
"""

from cllm.decoding.autoregressive import greedy_decode
from cllm.decoding.jacobi import IterationEvent, jacobi_decode
from cllm.decoding.stats import DecodeOutput, DecodeStats

__all__ = ["DecodeOutput", "DecodeStats", "IterationEvent", "greedy_decode", "jacobi_decode"]
