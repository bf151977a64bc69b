"""Measuring models: text measures, held-out loss and decoding, the quality gates, HumanEval."""
